"""The fields today's clients send (Codex CLI, Claude Code, agent SDKs), each accepted with a meaning here, through
real gunicorn on the tiny model; what cannot be honoured is a 400 naming it."""

import base64
import json
import re
import time

import anthropic
import openai
import pytest
import requests

from .support.scripted import run_scripted

ASK = [{"role": "user", "content": "Weather in Paris?"}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


@pytest.fixture(scope="module")
def scripted(tiny_model, tmp_path_factory):
    models = {"tiny": {"path": str(tiny_model), "engine": "tests.support.scripted:KIND"}, "real": {"path": str(tiny_model)}}
    with run_scripted(tmp_path_factory.mktemp("today"), models, "tiny") as server:
        yield server


def test_chat_takes_todays_fields(scripted):
    scripted.say("Sunny.")
    reply = scripted.post("/v1/chat/completions", {
        "model": "tiny", "messages": ASK, "verbosity": "low", "prompt_cache_key": "conversation-1",
        "safety_identifier": "user-1", "reasoning_effort": "xhigh", "web_search_options": {"search_context_size": "low"},
    })
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["message"]["content"] == "Sunny."
    assert reply.headers["Kronk-Tools-Not-Offered"] == "web_search"  # said, never silently dropped
    deadline = time.monotonic() + 30  # the request's log line is written when the server closes the response
    while '"tools_not_offered": ["web_search"]' not in scripted.logs():
        assert time.monotonic() < deadline
        time.sleep(0.1)


def test_llama_servers_grammar_fields_constrain_the_reply(scripted):
    common = {"model": "real", "max_tokens": 20, "temperature": 0}
    chat = scripted.post("/v1/chat/completions", {**common, "messages": ASK, "grammar": 'root ::= "yes" | "no"'})
    assert chat.status_code == 200, chat.text
    assert chat.json()["choices"][0]["message"]["content"] in ("yes", "no")
    completion = scripted.post("/v1/completions", {**common, "prompt": "Answer:", "grammar": 'root ::= [0-9]{3}'})
    assert completion.status_code == 200, completion.text
    text = completion.json()["choices"][0]["text"]
    assert len(text) == 3 and text.isdigit()
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    shaped = scripted.post("/v1/chat/completions", {**common, "max_tokens": 30, "messages": ASK, "json_schema": schema})
    content = shaped.json()["choices"][0]["message"]["content"]
    assert shaped.json()["choices"][0]["finish_reason"] != "stop" or isinstance(json.loads(content)["ok"], bool)
    broken = scripted.post("/v1/chat/completions", {**common, "messages": ASK, "grammar": "root ::= (("})
    assert broken.status_code == 400 and broken.json()["error"]["param"] == "grammar"


def test_a_final_assistant_message_is_continued_on_both_apis(scripted):
    """The Messages API continues a final assistant message; chat does with vLLM's continue_final_message."""
    prefill = [{"role": "user", "content": "Give it as JSON"}, {"role": "assistant", "content": '{"capital": "'}]
    scripted.say('Paris"}')
    client = anthropic.Anthropic(base_url=scripted.url, api_key="unused", max_retries=0)
    message = client.messages.create(model="tiny", max_tokens=20, messages=prefill)
    assert message.content[0].text == 'Paris"}'
    scripted.say('Paris"}')
    chat = scripted.post("/v1/chat/completions", {"model": "tiny", "messages": prefill, "continue_final_message": True,
                                                  "add_generation_prompt": False})
    assert chat.json()["choices"][0]["message"]["content"] == 'Paris"}'
    closed = scripted.post("/v1/chat/completions", {"model": "tiny", "messages": prefill})
    continued = chat.json()["usage"]["prompt_tokens"]
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == continued
    assert closed.json()["usage"]["prompt_tokens"] > continued  # OpenAI's own: the turn is closed, a new one opened


def test_anthropic_takes_what_claude_code_sends(scripted):
    scripted.say("Hi.")
    body = {
        "model": "tiny", "max_tokens": 32_000, "stream": False,
        "system": [{"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral", "ttl": "1h"}}],
        "messages": [{"role": "user", "content": "hello"}, {"role": "system", "content": "Keep it short."},
                     {"role": "user", "content": [{"type": "text", "text": "say hi"}]}],
        "thinking": {"type": "adaptive"}, "output_config": {"effort": "low"}, "metadata": {"user_id": "u1"},
        "service_tier": "auto",
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"},
                                          {"type": "clear_tool_uses_20250919", "trigger": {"type": "input_tokens", "value": 30000}}]},
        "tools": [{"type": "web_search_20250305", "name": "web_search", "max_uses": 5},
                  {"name": "Read", "description": "Read a file", "input_schema": {"type": "object"}}],
    }
    reply = requests.post(scripted.url + "/v1/messages?beta=true", json=body, timeout=60, headers={
        "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14,context-management-2025-06-27",
        "anthropic-version": "2023-06-01"})
    assert reply.status_code == 200, reply.text
    assert reply.json()["content"][-1]["text"] == "Hi." and reply.headers["Kronk-Tools-Not-Offered"] == "web_search"


