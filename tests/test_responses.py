"""OpenAI Responses through real gunicorn + gevent on the tiny real model."""

import openai
import pytest
import requests

from kronk_wsgi.testing.rawhttp import RawStream, data_of

RESPONSES = "/v1/responses"


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def events_of(raw: RawStream) -> list[tuple[str, dict]]:
    out = []
    for _, frame in raw.frames():
        name, data = frame.split("\n")
        assert name.startswith("event: "), frame
        out.append((name.removeprefix("event: "), data_of(data)))
    raw.close()
    return out


def test_create(client):
    response = client.responses.create(model="tiny", input="Hello there", instructions="Be brief.",
                                       max_output_tokens=8, temperature=0)
    assert response.id.startswith("resp_") and response.object == "response" and response.model == "tiny"
    assert response.status in ("completed", "incomplete")
    if response.status == "incomplete":
        assert response.incomplete_details.reason == "max_output_tokens" and response.usage.output_tokens == 8
    [message] = response.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert response.output_text == message.content[0].text
    usage = response.usage
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    chat = client.chat.completions.create(model="tiny", max_tokens=8, temperature=0, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}])
    assert chat.choices[0].message.content == response.output_text  # one prompt, one greedy reply
    assert chat.usage.prompt_tokens == usage.input_tokens


def test_stream_matches_create(client):
    common = {"model": "tiny", "input": [{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]}],
              "max_output_tokens": 10, "temperature": 0}
    whole = client.responses.create(**common)
    events = list(client.responses.create(**common, stream=True))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    final = events[-1].response
    assert events[-1].type == "response." + final.status == "response." + whole.status
    assert "".join(deltas) == final.output_text == whole.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_raw_events_are_numbered_and_ordered(server):
    body = {"model": "tiny", "input": "Hello there", "max_output_tokens": 6, "stream": True}
    raw = RawStream(server.host, server.port, RESPONSES, body)
    assert raw.status == 200
    events = events_of(raw)
    assert all(data["type"] == name for name, data in events)
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    names = [name for name, _ in events]
    assert names[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert set(names[4:-4]) == {"response.output_text.delta"}
    assert names[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    final = events[-1][1]["response"]
    assert names[-1] == "response." + final["status"]
    text = "".join(data["delta"] for name, data in events if name == "response.output_text.delta")
    assert events[-4][1]["text"] == text == final["output"][0]["content"][0]["text"]
    assert events[0][1]["response"]["status"] == "in_progress" and events[0][1]["response"]["id"] == final["id"]


def test_history_items(client):
    response = client.responses.create(model="tiny", max_output_tokens=2, input=[
        {"role": "user", "content": "Hi"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello!", "annotations": []}]},
        {"role": "developer", "content": "Answer shortly."},
        {"role": "user", "content": "How are you?"},
    ])
    assert response.usage.input_tokens > 20


def body(**fields):
    return {"model": "tiny", "input": "hi", **fields}


BAD = [
    ({"model": "tiny"}, 400, "input"),
    (body(input=[]), 400, "input"),
    (body(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]), 400, "input[0].content[0]"),
    (body(input=[{"type": "web_search_call", "id": "ws_1"}]), 400, "input[0]"),
    (body(input=[{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}]), 400, "input[0].arguments"),
    (body(previous_response_id="resp_1"), 404, "previous_response_id"),
    (body(tools=[{"type": "function", "name": "f", "parameters": {"type": 5}}]), 400, "tools"),
    (body(tools=[{"type": "teleport"}]), 400, "tools[0].type"),
    (body(tool_choice="auto"), 400, None),
    (body(max_output_tokens=0), 400, "max_output_tokens"),
    (body(input="word " * 3000), 400, "input"),
    (body(temperature=5), 400, "temperature"),
    (body(text={"format": {"type": "json_schema", "name": "x"}}), 400, "text.format.schema"),
    (body(reasoning={"effort": "enormous"}), 400, "reasoning.effort"),
    (body(background=True, store=False), 400, "background"),
    (body(model="nope"), 404, "model"),
]


@pytest.mark.parametrize("payload,status,param", BAD)
def test_bad_input(server, payload, status, param):
    response = requests.post(server.url + RESPONSES, json=payload, timeout=30)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"]
    assert error["type"] == "invalid_request_error"  # 404s too, as OpenAI's


def test_an_unknown_previous_response_says_so(server):
    error = requests.post(server.url + RESPONSES, json=body(previous_response_id="resp_x"), timeout=30).json()["error"]
    assert error["code"] == "response_not_found" and "resp_x" in error["message"]
