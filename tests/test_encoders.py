"""Each protocol's encoder on its own: the same neutral events in, the protocol's frames out, no server."""

import json
import time

import pytest

from kronk_wsgi.api.protocols.anthropic.encoder import MessagesEncoder
from kronk_wsgi.api.protocols.ollama.encoder import OllamaEncoder
from kronk_wsgi.api.protocols.ollama.protocol import KEEPALIVE as OLLAMA_KEEPALIVE
from kronk_wsgi.api.protocols.openai_chat import ChatEncoder
from kronk_wsgi.api.protocols.openai_completions import CompletionEncoder
from kronk_wsgi.api.protocols.openai_responses.encoder import ResponsesEncoder
from kronk_wsgi.api.sse import compact_json, compact_json_pieces
from kronk_wsgi.serving.session import GenerationStats
from kronk_wsgi.serving.events import (
    KEEPALIVE, ArgumentsDelta, ChoiceEnd, Failed, Finished, Logprobs, PromptCached, ReasoningDelta, TextDelta,
    TokenLogprob, ToolCall, ToolCallStart, Usage, coalesce,
)

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
        TextDelta("Hel"), TextDelta("lo"), CALL, KEEPALIVE, ChoiceEnd("tool_calls"), Finished(USAGE),
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
    answer = encoder.whole([TextDelta("Paris."), ChoiceEnd("stop")], Finished(USAGE))
    assert answer["choices"][0] == {"text": "Paris.", "index": 0, "logprobs": None, "finish_reason": "stop"}
    assert answer["usage"]["prompt_tokens"] == 7


def test_messages_blocks():
    frames = list(MessagesEncoder("msg_1", "m", 7).frames(iter([
        TextDelta("Let me look."), CALL, KEEPALIVE, ChoiceEnd("tool_calls"), Finished(USAGE),
    ])))
    assert event_names(frames) == [
        "message_start", "content_block_start", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_stop", "ping", "message_delta", "message_stop",
    ]
    assert data(frames[4])["content_block"]["name"] == "get_weather" and data(frames[4])["index"] == 1
    assert data(frames[8])["delta"]["stop_reason"] == "tool_use"