def test_documents_are_read_as_text_and_a_pdf_is_refused_by_name(scripted):
    scripted.say("Read.")
    text = {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "The sky is green."},
            "title": "Notes"}
    encoded = {"type": "document", "source": {"type": "base64", "media_type": "text/plain",
                                              "data": base64.b64encode(b"Grass is blue.").decode()}}
    counted = [scripted.post("/v1/messages/count_tokens", {"model": "tiny", "messages": [
        {"role": "user", "content": content}]}).json()["input_tokens"]
        for content in ([{"type": "text", "text": "hi"}], [text, encoded, {"type": "text", "text": "hi"}])]
    assert counted[1] > counted[0] + 8  # the documents are in the prompt
    pdf = {"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": "JVBERi0="}}
    refused = scripted.post("/v1/messages", {"model": "tiny", "max_tokens": 5, "messages": [
        {"role": "user", "content": [pdf]}]})
    assert refused.status_code == 400 and "application/pdf" in refused.json()["error"]["message"]


def test_context_editing_clears_the_oldest_tool_results_and_says_what_it_cleared(scripted):
    client = anthropic.Anthropic(base_url=scripted.url, api_key="unused", max_retries=0)

    def turn(i):
        name = "Read" if i else "Pinned"
        return [{"role": "assistant", "content": [
            {"type": "thinking", "thinking": f"Reading part {i}.", "signature": "s"},
            {"type": "tool_use", "id": f"t{i}", "name": name, "input": {"part": i}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"t{i}", "content": f"part {i} " * 4}]}]

    messages = [{"role": "user", "content": "go"}] + [m for i in range(6) for m in turn(i)]
    tools = [{"name": name, "input_schema": {"type": "object"}} for name in ("Read", "Pinned")]
    edits = [{"type": "clear_tool_uses_20250919", "trigger": {"type": "input_tokens", "value": 100},
              "keep": {"type": "tool_uses", "value": 2}, "exclude_tools": ["Pinned"], "clear_tool_inputs": ["Read"]},
             {"type": "clear_thinking_20251015", "keep": {"type": "thinking_turns", "value": 2}}]
    plain = client.messages.count_tokens(model="tiny", messages=messages, tools=tools).input_tokens
    counted = client.beta.messages.count_tokens(model="tiny", messages=messages, tools=tools,
                                                context_management={"edits": edits})
    assert counted.context_management.original_input_tokens == plain > counted.input_tokens
    scripted.say("Done.")
    reply = client.beta.messages.create(model="tiny", max_tokens=8, messages=messages, tools=tools,
                                        context_management={"edits": edits})
    cleared_tools, cleared_thinking = (edit.model_dump() for edit in reply.context_management.applied_edits)
    # t0 is a Pinned use, kept; of t1-t5 the last two stay: t1, t2 and t3 are cleared
    assert cleared_tools == {"type": "clear_tool_uses_20250919", "cleared_tool_uses": 3,
                             "cleared_input_tokens": plain - counted.input_tokens}
    assert cleared_thinking == {"type": "clear_thinking_20251015", "cleared_thinking_turns": 4,
                                "cleared_input_tokens": 0}  # earlier thinking is never in the prompt here
    assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens == counted.input_tokens
    scripted.say("Done.")
    with client.beta.messages.stream(model="tiny", max_tokens=8, messages=messages, tools=tools,
                                     context_management={"edits": edits[:1]}) as stream:
        final = stream.get_final_message()
    assert [e.type for e in final.context_management.applied_edits] == ["clear_tool_uses_20250919"]
    scripted.say("Done.")
    spared = client.beta.messages.create(model="tiny", max_tokens=8, messages=messages, tools=tools,
                                         context_management={"edits": [{**edits[0], "clear_at_least": {
                                             "type": "input_tokens", "value": 10 * plain}}]})
    assert spared.context_management.applied_edits == []  # too little to clear: the prompt stays as it was
    assert spared.usage.input_tokens + spared.usage.cache_read_input_tokens == plain
    refused = scripted.post("/v1/messages", {"model": "tiny", "max_tokens": 8, "messages": messages,
                                             "context_management": {"edits": [{**edits[1], "exclude_tools": []}]}})
    assert refused.status_code == 400 and "exclude_tools" in refused.text


