"""Compaction through the OpenAI SDK on real gunicorn: POST /v1/responses/compact, and a response that compacts
its own conversation past its threshold (context_management), the summary written by the model (scripted here,
to know its text) and sealed."""

import openai
import pytest

from kronk_wsgi.api.compaction import SUMMARY_HEADING

from .support.scripted import run_scripted

CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me look."}]},
    {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
    {"type": "function_call_output", "call_id": "call_1", "output": "sunny, 22 C, and a long report " * 20},
    {"role": "user", "content": "And tomorrow?"},
]
SUMMARY = "Paris is sunny at 22 C; the user asked about tomorrow."


@pytest.fixture(scope="module")
def scripted(tiny_model, tmp_path_factory):
    models = {"tiny": {"path": str(tiny_model), "engine": "tests.support.scripted:KIND"}, "real": {"path": str(tiny_model)}}
    with run_scripted(tmp_path_factory.mktemp("compaction"), models, "tiny") as server:
        yield server


def _count(server, input_items, **fields) -> int:
    counted = server.post("/v1/responses/input_tokens", {"model": "tiny", "input": input_items, **fields})
    assert counted.status_code == 200, counted.text
    return counted.json()["input_tokens"]


def _summarized(*later) -> list[dict]:
    """The conversation as a compaction leaves it, written out: the user's messages, then the summary."""
    return [{"role": "user", "content": "Weather in Paris?"}, {"role": "user", "content": "And tomorrow?"},
            {"role": "user", "content": SUMMARY_HEADING + SUMMARY}, *later]


def test_compact_gives_the_users_messages_and_the_models_summary_sealed(scripted):
    client = openai.OpenAI(base_url=scripted.url + "/v1", api_key="unused", max_retries=0)
    scripted.say(SUMMARY)
    result = client.responses.compact(model="tiny", input=CONVERSATION, instructions="Be brief.")
    assert result.object == "response.compaction"
    kinds = [(item.type, getattr(item, "role", None)) for item in result.output]
    assert kinds == [("message", "user"), ("message", "user"), ("compaction", None)]
    sealed = result.output[-1].encrypted_content
    assert "Paris" not in sealed and result.usage.output_tokens > 0
    # The compacted input is the kept messages and the summary, as the model wrote it.
    compacted = [item.model_dump(exclude_none=True, warnings=False) for item in result.output]
    follow = {"role": "user", "content": "Thanks"}
    assert _count(scripted, compacted + [follow]) == _count(scripted, _summarized(follow))
    # Items before a compaction item other than messages kept are the summary's to carry: left out of the prompt.
    assert _count(scripted, CONVERSATION + compacted[-1:] + [follow]) == _count(scripted, _summarized(follow))
    scripted.say("Tomorrow too.")
    reply = client.responses.create(model="tiny", input=compacted + [follow])
    assert reply.output_text == "Tomorrow too."
    changed = dict(compacted[-1], encrypted_content=sealed[:-4] + "AAAA")
    refused = scripted.post("/v1/responses", {"model": "tiny", "input": [changed, follow]})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "input[0].encrypted_content"


