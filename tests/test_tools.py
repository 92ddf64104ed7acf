"""Tool calling through every protocol.

A random tiny model never writes a tool call, so most tests here run the
scripted engine (tests.support.scripted: the real engine with its sampling
steered to a script); the last ones run the plain real engine.
"""

import json

import anthropic
import openai
import pytest

from .support.scripted import run_scripted
from kronk_wsgi.testing.rawhttp import RawStream

SCRIPTED = "tests.support.scripted:KIND"
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": WEATHER}}]
ANTHROPIC_TOOLS = [{"name": "get_weather", "description": "Weather now", "input_schema": WEATHER}]
RESPONSES_TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather now", "parameters": WEATHER, "strict": False}]
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def scripted(tiny_model, tmp_path_factory):
    """The scripted model "tiny", and "plain": the same with a template that renders no tools."""
    models = {"tiny": {"path": str(tiny_model), "engine": SCRIPTED},
              "plain": {"path": str(tiny_model), "engine": SCRIPTED, "chat_template": "plain"}}
    with run_scripted(tmp_path_factory.mktemp("scripted"), models, "tiny") as server:
        yield server


@pytest.fixture
def say(scripted):
    """Set what the scripted model writes next."""
    return scripted.say


@pytest.fixture
def oa(scripted):
    return openai.OpenAI(base_url=scripted.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture
def an(scripted):
    return anthropic.Anthropic(base_url=scripted.url, api_key="unused", max_retries=0)


def test_chat_tool_call(say, oa):
    say("Let me check.\n" + CALL)
    choice = oa.chat.completions.create(model="tiny", messages=ASK, tools=CHAT_TOOLS).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    [call] = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}