def test_responses_takes_what_codex_sends(scripted):
    scripted.say("Done.")
    client = openai.OpenAI(base_url=scripted.url + "/v1", api_key="unused", max_retries=0)
    raw = client.responses.with_raw_response.create(
        model="tiny", instructions="You are Codex.", input=[{"type": "message", "role": "user",
                                                             "content": [{"type": "input_text", "text": "fix it"}]}],
        tools=[{"type": "function", "name": "shell_command", "description": "run", "strict": False,
                "parameters": {"type": "object", "properties": {"command": {"type": "string"}}}},
               {"type": "web_search"}],
        tool_choice="auto", parallel_tool_calls=False, reasoning={"effort": "medium", "summary": "auto"}, store=False,
        stream=False, include=["reasoning.encrypted_content"], prompt_cache_key="thread-1",
        text={"verbosity": "low"}, safety_identifier="s", max_tool_calls=4, truncation="auto",
    )
    response = raw.parse()
    assert raw.headers["Kronk-Tools-Not-Offered"] == "web_search"
    assert response.output_text == "Done." and response.truncation == "auto" and response.max_tool_calls == 4
    for reasoning in (None, {}):
        assert client.responses.create(model="tiny", input="hi", reasoning=reasoning, max_output_tokens=5).status
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model="tiny", input="hi", background=True, store=False)  # nowhere to poll it
    assert caught.value.body["param"] == "background"


def test_max_tool_calls_is_enforced(scripted):
    scripted.say(CALL + "\n" + CALL.replace("Paris", "Lyon"))
    client = openai.OpenAI(base_url=scripted.url + "/v1", api_key="unused", max_retries=0)
    tools = [{"type": "function", "name": "get_weather", "parameters": WEATHER, "strict": False}]
    both = client.responses.create(model="tiny", input="Weather?", tools=tools, max_output_tokens=200)
    assert [item.type for item in both.output].count("function_call") == 2
    scripted.say(CALL + "\n" + CALL.replace("Paris", "Lyon"))
    one = client.responses.create(model="tiny", input="Weather?", tools=tools, max_output_tokens=200, max_tool_calls=1)
    assert [item.type for item in one.output].count("function_call") == 1