def test_a_response_past_its_threshold_compacts_first_and_continues_compacted(scripted):
    client = openai.OpenAI(base_url=scripted.url + "/v1", api_key="unused", max_retries=0)
    manage = [{"type": "compaction", "compact_threshold": 50}]
    scripted.say(SUMMARY)
    events = list(client.responses.create(model="tiny", input=CONVERSATION, context_management=manage, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:5] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.compaction.compacting", "response.output_item.done"], kinds
    final = events[-1].response
    assert kinds[-1] == "response.completed" and [i.type for i in final.output] == ["compaction", "message"]
    assert events[4].item.encrypted_content == final.output[0].encrypted_content != ""
    # Stored compacted: the next turn continues the compacted conversation, not the whole one.
    follow = {"role": "user", "content": "Thanks"}
    reply = {"role": "assistant", "content": SUMMARY}  # the scripted model says the same again
    assert _count(scripted, [follow], previous_response_id=final.id) == _count(scripted, _summarized(reply, follow))
    scripted.say(SUMMARY)
    whole = client.responses.create(model="tiny", input=CONVERSATION, context_management=manage)
    assert [i.type for i in whole.output] == ["compaction", "message"] and whole.output_text == SUMMARY
    scripted.say("Sunny.")
    below = client.responses.create(model="tiny", input=CONVERSATION, context_management=[{"type": "compaction"}])
    assert [i.type for i in below.output] == ["message"]  # 80% of the context is far off: nothing to compact


def test_the_summary_reads_the_conversation_from_the_prompt_cache(scripted):
    client = openai.OpenAI(base_url=scripted.url + "/v1", api_key="unused", max_retries=0)
    first = client.responses.create(model="real", input=CONVERSATION, max_output_tokens=4)
    compacted = client.responses.compact(model="real", input=CONVERSATION)
    # All but the first reply's prompt's end (its turn's opening, where the summary's prompt asks for a summary)
    assert compacted.usage.input_tokens_details.cached_tokens > 0.95 * first.usage.input_tokens


@pytest.mark.parametrize("path, body, param", [
    ("/v1/responses", {"input": "hi", "background": True, "context_management": [{"type": "compaction"}]},
     "context_management"),
    ("/v1/responses", {"input": "hi", "context_management": [{"type": "other"}]}, "context_management[0].type"),
    ("/v1/responses", {"input": "hi", "context_management": [{"type": "compaction", "compact_threshold": 0}]},
     "context_management[0].compact_threshold"),
    ("/v1/responses/compact", {}, None),
    ("/v1/responses/compact", {"input": [{"type": "compaction", "encrypted_content": "nope"}]},
     "input[0].encrypted_content"),
])
def test_compaction_refuses_what_it_cannot_do_by_name(scripted, path, body, param):
    answer = scripted.post(path, {"model": "tiny", **body})
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == param, answer.text


def test_anthropics_compact_edit_writes_the_summary_first_and_replies_after_it(scripted):
    import anthropic

    client = anthropic.Anthropic(base_url=scripted.url, api_key="unused", max_retries=0)
    long = [{"role": "user", "content": "Weather in Paris? " + "Tell me all of it. " * 30}]
    edits = {"edits": [{"type": "compact_20260112", "trigger": {"type": "input_tokens", "value": 50}}]}
    scripted.say(SUMMARY, "Sunny.")
    message = client.beta.messages.create(model="tiny", max_tokens=100, messages=long, context_management=edits,
                                          betas=["compact-2026-01-12"])
    assert [b.type for b in message.content] == ["compaction", "text"]
    assert message.content[0].content == SUMMARY and message.content[1].text == "Sunny."
    scripted.say(SUMMARY, "Sunny.")
    with client.beta.messages.stream(model="tiny", max_tokens=100, messages=long, context_management=edits,
                                     betas=["compact-2026-01-12"]) as stream:
        streamed = stream.get_final_message()
    assert [b.type for b in streamed.content] == ["compaction", "text"] and streamed.content[0].content == SUMMARY
    scripted.say(SUMMARY)
    paused = client.beta.messages.create(model="tiny", max_tokens=100, messages=long, betas=["compact-2026-01-12"],
                                         context_management={"edits": [{**edits["edits"][0],
                                                                        "pause_after_compaction": True}]})
    assert [b.type for b in paused.content] == ["compaction"] and paused.stop_reason == "compaction"
    # Handed back, the summary stands for all before it.
    handed_back = long + [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in message.content]},
                          {"role": "user", "content": "Thanks"}]
    counted = client.beta.messages.count_tokens(model="tiny", messages=handed_back)
    written_out = [{"role": "user", "content": SUMMARY_HEADING + SUMMARY}, {"role": "assistant", "content": "Sunny."},
                   {"role": "user", "content": "Thanks"}]
    assert counted.input_tokens == client.messages.count_tokens(model="tiny", messages=written_out).input_tokens
    below = client.beta.messages.create(model="tiny", max_tokens=20, messages=long, betas=["compact-2026-01-12"],
                                        context_management={"edits": [{"type": "compact_20260112"}]})
    assert [b.type for b in below.content] == ["text"]  # 150,000 tokens by default
