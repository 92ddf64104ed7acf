"""Anthropic Messages through real gunicorn + gevent on the tiny real model."""

import json

import anthropic
import pytest
import requests

from kronk_wsgi.testing import run_server
from kronk_wsgi.testing.rawhttp import RawStream

HELLO = [{"role": "user", "content": "Hello there"}]
MESSAGES = "/v1/messages"


@pytest.fixture
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)


def events_of(raw: RawStream) -> list[tuple[str, dict]]:
    """(event name, data) of each frame; every frame is named."""
    out = []
    for _, frame in raw.frames():
        name, data = frame.split("\n")
        assert name.startswith("event: ") and data.startswith("data: "), frame
        out.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    raw.close()
    return out


def test_create(client):
    message = client.messages.create(model="tiny", max_tokens=9, messages=HELLO, system="Be brief.")
    assert message.id.startswith("msg_") and message.type == "message" and message.role == "assistant"
    assert message.model == "tiny"
    assert message._request_id == message.id  # the request-id header carries the message id
    assert message.stop_reason in ("end_turn", "max_tokens") and message.stop_sequence is None
    assert 1 <= message.usage.output_tokens <= 9
    if message.stop_reason == "max_tokens":
        assert message.usage.output_tokens == 9
    assert [b.type for b in message.content] in ([], ["text"])
    counted = client.messages.count_tokens(model="tiny", messages=HELLO, system="Be brief.")
    assert counted.input_tokens == message.usage.input_tokens + message.usage.cache_read_input_tokens
    again = client.messages.create(model="tiny", max_tokens=9, messages=HELLO, system="Be brief.")
    assert again.usage.cache_read_input_tokens > 0  # the slot still holds this prompt's prefix
    assert again.usage.input_tokens + again.usage.cache_read_input_tokens == counted.input_tokens
    assert again.usage.cache_creation_input_tokens == 0


def test_a_model_is_described_as_anthropics_models_api_describes_one(client):
    info = client.models.retrieve("tiny")
    assert (info.type, info.id, info.lifecycle) == ("model", "tiny", "active")
    assert (info.max_input_tokens, info.max_tokens) == (2047, 2047)  # a 2,048-token context, a token for the reply
    capabilities = info.capabilities
    assert capabilities.structured_outputs.supported and capabilities.effort.supported
    assert capabilities.context_management.clear_tool_uses_20250919.supported
    assert not (capabilities.image_input.supported or capabilities.pdf_input.supported or capabilities.batch.supported)
    assert not capabilities.thinking.supported  # the tiny model's template has no thinking
    assert [model.id for model in client.models.list().data] == ["tiny"]


def test_anthropics_model_listing_pages(tiny_model, tmp_path):
    env = {"KRONK_MODELS": f"a={tiny_model},b={tiny_model},c={tiny_model}", "KRONK_DEFAULT_MODEL": "a"}
    with run_server(tmp_path, env) as server:
        client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
        first = client.models.list(limit=2)
        assert [m.id for m in first.data] == ["a", "b"] and first.has_more and first.last_id == "b"
        assert [m.id for m in client.models.list(limit=2, after_id="b").data] == ["c"]
        before = client.models.list(limit=1, before_id="c")
        assert [m.id for m in before.data] == ["b"] and before.has_more
        assert [m.id for m in client.models.list(limit=1)] == ["a", "b", "c"]  # the SDK follows the pages
        assert client.models.retrieve("b").max_input_tokens == 2047  # known from its file before it loads
        for query in ("limit=0", "limit=1001", "limit=x", "after_id=nope", "after_id=a&before_id=c"):
            reply = requests.get(f"{server.url}/v1/models?{query}", headers={"anthropic-version": "2023-06-01"},
                                 timeout=10)
            assert reply.status_code == 400, (query, reply.text)
        assert "object" in requests.get(server.url + "/v1/models", timeout=10).json()  # OpenAI's list without it