def test_truncation_auto_drops_the_oldest_input_until_it_fits(scripted):
    client = openai.OpenAI(base_url=scripted.url + "/v1", api_key="unused", max_retries=0)
    history = [{"role": "user" if i % 2 == 0 else "assistant", "content": "word " * 400} for i in range(6)]
    history.append({"role": "user", "content": "And now?"})
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model="tiny", input=history, max_output_tokens=5)
    scripted.say("Now.")
    fitted = client.responses.create(model="tiny", input=history, max_output_tokens=5, truncation="auto",
                                     instructions="Be brief.")
    assert fitted.output_text == "Now." and fitted.usage.input_tokens < 2048


PATCH = '<tool_call>\n{"name": "apply_patch", "arguments": {"input": "*** Begin Patch\\n*** End Patch"}}\n</tool_call>'


def test_custom_tools_take_free_form_input_and_come_back_as_custom_calls(scripted):
    client = openai.OpenAI(base_url=scripted.url + "/v1", api_key="unused", max_retries=0)
    tools = [{"type": "custom", "name": "apply_patch", "description": "Apply a patch", "format": {"type": "text"}},
             {"type": "custom", "name": "sql", "format": {"type": "grammar", "syntax": "lark",
                                                          "definition": 'start: "SELECT" /.+/'}}]
    scripted.say(PATCH)
    (call,) = client.responses.create(model="tiny", input="Fix it", tools=tools).output
    assert call.type == "custom_tool_call" and call.name == "apply_patch"
    assert call.input == "*** Begin Patch\n*** End Patch"
    scripted.say('<tool_call>\n{"name": "sql"}\nSELECT name FROM towns\n</tool_call>')  # the raw form
    (query,) = client.responses.create(model="tiny", input="Which towns?", tools=tools).output
    assert query.type == "custom_tool_call" and query.name == "sql" and query.input == "SELECT name FROM towns"
    scripted.say(PATCH)
    with client.responses.stream(model="tiny", input="Fix it", tools=tools) as stream:
        kinds = [event.type for event in stream]
    assert "response.custom_tool_call_input.delta" in kinds and "response.custom_tool_call_input.done" in kinds
    scripted.say("Patched.")
    answered = client.responses.create(model="tiny", tools=tools, input=[
        {"role": "user", "content": "Fix it"},
        {"type": "custom_tool_call", "call_id": call.call_id, "name": "apply_patch", "input": call.input},
        {"type": "custom_tool_call_output", "call_id": call.call_id, "output": "Done!"}])
    assert answered.output_text == "Patched."
    scripted.say(PATCH)
    first = client.responses.create(model="tiny", input="Fix it", tools=tools)
    scripted.say("Patched.")
    later = client.responses.create(model="tiny", tools=tools, previous_response_id=first.id, input=[
        {"type": "custom_tool_call_output", "call_id": first.output[0].call_id, "output": "Done!"}])
    assert later.output_text == "Patched."  # the stored custom call is the conversation's history


def test_regex_and_lark_grammars_constrain_a_custom_tools_input(scripted):
    client = openai.OpenAI(base_url=scripted.url + "/v1", api_key="unused", max_retries=0)
    tools = [{"type": "custom", "name": "dial", "description": "Dial a number",
              "format": {"type": "grammar", "syntax": "regex", "definition": "[0-9]{3}-[0-9]{4}"}}]
    response = client.responses.create(model="real", input="Call the office", tools=tools, temperature=0,
                                       tool_choice={"type": "custom", "name": "dial"}, max_output_tokens=60)
    (call,) = response.output
    assert call.type == "custom_tool_call" and re.fullmatch(r"[0-9]{3}-[0-9]{4}", call.input), call
    lark = [{"type": "custom", "name": "sql", "format": {"type": "grammar", "syntax": "lark",
                                                         "definition": 'start: "SELECT " NAME " FROM " NAME\n'
                                                                       'NAME: /[a-z]{1,12}/'}}]
    response = client.responses.create(model="real", input="Which towns?", tools=lark, temperature=0,
                                       tool_choice={"type": "custom", "name": "sql"}, max_output_tokens=60)
    (call,) = response.output
    assert call.type == "custom_tool_call" and re.fullmatch(r"SELECT [a-z]{1,12} FROM [a-z]{1,12}", call.input), call