def test_responses_numbered_events():
    frames = list(ResponsesEncoder({"id": "resp_1", "output": []}).frames(iter([
        TextDelta("Hi"), ChoiceEnd("length"), Finished(USAGE),
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


PARIS = TokenLogprob(b" Paris", -0.25, ((b" Paris", -0.25), (b" Lyon", -2.5)))
CUT = TokenLogprob(b"\xe2\x80", -1.0, ())  # half a character


def test_coalesce_merges_each_choices_text_and_keeps_its_logprobs_before_it():
    merged = coalesce([
        Logprobs((PARIS,)), TextDelta(" Paris"), Logprobs((CUT,)), TextDelta("!"),
        TextDelta("a", 1), ChoiceEnd("stop"), TextDelta("b", 1),
    ])
    assert merged == [
        Logprobs((PARIS, CUT)), TextDelta(" Paris!"), TextDelta("a", 1), ChoiceEnd("stop"), TextDelta("b", 1),
    ]


def test_chat_two_choices_with_logprobs_streamed():
    frames = list(ChatEncoder("m", "c", 0, include_usage=False, choices=2, logprobs=True).frames(iter([
        Logprobs((PARIS,)), TextDelta(" Paris"), ChoiceEnd("stop"),
        Logprobs((CUT,), 1), ChoiceEnd("length", index=1), Finished(USAGE),
    ])))
    chunks = [data(f) for f in frames[:-1]]
    assert [c["choices"][0]["index"] for c in chunks] == [0, 1, 0, 0, 1, 1]
    first = chunks[2]["choices"][0]
    assert first["delta"] == {"content": " Paris"}
    assert first["logprobs"]["content"] == [{
        "token": " Paris", "logprob": -0.25, "bytes": list(b" Paris"),
        "top_logprobs": [{"token": " Paris", "logprob": -0.25, "bytes": list(b" Paris")},
                         {"token": " Lyon", "logprob": -2.5, "bytes": list(b" Lyon")}],
    }]
    # tokens whose text never came out go in a chunk of their own before the finish
    held = chunks[4]["choices"][0]
    assert held["delta"] == {} and held["logprobs"]["content"][0]["token"] == "\\xe2\\x80"
    assert held["logprobs"]["content"][0]["bytes"] == [0xE2, 0x80]
    assert chunks[5]["choices"][0]["finish_reason"] == "length" and frames[-1] == "data: [DONE]\n\n"


def test_completion_choices_whole_with_legacy_logprobs():
    encoder = CompletionEncoder("m", "cmpl-1", include_usage=False, choices=2, logprobs=True)
    answer = encoder.whole([
        Logprobs((PARIS, PARIS)), TextDelta(" Paris Paris"), ChoiceEnd("stop"),
        TextDelta("x", 1), ChoiceEnd("length", index=1),
    ], Finished(USAGE))
    first, second = answer["choices"]
    assert first["logprobs"] == {
        "tokens": [" Paris", " Paris"], "token_logprobs": [-0.25, -0.25],
        "top_logprobs": [{" Paris": -0.25, " Lyon": -2.5}] * 2, "text_offset": [0, 6],
    }
    assert (second["index"], second["text"], second["finish_reason"]) == (1, "x", "length")


def test_reasoning_in_each_protocol():
    events = [ReasoningDelta("Hmm, "), ReasoningDelta("France."), TextDelta("Paris."), ChoiceEnd("stop"), Finished(USAGE)]
    chat = [data(f) for f in ChatEncoder("m", "c", 0, include_usage=False).frames(iter(events))][:-1]
    assert [c["choices"][0]["delta"].get("reasoning_content") for c in chat[1:3]] == ["Hmm, ", "France."]
    whole = ChatEncoder("m", "c", 0, include_usage=False).whole(coalesce(events[:-1]), events[-1])
    assert whole["choices"][0]["message"]["reasoning_content"] == "Hmm, France."
    assert whole["choices"][0]["message"]["content"] == "Paris."

    frames = list(MessagesEncoder("msg_1", "m", 7).frames(iter(events)))
    blocks = [data(f) for f in frames if "content_block" in f]
    assert blocks[0]["content_block"]["type"] == "thinking"
    assert [b["delta"]["type"] for b in blocks if b["type"] == "content_block_delta"] == [
        "thinking_delta", "thinking_delta", "signature_delta", "text_delta"]
    message = MessagesEncoder("msg_1", "m", 7).whole(coalesce(events[:-1]), events[-1])
    assert [b["type"] for b in message["content"]] == ["thinking", "text"]
    assert message["content"][0]["thinking"] == "Hmm, France." and message["content"][0]["signature"]

    frames = [data(f) for f in ResponsesEncoder({"id": "resp_1", "output": []}).frames(iter(events))]
    assert "response.reasoning_text.delta" in [f["type"] for f in frames]
    output = frames[-1]["response"]["output"]
    assert [item["type"] for item in output] == ["reasoning", "message"]
    assert output[0]["content"] == [{"type": "reasoning_text", "text": "Hmm, France."}]


def test_the_end_of_the_context_window_is_anthropics_own_stop_reason():
    encoder = MessagesEncoder("msg_1", "m", 7)
    window = encoder.whole([TextDelta("a"), ChoiceEnd("length", window_full=True)], Finished(USAGE))
    limit = encoder.whole([TextDelta("a"), ChoiceEnd("length")], Finished(USAGE))
    assert window["stop_reason"] == "model_context_window_exceeded" and limit["stop_reason"] == "max_tokens"


def test_a_call_cut_off_by_the_limit_is_a_partial_call_in_each_protocol():
    cut = ToolCall("abc", "get_weather", '{"city": "Par', complete=False)
    chat = ChatEncoder("m", "c", 0, include_usage=False).whole([cut, ChoiceEnd("length")], Finished(USAGE))
    call = chat["choices"][0]["message"]["tool_calls"][0]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Par'}
    assert chat["choices"][0]["finish_reason"] == "length"
    message = MessagesEncoder("msg_1", "m", 7).whole([cut, ChoiceEnd("length")], Finished(USAGE))
    assert message["content"][0]["input"] == {} and message["stop_reason"] == "max_tokens"
    response = ResponsesEncoder({"id": "resp_1", "output": []}).whole([cut, ChoiceEnd("length")], Finished(USAGE))
    assert response["output"][0]["status"] == "incomplete" and response["status"] == "incomplete"


# A call as it is written: its start, its arguments in pieces, and its end (the last "}" only in its arguments).
STREAMED = [ToolCallStart("abc", "get_weather"), ArgumentsDelta("abc", '{"city": '), ArgumentsDelta("abc", '"Paris"'),
            ToolCall("abc", "get_weather", '{"city": "Paris"}')]


def test_a_call_streams_its_arguments_in_each_protocol():
    events = [TextDelta("Let me see."), *STREAMED, ChoiceEnd("tool_calls"), Finished(USAGE)]
    chat = [data(f) for f in ChatEncoder("m", "c", 0, include_usage=False).frames(iter(events))]
    calls = [c["choices"][0]["delta"]["tool_calls"][0] for c in chat[:-1] if "tool_calls" in c["choices"][0]["delta"]]
    assert calls[0] == {"index": 0, "id": "call_abc", "type": "function",
                        "function": {"name": "get_weather", "arguments": ""}}
    assert [c["function"]["arguments"] for c in calls[1:]] == ['{"city": ', '"Paris"', "}"]

    frames = list(MessagesEncoder("msg_1", "m", 7).frames(iter([PromptCached(USAGE)] + events)))
    blocks = [data(f) for f in frames if "content_block" in f]
    tool = [b for b in blocks if b["index"] == 1]
    assert tool[0]["content_block"] == {"type": "tool_use", "id": "toolu_abc", "name": "get_weather", "input": {}}
    assert "".join(b["delta"]["partial_json"] for b in tool[1:-1]) == '{"city": "Paris"}' and len(tool) == 5
    assert tool[-1]["type"] == "content_block_stop"

    response = [data(f) for f in ResponsesEncoder({"id": "resp_1", "output": []}).frames(iter(events))]
    kinds = [f["type"] for f in response]
    at = kinds.index("response.function_call_arguments.delta")
    assert kinds[at - 1] == "response.output_item.added" and response[at - 1]["item"]["arguments"] == ""
    assert [f["delta"] for f in response if f["type"].endswith("arguments.delta")] == ['{"city": ', '"Paris"', "}"]
    assert response[-1]["response"]["output"][1]["arguments"] == '{"city": "Paris"}'
    assert len({f["output_index"] for f in response if "arguments" in f["type"]}) == 1

    lines = [json.loads(line) for line in ollama_encoder().frames(iter(events))]
    assert [line["message"].get("tool_calls") for line in lines if line["message"].get("tool_calls")] == \
        [[{"id": "call_abc", "function": {"index": 0, "name": "get_weather", "arguments": {"city": "Paris"}}}]]


def test_a_custom_tools_input_comes_whole_where_its_call_streams():
    encoder = ChatEncoder("m", "c", 0, include_usage=False, custom_tools=frozenset({"get_weather"}))
    chunks = [data(f) for f in encoder.frames(iter([*STREAMED[:3], ToolCall("abc", "get_weather", '{"input": "x"}'),
                                                     ChoiceEnd("tool_calls"), Finished(USAGE)]))]
    calls = [c["choices"][0]["delta"]["tool_calls"][0] for c in chunks[:-1] if "tool_calls" in c["choices"][0]["delta"]]
    assert calls[0]["custom"] == {"name": "get_weather", "input": ""} and calls[1]["custom"] == {"input": "x"}


def ollama_encoder(chat: bool = True, logprobs: bool = False) -> OllamaEncoder:
    stats = GenerationStats(prompt_tokens=7, queue_wait=0.5, time_to_first_token=1.5)
    return OllamaEncoder("m:latest", chat, logprobs, stats, started=time.monotonic() - 3.0, load_seconds=0.25)


def test_ollama_chat_lines():
    lines = [json.loads(line) for line in ollama_encoder().frames(iter([
        TextDelta("Hel"), ReasoningDelta("hmm"), KEEPALIVE, CALL, ChoiceEnd("tool_calls"), Finished(USAGE),
    ]))]
    assert [line["done"] for line in lines] == [False] * 5 + [True]
    assert lines[1]["message"] == {"role": "assistant", "content": "Hel"}
    assert lines[2]["message"] == {"role": "assistant", "content": "", "thinking": "hmm"}
    assert lines[3] == json.loads(OLLAMA_KEEPALIVE)
    assert lines[4]["message"]["tool_calls"] == [
        {"id": "call_abc", "function": {"index": 0, "name": "get_weather", "arguments": {"city": "Paris"}}}]
    last = lines[-1]
    assert last["done_reason"] == "stop" and last["prompt_eval_count"] == 7 and last["eval_count"] == 3
    assert last["load_duration"] == 250_000_000
    assert abs(last["prompt_eval_duration"] - 1.0e9) < 1e6  # from the slot to the first token
    assert last["total_duration"] >= 3.0e9 and last["eval_duration"] >= 1.5e9


def test_ollama_generate_whole_with_logprobs_and_a_failure_line():
    token = TokenLogprob(b"Hi", -0.5, ((b"Hi", -0.5), (b"Yo", -1.5)))
    whole = ollama_encoder(chat=False, logprobs=True).whole(
        [TextDelta("Hi"), Logprobs((token,)), ChoiceEnd("length")], Finished(USAGE))
    assert whole["response"] == "Hi" and whole["done"] and whole["done_reason"] == "length"
    assert whole["logprobs"] == [{"token": "Hi", "logprob": -0.5, "bytes": [72, 105], "top_logprobs": [
        {"token": "Hi", "logprob": -0.5, "bytes": [72, 105]}, {"token": "Yo", "logprob": -1.5, "bytes": [89, 111]}]}]
    last = json.loads(list(ollama_encoder().frames(iter([TextDelta("a"), SHUTDOWN])))[-1])
    assert last["done"] is True and last["error"].startswith("the server is shutting down")


@pytest.mark.parametrize("value", [
    {}, [], "text", 3, None, {"a": [1, {"b": []}, "x"], "c": {"d": None, "é": True, "n": -2.5}},
    [[[[[[[1, "deep"]]]]]]], {"choices": [{"logprobs": {"content": [{"token": "hi", "bytes": [104, 105],
                                                                  "top_logprobs": []}]}}]},
])
def test_json_in_pieces_is_the_same_json(value):
    assert "".join(compact_json_pieces(value)) == compact_json(value)