def test_stream_matches_create(client):
    # This anthropic package has no sampling arguments any more; the API still takes them.
    common = {"model": "tiny", "max_tokens": 12, "messages": HELLO, "extra_body": {"temperature": 0}}
    whole = client.messages.create(**common)
    with client.messages.stream(**common) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == final.content[0].text == whole.content[0].text
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert final.stop_reason == whole.stop_reason


def test_raw_event_order_and_headers(server):
    body = {"model": "tiny", "max_tokens": 6, "messages": HELLO, "stream": True}
    raw = RawStream(server.host, server.port, MESSAGES, body, headers={"anthropic-version": "2023-06-01"})
    assert raw.status == 200 and raw.headers["content-type"].startswith("text/event-stream")
    events = events_of(raw)
    names = [name for name, _ in events]
    assert all(data["type"] == name for name, data in events)
    start = events[0][1]["message"]
    assert raw.headers["request-id"] == raw.headers["anthropic-request-id"] == start["id"]
    assert start["content"] == [] and start["stop_reason"] is None
    counted = requests.post(server.url + MESSAGES + "/count_tokens",
                            json={"model": "tiny", "messages": HELLO}, timeout=30).json()
    usage = start["usage"]  # the prompt's split as the final usage has it (its prefix may be in the slot's cache)
    assert usage["output_tokens"] == 0
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] + usage["cache_creation_input_tokens"] == \
        counted["input_tokens"]
    final = events[-2][1]["usage"]
    assert {key: final[key] for key in usage if key != "output_tokens"} == {
        key: value for key, value in usage.items() if key != "output_tokens"}
    middle = names[2:-3]
    assert names[:2] == ["message_start", "content_block_start"] and set(middle) == {"content_block_delta"}
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert events[1][1]["content_block"] == {"type": "text", "text": ""}
    assert all(data["delta"]["type"] == "text_delta" and data["index"] == 0 for _, data in events[2:-3])
    delta = events[-2][1]
    assert delta["delta"]["stop_reason"] in ("end_turn", "max_tokens")
    assert delta["usage"]["output_tokens"] <= 6


def test_stop_sequences(client):
    common = {"model": "tiny", "max_tokens": 30, "messages": HELLO, "extra_body": {"temperature": 0}}
    full = client.messages.create(**common).content[0].text
    stop = full[8:11]
    stopped = client.messages.create(**common, stop_sequences=["never-seen", stop])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == stop
    assert stopped.content[0].text == full[: full.index(stop)]