def test_chat_tool_call_streamed(say, oa):
    say("Let me check.\n" + CALL + "\n" + CALL.replace("Paris", "Oslo"))
    chunks = list(oa.chat.completions.create(model="tiny", messages=ASK, tools=CHAT_TOOLS, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    calls: dict[int, dict] = {}
    for chunk in chunks:
        for delta in chunk.choices[0].delta.tool_calls or ():
            call = calls.setdefault(delta.index, {"id": delta.id, "name": delta.function.name, "arguments": ""})
            call["arguments"] += delta.function.arguments or ""
    assert text == "Let me check."
    assert [json.loads(c["arguments"])["city"] for c in calls.values()] == ["Paris", "Oslo"]
    assert all(c["id"].startswith("call_") and c["name"] == "get_weather" for c in calls.values())
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_chat_parallel_tool_calls_false_ends_at_the_first(say, oa):
    say(CALL + "\n" + CALL.replace("Paris", "Oslo") + "\nand more text")
    both = oa.chat.completions.create(model="tiny", messages=ASK, tools=CHAT_TOOLS)
    one = oa.chat.completions.create(model="tiny", messages=ASK, tools=CHAT_TOOLS, parallel_tool_calls=False)
    assert len(both.choices[0].message.tool_calls) == 2 and both.choices[0].message.content == "and more text"
    assert len(one.choices[0].message.tool_calls) == 1 and one.choices[0].message.content is None
    assert one.choices[0].finish_reason == "tool_calls"
    assert one.usage.completion_tokens < both.usage.completion_tokens


def test_forced_tool_choice_starts_the_reply_inside_the_call(say, oa, an):
    say('{"city": "Rome"}}\n</tool_call>')  # the prompt already ends with the call's opening
    named = {"type": "function", "function": {"name": "get_weather"}}
    choice = oa.chat.completions.create(model="tiny", messages=ASK, tools=CHAT_TOOLS, tool_choice=named).choices[0]
    assert json.loads(choice.message.tool_calls[0].function.arguments) == {"city": "Rome"}
    message = an.messages.create(model="tiny", max_tokens=64, messages=ASK, tools=ANTHROPIC_TOOLS,
                                 tool_choice={"type": "tool", "name": "get_weather"})
    assert [b.type for b in message.content] == ["tool_use"] and message.content[0].input == {"city": "Rome"}


def test_malformed_or_unwanted_calls_stay_text(say, oa):
    say("<tool_call>{oops}</tool_call>")
    choice = oa.chat.completions.create(model="tiny", messages=ASK, tools=CHAT_TOOLS).choices[0]
    assert (choice.message.content, choice.message.tool_calls, choice.finish_reason) == ("<tool_call>{oops}</tool_call>", None, "stop")
    say(CALL)
    for extra in ({"tool_choice": "none", "tools": CHAT_TOOLS}, {}):
        choice = oa.chat.completions.create(model="tiny", messages=ASK, **extra).choices[0]
        assert (choice.message.content, choice.message.tool_calls, choice.finish_reason) == (CALL, None, "stop")


def test_strict_tool_calls_follow_their_schema_and_loose_ones_are_taken_as_written(say, oa):
    # A strict tool's call is constrained once the model opens it (tests/test_structured.py shows
    # the grammar at work); a call the grammar allows passes through it unchanged.
    strict = [{"type": "function", "function": {"name": "get_weather", "parameters": {**WEATHER, "additionalProperties": False}, "strict": True}}]
    say(CALL)
    choice = oa.chat.completions.create(model="tiny", messages=ASK, tools=strict).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert json.loads(choice.message.tool_calls[0].function.arguments) == {"city": "Paris"}
    say(CALL.replace('"city": "Paris"', '"city": 5'))
    choice = oa.chat.completions.create(model="tiny", messages=ASK, tools=CHAT_TOOLS).choices[0]  # not strict
    assert json.loads(choice.message.tool_calls[0].function.arguments) == {"city": 5}


def test_a_call_the_model_opens_follows_the_strict_schema(say, oa):
    # The script opens the call; from there the random model writes it, held to the schema.
    strict = [{"type": "function", "function": {"name": "get_weather", "strict": True, "parameters": {
        "type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}, "now": {"type": "boolean"}},
        "required": ["unit", "now"], "additionalProperties": False}}}]
    say("Checking.\n<tool_call><<free>>")
    for seed in range(3):
        choice = oa.chat.completions.create(model="tiny", messages=ASK, tools=strict, seed=seed, max_tokens=300).choices[0]
        assert choice.message.tool_calls  # one, or several in a row: each one whole and valid
        for call in choice.message.tool_calls:
            arguments = json.loads(call.function.arguments)
            assert call.function.name == "get_weather" and arguments["unit"] in ("celsius", "fahrenheit")
            assert set(arguments) == {"unit", "now"} and isinstance(arguments["now"], bool)
        assert choice.message.content == "Checking." and choice.finish_reason == "tool_calls"


def test_calls_to_unknown_tools_stay_text(say, oa):
    unknown = CALL.replace("get_weather", "launch_rockets")
    say(unknown)
    choice = oa.chat.completions.create(model="tiny", messages=ASK, tools=CHAT_TOOLS).choices[0]
    assert (choice.message.content, choice.message.tool_calls) == (unknown, None)


def test_strict_tool_with_a_broken_schema_is_400(oa):
    broken = [{"type": "function", "function": {"name": "f", "parameters": {"type": "no-such-type"}, "strict": True}}]
    with pytest.raises(openai.BadRequestError) as caught:
        oa.chat.completions.create(model="tiny", messages=ASK, tools=broken)
    assert caught.value.body["param"] == "tools" and "JSON Schema" in caught.value.body["message"]


def test_anthropic_tool_use(say, an):
    say("Let me check.\n" + CALL)
    message = an.messages.create(model="tiny", max_tokens=128, messages=ASK, tools=ANTHROPIC_TOOLS)
    assert message.stop_reason == "tool_use"
    text, tool = message.content
    assert text.text == "Let me check."
    assert tool.id.startswith("toolu_") and tool.name == "get_weather" and tool.input == {"city": "Paris"}


def test_anthropic_tool_use_streamed(say, an, scripted):
    say("Let me check.\n" + CALL)
    with an.messages.stream(model="tiny", max_tokens=128, messages=ASK, tools=ANTHROPIC_TOOLS) as stream:
        kinds = [(e.type, getattr(getattr(e, "delta", None), "type", None)) for e in stream]
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use" and final.content[1].input == {"city": "Paris"}
    raw = RawStream(scripted.host, scripted.port, "/v1/messages",
                    {"model": "tiny", "max_tokens": 128, "messages": ASK, "tools": ANTHROPIC_TOOLS, "stream": True})
    frames = [f for _, f in raw.frames()]
    raw.close()
    events = [(f.split("\n")[0].removeprefix("event: "), json.loads(f.split("\n")[1].removeprefix("data: "))) for f in frames]
    names = [name for name, _ in events]
    assert all(data["type"] == name for name, data in events)
    tool_at = [i for i, (name, data) in enumerate(events) if data.get("index") == 1][0]
    assert names[:2] == ["message_start", "content_block_start"] and names[tool_at - 1] == "content_block_stop"
    assert set(names[2:tool_at - 1]) == {"content_block_delta"}
    # The call's input follows in pieces as it is written (how many depends on how fast the client reads: pieces
    # written between two reads go as one; tests/test_families.py shows them arriving before the call ends).
    input_deltas = names[tool_at + 1:-3]
    assert input_deltas and set(input_deltas) == {"content_block_delta"}
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    start = events[tool_at][1]
    assert start["content_block"]["type"] == "tool_use" and start["content_block"]["input"] == {}
    partial = [data["delta"] for _, data in events[tool_at + 1:-3]]
    assert {d["type"] for d in partial} == {"input_json_delta"}
    assert json.loads("".join(d["partial_json"] for d in partial)) == {"city": "Paris"}
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"
    assert ("content_block_delta", "input_json_delta") in kinds


def test_responses_function_call(say, oa):
    say("Let me check.\n" + CALL)
    response = oa.responses.create(model="tiny", input="Weather in Paris?", tools=RESPONSES_TOOLS)
    message, call = response.output
    assert response.status == "completed" and response.output_text == "Let me check."
    assert call.type == "function_call" and call.call_id.startswith("call_") and call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Paris"}
    with oa.responses.stream(model="tiny", input="Weather in Paris?", tools=RESPONSES_TOOLS) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    added = len(kinds) - 1 - kinds[::-1].index("response.output_item.added")
    deltas = kinds[added + 1:-3]
    assert deltas and set(deltas) == {"response.function_call_arguments.delta"}  # in pieces, as it is written
    assert kinds[-3:] == ["response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert json.loads(final.output[1].arguments) == {"city": "Paris"}


def test_tool_history_renders_the_same_prompt_in_every_protocol(say, oa, an):
    """One conversation with a past call and its result, told in three protocols, is one prompt."""
    say("It is sunny.")
    chat = oa.chat.completions.create(model="tiny", tools=CHAT_TOOLS, messages=ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny, 21 C"},
    ])
    messages = ASK + [
        {"role": "assistant", "content": [{"type": "tool_use", "id": "c1", "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c1", "content": "sunny, 21 C"}]},
    ]
    message = an.messages.create(model="tiny", max_tokens=64, tools=ANTHROPIC_TOOLS, messages=messages)
    counted = an.messages.count_tokens(model="tiny", tools=ANTHROPIC_TOOLS, messages=messages)
    response = oa.responses.create(model="tiny", tools=RESPONSES_TOOLS, input=ASK + [
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny, 21 C"},
    ])
    assert chat.choices[0].message.content == message.content[0].text == response.output_text == "It is sunny."
    sizes = {chat.usage.prompt_tokens, message.usage.input_tokens + message.usage.cache_read_input_tokens,
             counted.input_tokens, response.usage.input_tokens}
    assert len(sizes) == 1
    plain = oa.chat.completions.create(model="tiny", messages=ASK)
    assert plain.usage.prompt_tokens + 60 < chat.usage.prompt_tokens  # the tools and the history are in the prompt


def test_a_template_that_renders_no_tools_gets_them_as_text_and_its_calls_are_read(say, oa, an):
    """SmolLM2's own template, like many GGUF files', ignores tools: they are written into the messages."""
    without = oa.chat.completions.create(model="plain", messages=ASK)
    say(CALL)
    chat = oa.chat.completions.create(model="plain", messages=ASK, tools=CHAT_TOOLS)
    call = chat.choices[0].message.tool_calls[0]
    assert chat.choices[0].finish_reason == "tool_calls"
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    assert chat.usage.prompt_tokens > without.usage.prompt_tokens + 60  # the definitions are in the prompt
    say(CALL)
    message = an.messages.create(model="plain", max_tokens=200, messages=ASK, tools=ANTHROPIC_TOOLS)
    assert message.stop_reason == "tool_use" and message.content[-1].input == {"city": "Paris"}
    say("It is sunny.")
    answer = oa.chat.completions.create(model="plain", tools=CHAT_TOOLS, messages=ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny, 21 C"},
    ])
    assert answer.choices[0].message.content == "It is sunny."
    assert answer.usage.prompt_tokens > chat.usage.prompt_tokens  # the call and its result are in the prompt


def test_real_engine_takes_tools_and_a_call_cut_off_is_a_partial_call(server):
    """The real tiny model writes gibberish: a forced call cut off by max_tokens is a partial call, as OpenAI
    returns it."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    common = {"model": "tiny", "messages": ASK, "max_tokens": 12, "logit_bias": {"2": -100}}
    without = client.chat.completions.create(**common)
    auto = client.chat.completions.create(**common, tools=CHAT_TOOLS)
    forced = client.chat.completions.create(**common, tools=CHAT_TOOLS, tool_choice="required")
    assert auto.usage.prompt_tokens > without.usage.prompt_tokens + 60
    assert auto.choices[0].finish_reason == "length" and auto.choices[0].message.tool_calls is None
    choice = forced.choices[0]
    assert choice.finish_reason == "length" and not choice.message.content
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.function.arguments.startswith("{")