def test_the_2026_fields_are_taken_and_what_cannot_be_honoured_is_refused_by_name(scripted):
    client = openai.OpenAI(base_url=scripted.url + "/v1", api_key="unused", max_retries=0)
    marked = [{"type": "text", "text": "Weather in Paris?", "prompt_cache_breakpoint": {"mode": "explicit", "ttl": "12h"}}]
    scripted.say("Sunny.")
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": marked}],
                                          prompt_cache_options={"mode": "explicit", "ttl": "30m"},
                                          prompt_cache_retention="24h")
    assert chat.choices[0].message.content == "Sunny."
    scripted.say("Sunny.")
    response = client.responses.create(
        model="tiny", prompt_cache_options={"mode": "implicit"}, prompt_cache_retention="in_memory",
        background_options={"completion_window": "soonest"}, image={"context_compression": "auto"},
        access_programs={"cyber": "standard"},
        input=[{"role": "user", "content": [{"type": "input_text", "text": "Weather?",
                                             "prompt_cache_breakpoint": {"mode": "explicit"}}]}])
    assert response.output_text == "Sunny."
    refused = [("/v1/chat/completions", {"messages": ASK, "audio": {"voice": "alloy", "format": "wav"}}, "audio"),
               ("/v1/chat/completions", {"messages": ASK, "moderation": {"model": "omni-moderation-latest"}},
                "moderation"),
               ("/v1/responses", {"input": "hi", "conversation": "conv_1"}, "conversation"),
               ("/v1/responses", {"input": "hi", "prompt": {"id": "pmpt_1"}}, "prompt")]
    for path, body, field in refused:
        answer = scripted.post(path, {"model": "tiny", **body})
        assert answer.status_code == 400 and answer.json()["error"]["param"] == field, answer.text
        assert "here" in answer.json()["error"]["message"]  # why, not only what
    scripted.say("Sunny.")
    message = anthropic.Anthropic(base_url=scripted.url, api_key="unused", max_retries=0).messages.create(
        model="tiny", max_tokens=20, messages=ASK, speed="standard", inference_geo="us", container="container_1",
        extra_body={"user_profile_id": "profile-1", "workspace_id": "wrkspc_1"})
    assert message.content[0].text == "Sunny."


def test_todays_input_items_are_taken_as_the_sdk_writes_them(scripted):
    client = openai.OpenAI(base_url=scripted.url + "/v1", api_key="unused", max_retries=0)
    scripted.say("It is sunny.")
    response = client.responses.create(model="tiny", input=[
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "message", "role": "assistant", "phase": "commentary", "status": "completed", "id": "msg_1",
         "content": [{"type": "output_text", "text": "Let me look.", "annotations": []}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}',
         "caller": {"type": "direct"}, "namespace": "weather"},
        {"type": "function_call_output", "call_id": "call_1", "name": "get_weather", "namespace": "weather",
         "caller": {"type": "direct"}, "output": [{"type": "input_text", "text": "sunny, "},
                                                  {"type": "input_text", "text": "22 C"}]}])
    assert response.output_text == "It is sunny."
    image = scripted.post("/v1/responses", {"model": "tiny", "input": [
        {"type": "function_call_output", "call_id": "call_1",
         "output": [{"type": "input_image", "image_url": "data:image/png;base64,AA=="}]}]})
    assert image.status_code == 400 and image.json()["error"]["param"].startswith("input[0]")