def test_content_blocks_and_cache_control_are_taken(client):
    message = client.messages.create(
        model="tiny", max_tokens=3, cache_control={"type": "ephemeral"}, service_tier="auto",
        system=[{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
        messages=[{"role": "user", "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]}],
        metadata={"user_id": "u-1"}, extra_body={"top_k": 5, "top_p": 0.9, "temperature": 0.5},
    )
    same = client.messages.create(model="tiny", max_tokens=3, system="Be brief.",
                                  messages=[{"role": "user", "content": "Hello there"}])
    def whole(usage):
        return usage.input_tokens + usage.cache_read_input_tokens

    assert whole(message.usage) == whole(same.usage)


def test_client_errors(client):
    with pytest.raises(anthropic.NotFoundError) as caught:
        client.messages.create(model="nope", max_tokens=5, messages=HELLO)
    assert caught.value.body == {"type": "error", "error": {"type": "not_found_error", "message": "the model 'nope' does not exist"}}
    assert caught.value.response.headers["request-id"]
    with pytest.raises(anthropic.BadRequestError):  # a prompt that cannot fit (a max_tokens that cannot is clamped)
        client.messages.create(model="tiny", max_tokens=5, messages=[{"role": "user", "content": "word " * 3000}])


def body(**fields):
    return {"model": "tiny", "max_tokens": 5, "messages": HELLO, **fields}


BAD = [
    # (path, body, status, error type, words in the message)
    (MESSAGES, {"model": "tiny", "messages": HELLO}, 400, "invalid_request_error", "max_tokens"),
    (MESSAGES, body(max_tokens=0), 400, "invalid_request_error", "max_tokens"),
    (MESSAGES, body(messages=[]), 400, "invalid_request_error", "messages"),
    (MESSAGES, body(messages=[{"role": "tool", "content": "x"}]), 400, "invalid_request_error", "messages[0].role"),
    (MESSAGES, body(messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}]), 400, "invalid_request_error", "messages[0].content"),
    (MESSAGES, body(messages=[{"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "f", "input": {}}]}]), 400, "invalid_request_error", "assistant"),
    (MESSAGES, body(messages=[{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "a"}]}]), 400, "invalid_request_error", "user messages"),
    (MESSAGES, body(temperature=1.5), 400, "invalid_request_error", "temperature"),
    (MESSAGES, body(top_k=-1), 400, "invalid_request_error", "top_k"),
    (MESSAGES, body(stop_sequences="x"), 400, "invalid_request_error", "stop_sequences"),
    (MESSAGES, body(tool_choice={"type": "auto"}), 400, "invalid_request_error", "tool_choice needs tools"),
    (MESSAGES, body(tools=[{"name": "f", "input_schema": {}}], tool_choice={"type": "tool", "name": "g"}), 400, "invalid_request_error", "'g'"),
    (MESSAGES, body(tools=[{"type": "teleport", "name": "t"}]), 400, "invalid_request_error", "tools[0]"),
    (MESSAGES, body(tools=[{"name": "bad name!", "input_schema": {}}]), 400, "invalid_request_error", "tools[0].name"),
    (MESSAGES, body(thinking={"type": "enabled", "budget_tokens": 1024}), 400, "invalid_request_error", "thinking"),
    (MESSAGES, body(model="nope"), 404, "not_found_error", "nope"),
    (MESSAGES, body(messages=[{"role": "user", "content": "word " * 3000}]), 400, "invalid_request_error",
     "prompt is too long"),
    (MESSAGES + "/count_tokens", {"model": "tiny"}, 400, "invalid_request_error", "messages"),
    (MESSAGES + "/count_tokens", body(), 400, "invalid_request_error", "max_tokens"),
    (MESSAGES + "/count_tokens", {"model": "nope", "messages": HELLO}, 404, "not_found_error", "nope"),
    (MESSAGES, [1], 400, "invalid_request_error", "JSON object"),
]


@pytest.mark.parametrize("path,payload,status,kind,words", BAD)
def test_bad_input_in_anthropic_shape(server, path, payload, status, kind, words):
    response = requests.post(server.url + path, json=payload, timeout=30)
    assert response.status_code == status, response.text
    error = response.json()
    assert set(error) == {"type", "error"} and error["type"] == "error"
    assert error["error"]["type"] == kind and words in error["error"]["message"]
    assert response.headers["request-id"] == response.headers["anthropic-request-id"]


def test_routing_errors_in_anthropic_shape(server):
    response = requests.get(server.url + MESSAGES, timeout=10)
    assert response.status_code == 405 and response.json()["error"]["type"] == "invalid_request_error"
    response = requests.post(server.url + MESSAGES, data=b"{oops", headers={"Content-Type": "application/json"}, timeout=10)
    assert response.status_code == 400 and response.json()["type"] == "error"


def test_claude_codes_billing_header_is_left_out_of_the_prompt(client):
    def counted(system) -> int:
        return client.messages.count_tokens(model="tiny", system=system, messages=HELLO).input_tokens

    header = "x-anthropic-billing-header: cc_version=2.1.197.%s; cc_entrypoint=sdk-cli; cch=%s;"
    plain = counted([{"type": "text", "text": "You are Claude Code."}])
    for suffix in (("123", "fa690"), ("6e2", "0aaa9")):  # it changes with every request: never rendered
        assert counted([{"type": "text", "text": header % suffix}, {"type": "text", "text": "You are Claude Code."}]) \
            == plain
    assert counted([{"type": "text", "text": header % ("1", "2")}]) == counted(None)
