"""Each protocol's encoder on its own: the same neutral events in, the protocol's frames out, no server."""

import json

import pytest

from kronk_wsgi.api.anthropic import MessagesEncoder
from kronk_wsgi.api.openai_chat import ChatEncoder
from kronk_wsgi.api.openai_completions import CompletionEncoder
from kronk_wsgi.api.openai_responses import ResponsesEncoder
from kronk_wsgi.serving.events import KEEPALIVE, Failed, Finished, TextDelta, ToolCall, Usage

USAGE = Usage(prompt_tokens=7, completion_tokens=3)
CALL = ToolCall("abc", "get_weather", '{"city": "Paris"}')
SHUTDOWN = Failed("shutdown", "the server is shutting down; the response is incomplete")


def data(frame: str):
    payload = frame.split("data: ", 1)[1].strip()
    return payload if payload == "[DONE]" else json.loads(payload)


def event_names(frames):
    return [frame.split("\n", 1)[0].removeprefix("event: ") for frame in frames]


def encoders():
    return [
        ChatEncoder("m", "chatcmpl-1", 0, include_usage=True),
        MessagesEncoder("msg_1", "m", 7),
        ResponsesEncoder({"id": "resp_1", "object": "response", "status": "in_progress", "output": []}),
    ]


def test_chat_frames():
    frames = list(ChatEncoder("m", "chatcmpl-1", 0, include_usage=True).frames(iter([
        TextDelta("Hel"), TextDelta("lo"), CALL, KEEPALIVE, Finished("tool_calls", USAGE),
    ])))
    assert data(frames[0])["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [data(f)["choices"][0]["delta"]["content"] for f in frames[1:3]] == ["Hel", "lo"]
    head, arguments = (data(f)["choices"][0]["delta"]["tool_calls"][0] for f in frames[3:5])
    assert head["function"] == {"name": "get_weather", "arguments": ""} and head["id"] == "call_abc"
    assert arguments == {"index": 0, "function": {"arguments": '{"city": "Paris"}'}}
    assert frames[5] == ": keep-alive\n\n"
    assert data(frames[6])["choices"][0]["finish_reason"] == "tool_calls"
    assert data(frames[7])["usage"]["total_tokens"] == 10 and data(frames[8]) == "[DONE]"


def test_completion_whole_answer():
    encoder = CompletionEncoder("m", "cmpl-1", include_usage=False)
    answer = encoder.whole([TextDelta("Paris.")], Finished("stop", USAGE))
    assert answer["choices"][0] == {"text": "Paris.", "index": 0, "logprobs": None, "finish_reason": "stop"}
    assert answer["usage"]["prompt_tokens"] == 7


def test_messages_blocks():
    frames = list(MessagesEncoder("msg_1", "m", 7).frames(iter([
        TextDelta("Let me look."), CALL, KEEPALIVE, Finished("tool_calls", USAGE),
    ])))
    assert event_names(frames) == [
        "message_start", "content_block_start", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_stop", "ping", "message_delta", "message_stop",
    ]
    assert data(frames[4])["content_block"]["name"] == "get_weather" and data(frames[4])["index"] == 1
    assert data(frames[8])["delta"]["stop_reason"] == "tool_use"


def test_responses_numbered_events():
    frames = list(ResponsesEncoder({"id": "resp_1", "output": []}).frames(iter([
        TextDelta("Hi"), Finished("length", USAGE),
    ])))
    events = [data(f) for f in frames]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["output"][0]["content"][0]["text"] == "Hi"


@pytest.mark.parametrize("encoder", encoders(), ids=["chat", "messages", "responses"])
def test_shutdown_is_an_in_band_error_and_the_last_frame(encoder):
    frames = list(encoder.frames(iter([TextDelta("partial"), SHUTDOWN])))
    last = data(frames[-1])
    assert "shutting down" in json.dumps(last)
    assert all("[DONE]" not in frame and "message_stop" not in frame for frame in frames)