def test_chat_custom_tools_and_allowed_tools(scripted):
    client = openai.OpenAI(base_url=scripted.url + "/v1", api_key="unused", max_retries=0)
    patch = {"type": "custom", "custom": {"name": "apply_patch", "description": "Apply a patch"}}
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}
    scripted.say(PATCH)
    reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Fix it"}],
                                           tools=[patch, weather])
    (call,) = reply.choices[0].message.tool_calls
    assert call.type == "custom" and call.custom.name == "apply_patch"
    assert call.custom.input == "*** Begin Patch\n*** End Patch" and reply.choices[0].finish_reason == "tool_calls"
    scripted.say(PATCH)
    chunks = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Fix it"}],
                                                 tools=[patch, weather], stream=True))
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or ()]
    # The SDK types stream deltas of function calls only: a custom call's delta comes through as it is written.
    assert deltas[0].type == "custom" and deltas[0].custom["name"] == "apply_patch"
    assert "".join(d.custom.get("input", "") for d in deltas) == call.custom.input
    scripted.say("Patched.")
    answered = client.chat.completions.create(model="tiny", tools=[patch, weather], messages=[
        {"role": "user", "content": "Fix it"},
        {"role": "assistant", "tool_calls": [{"id": call.id, "type": "custom",
                                              "custom": {"name": "apply_patch", "input": call.custom.input}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "Done!"}])
    assert answered.choices[0].message.content == "Patched."
    sql = {"type": "custom", "custom": {"name": "sql", "format": {
        "type": "grammar", "syntax": "lark", "definition": 'start: "SELECT " NAME " FROM " NAME\nNAME: /[a-z]{1,12}/'}}}
    forced = client.chat.completions.create(model="real", messages=[{"role": "user", "content": "Which towns?"}],
                                            tools=[sql, weather], tool_choice={"type": "custom", "custom": {"name": "sql"}},
                                            temperature=0, max_tokens=60)
    (query,) = forced.choices[0].message.tool_calls
    assert query.type == "custom" and re.fullmatch(r"SELECT [a-z]{1,12} FROM [a-z]{1,12}", query.custom.input)
    allowed = {"type": "allowed_tools", "allowed_tools": {"mode": "required", "tools": [
        {"type": "function", "function": {"name": "get_weather"}}]}}
    only = client.chat.completions.create(model="real", messages=[{"role": "user", "content": "Anything"}],
                                          tools=[sql, weather], tool_choice=allowed, temperature=0, max_tokens=60)
    assert [c.function.name for c in only.choices[0].message.tool_calls] == ["get_weather"]  # the one allowed
    unknown = scripted.post("/v1/chat/completions", {"model": "tiny", "messages": ASK, "tools": [weather],
                                                     "tool_choice": {**allowed, "allowed_tools": {
                                                         "mode": "auto", "tools": [{"type": "function",
                                                                                    "function": {"name": "nope"}}]}}})
    assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "tool_choice"
    responses_allowed = {"type": "allowed_tools", "mode": "required", "tools": [{"type": "function",
                                                                                 "name": "get_weather"}]}
    response = client.responses.create(model="real", input="Anything", temperature=0, max_output_tokens=60,
                                       tools=[{"type": "custom", "name": "sql", "format": sql["custom"]["format"]},
                                              {"type": "function", "name": "get_weather", "parameters": WEATHER}],
                                       tool_choice=responses_allowed)
    assert [item.name for item in response.output] == ["get_weather"]


def test_a_call_cut_off_by_the_token_limit_is_stored_and_its_conversation_goes_on(scripted):
    client = openai.OpenAI(base_url=scripted.url + "/v1", api_key="unused", max_retries=0)
    tools = [{"type": "function", "name": "get_weather", "parameters": WEATHER}]
    cut = client.responses.create(model="real", input="Weather?", tools=tools, tool_choice="required",
                                  max_output_tokens=3, temperature=0)
    assert cut.status == "incomplete" and cut.output[0].type == "function_call"
    assert cut.output[0].status == "incomplete"
    later = client.responses.create(model="real", input="Go on.", previous_response_id=cut.id, max_output_tokens=3)
    assert later.status in ("completed", "incomplete")


def test_count_tokens_takes_the_fields_messages_take(scripted):
    client = anthropic.Anthropic(base_url=scripted.url, api_key="unused", max_retries=0)
    counted = client.messages.count_tokens(
        model="tiny", messages=ASK, cache_control={"type": "ephemeral"}, speed="standard",
        output_config={"format": {"type": "json_schema", "schema": WEATHER}},
        extra_body={"user_profile_id": "profile-1", "workspace_id": "wrkspc_1"})
    assert counted.input_tokens == client.messages.count_tokens(model="tiny", messages=ASK).input_tokens


def test_legacy_function_calling_is_served_as_it_was(scripted):
    client = openai.OpenAI(base_url=scripted.url + "/v1", api_key="unused", max_retries=0)
    functions = [{"name": "get_weather", "description": "Weather in a city", "parameters": WEATHER}]
    scripted.say(CALL)
    reply = client.chat.completions.create(model="tiny", messages=ASK, functions=functions)
    choice = reply.choices[0]
    assert choice.finish_reason == "function_call" and not choice.message.tool_calls
    assert choice.message.function_call.name == "get_weather"
    assert json.loads(choice.message.function_call.arguments) == {"city": "Paris"}
    scripted.say(CALL)
    chunks = list(client.chat.completions.create(model="tiny", messages=ASK, functions=functions, stream=True))
    calls = [c.choices[0].delta.function_call for c in chunks if c.choices and c.choices[0].delta.function_call]
    assert calls[0].name == "get_weather" and "".join(c.arguments for c in calls) == '{"city": "Paris"}'
    assert chunks[-1].choices[0].finish_reason == "function_call"
    scripted.say("Sunny.")
    answered = client.chat.completions.create(model="tiny", functions=functions, function_call="auto", messages=[
        *ASK, {"role": "assistant", "content": None, "function_call": choice.message.function_call.model_dump()},
        {"role": "function", "name": "get_weather", "content": "sunny"}])
    assert answered.choices[0].message.content == "Sunny." and answered.choices[0].finish_reason == "stop"
    forced = client.chat.completions.create(model="real", messages=ASK, functions=functions, temperature=0,
                                            function_call={"name": "get_weather"}, max_tokens=40)
    assert forced.choices[0].message.function_call.name == "get_weather"
    both = scripted.post("/v1/chat/completions", {"model": "tiny", "messages": ASK, "functions": functions,
                                                  "tools": [{"type": "function", "function": functions[0]}]})
    assert both.status_code == 400


def test_cache_diagnostics_say_what_changed_since_the_previous_message(scripted):
    client = anthropic.Anthropic(base_url=scripted.url, api_key="unused", max_retries=0)
    system = "You answer questions about the weather, briefly."

    def ask(messages, previous, **fields):
        scripted.say("Sunny.")
        message = client.messages.create(model="tiny", max_tokens=20, system=fields.pop("system", system),
                                         messages=messages, diagnostics={"previous_message_id": previous}, **fields)
        return message.id, message.diagnostics

    first, diagnostics = ask(ASK, None)
    assert diagnostics is None  # opted in on the first turn: nothing to compare with
    turn = ASK + [{"role": "assistant", "content": "Sunny."}, {"role": "user", "content": "And tomorrow?"}]
    second, diagnostics = ask(turn, first)
    assert diagnostics is None  # only appended to: the prefix was the same
    edited = [{"role": "user", "content": "Weather in Lyon?"}] + turn[1:]
    _, diagnostics = ask(edited, second)
    assert diagnostics.cache_miss_reason.type == "messages_changed"
    assert diagnostics.cache_miss_reason.cache_missed_input_tokens > 0
    _, diagnostics = ask(turn, second, system="Another system prompt.")
    assert diagnostics.cache_miss_reason.type == "system_changed"
    _, diagnostics = ask(turn, "msg_unknown")
    assert diagnostics.cache_miss_reason.type == "previous_message_not_found"
    scripted.say("Sunny.")
    streamed = client.messages.create(model="tiny", max_tokens=20, system="Changed.", messages=turn, stream=True,
                                      diagnostics={"previous_message_id": second})
    start = next(iter(streamed))
    assert start.type == "message_start" and start.message.diagnostics.cache_miss_reason.type == "system_changed"
