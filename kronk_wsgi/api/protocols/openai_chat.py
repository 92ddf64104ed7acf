"""POST /v1/chat/completions: OpenAI chat completions, streamed or whole."""

import time
import uuid
from typing import Iterable, Iterator, Optional

from flask import Blueprint, jsonify

from ...serving.events import (
    ArgumentsDelta, ChoiceEnd, Event, Failed, Finished, Logprobs, ReasoningDelta, TextDelta, TokenLogprob, ToolCall,
    ToolCallStart, Usage,
)
from ...serving.formats import custom_input
from ..body import parse_body
from ..protocol import Protocol
from ..response import Encoder, respond
from ..schemas import ChatCompletionRequest
from ..sessions import count_prompt_tokens, start_generation
from ..sse import DONE, sse
from ..state import record

bp = Blueprint("openai_chat", __name__)
PROTOCOL = Protocol("openai_chat", bp, prefixes=("/v1/chat/", "/chat/"))

FINGERPRINT = "kronk-wsgi"


def usage_body(usage: Usage) -> dict:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


def failure_body(event: Failed) -> dict:
    kind = "timeout" if event.code == "timeout" else "server_error"
    return {"error": {"message": event.message, "type": kind, "code": event.code, "param": None}}


@bp.post("/v1/chat/completions")
@bp.post("/chat/completions")  # llama-server serves it without /v1 too
def chat_completions():
    """Generate a chat reply."""
    body = parse_body(ChatCompletionRequest)
    session = start_generation(body.generation_request())
    completion_id = record().response_id = "chatcmpl-" + uuid.uuid4().hex
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    encoder = ChatEncoder(body.model, completion_id, int(time.time()), include_usage, body.n, body.logprobs,
                          frozenset(tool.name for tool in body.custom_tools()), legacy_functions=bool(body.functions))
    return respond(session, encoder, body.stream)


@bp.post("/v1/chat/completions/input_tokens")
def chat_input_tokens():
    """The prompt tokens the same chat completion request would take (llama-server's count, in the shape of
    OpenAI's Responses count)."""
    body = parse_body(ChatCompletionRequest)
    return jsonify({"object": "response.input_tokens", "input_tokens": count_prompt_tokens(body.generation_request())})


def _tool_call(call: ToolCall, index: int, custom: bool = False) -> dict:
    """A tool call as chat completions write it: a function's, or a custom tool's (its input as text)."""
    if custom:
        return {"index": index, "id": "call_" + call.id, "type": "custom",
                "custom": {"name": call.name, "input": custom_input(call.arguments, call.complete)}}
    return {"index": index, "id": "call_" + call.id, "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}


def token_text(piece: bytes) -> str:
    """A token's bytes as text; bytes that are not whole UTF-8 characters are written as \\xNN."""
    return piece.decode("utf-8", "backslashreplace")


def logprob_content(tokens: Iterable[TokenLogprob]) -> list[dict]:
    """Chat's logprobs.content entries."""

    def entry(piece: bytes, logprob: float) -> dict:
        return {"token": token_text(piece), "logprob": logprob, "bytes": list(piece)}

    return [{**entry(t.piece, t.logprob), "top_logprobs": [entry(p, lp) for p, lp in t.top]} for t in tokens]


class OpenAIEncoder(Encoder):
    """What OpenAI's chunk protocols share: a finish chunk per choice, usage if asked for, [DONE]; a failure as data.

    ``choices`` is how many choices the answer has; log probabilities are
    kept per choice until the chunk that carries their text.
    """

    def __init__(self, head: dict, include_usage: bool, choices: int) -> None:
        super().__init__()
        self.head = head
        self.include_usage = include_usage
        self.choices = choices

    def finished(self, event: Finished) -> Iterator[str]:
        if self.include_usage:
            yield sse({**self.head, "choices": [], "usage": usage_body(event.usage)})
        yield DONE

    def failed(self, event: Failed) -> Iterator[str]:
        yield sse(failure_body(event))


def by_choice(output: list[Event], choices: int) -> list[list[Event]]:
    """A whole answer's events, choice by choice."""
    grouped: list[list[Event]] = [[] for _ in range(choices)]
    for event in output:
        grouped[event.index].append(event)
    return grouped


class ChatEncoder(OpenAIEncoder):
    """chat.completion.chunk frames: roles first (the commit), text, thinking and tool calls, finishes, usage, [DONE].

    The model's thinking goes in ``reasoning_content``, as llama.cpp's and DeepSeek's servers write it.
    """

    protocol = PROTOCOL

    def __init__(self, model: str, completion_id: str, created: int, include_usage: bool,
                 choices: int = 1, logprobs: bool = False, custom_tools: frozenset[str] = frozenset(),
                 legacy_functions: bool = False) -> None:
        head = {"id": completion_id, "object": "chat.completion.chunk", "created": created, "model": model,
                "system_fingerprint": FINGERPRINT}
        super().__init__(head, include_usage, choices)
        self.with_logprobs = logprobs
        self.custom_tools = custom_tools  # the names whose calls are custom tool calls
        self.legacy_functions = legacy_functions  # a call is the message's function_call, as before tools
        self.calls: dict[int, int] = {}  # how many calls each choice has made
        self.started: dict[str, list[int]] = {}  # a started call's number and how much of its arguments was sent

    def _chunk(self, delta: dict, index: int = 0, finish: Optional[str] = None,
               logprobs: Optional[list[TokenLogprob]] = None) -> str:
        listed = {"content": logprob_content(logprobs), "refusal": None} if logprobs else None
        choice = {"index": index, "delta": delta, "logprobs": listed, "finish_reason": finish}
        chunk = {**self.head, "choices": [choice]}
        if self.include_usage:
            chunk["usage"] = None
        return sse(chunk)

    def start(self) -> Iterator[str]:
        for index in range(self.choices):
            yield self._chunk({"role": "assistant", "content": ""}, index)

    def text(self, event: TextDelta) -> Iterator[str]:
        yield self._chunk({"content": event.text}, event.index, logprobs=self.take_logprobs(event.index))

    def reasoning(self, event: ReasoningDelta) -> Iterator[str]:
        yield self._chunk({"reasoning_content": event.text}, event.index)

    def call_start(self, event: ToolCallStart) -> Iterator[str]:
        # A function's call goes out as it is written; a custom tool's input comes whole, at its end.
        if event.name in self.custom_tools:
            return
        self.started[event.id] = [self._number(event.index), 0]
        if self.legacy_functions:
            yield self._chunk({"function_call": {"name": event.name, "arguments": ""}}, event.index)
            return
        head = _tool_call(ToolCall(event.id, event.name, ""), self.started[event.id][0])
        yield self._chunk({"tool_calls": [head]}, event.index)

    def call_arguments(self, event: ArgumentsDelta) -> Iterator[str]:
        started = self.started.get(event.id)
        if started is not None:
            started[1] += len(event.text)
            yield self._arguments(started[0], event.text, event.index)

    def tool_call(self, event: ToolCall) -> Iterator[str]:
        # The call's head, then its arguments: clients accumulate the deltas by index.
        started = self.started.pop(event.id, None)
        if started is not None:
            if event.arguments[started[1]:]:
                yield self._arguments(started[0], event.arguments[started[1]:], event.index)
            return
        if self.legacy_functions:
            yield self._chunk({"function_call": {"name": event.name, "arguments": ""}}, event.index)
            yield self._chunk({"function_call": {"arguments": event.arguments}}, event.index)
            return
        number = self._number(event.index)
        call = _tool_call(event, number, event.name in self.custom_tools)
        kind = call["type"]
        body, rest = ("input", call["custom"]["input"]) if kind == "custom" else ("arguments", event.arguments)
        yield self._chunk({"tool_calls": [{**call, kind: {"name": event.name, body: ""}}]}, event.index)
        yield self._chunk({"tool_calls": [{"index": number, kind: {body: rest}}]}, event.index)

    def _number(self, index: int) -> int:
        """The next call's number in choice ``index``."""
        number = self.calls.get(index, 0)
        self.calls[index] = number + 1
        return number

    def _arguments(self, number: int, text: str, index: int) -> str:
        delta = {"function_call": {"arguments": text}} if self.legacy_functions else \
            {"tool_calls": [{"index": number, "function": {"arguments": text}}]}
        return self._chunk(delta, index)

    def choice_end(self, event: ChoiceEnd) -> Iterator[str]:
        rest = self.take_logprobs(event.index)
        if rest:  # tokens whose text was held back or parsed into a tool call
            yield self._chunk({}, event.index, logprobs=rest)
        yield self._chunk({}, event.index, self._finish_reason(event))

    def _finish_reason(self, event: ChoiceEnd) -> str:
        return "function_call" if self.legacy_functions and event.reason == "tool_calls" else event.reason

    def whole(self, output: list[Event], finished: Finished) -> dict:
        return {
            **self.head, "object": "chat.completion",
            "choices": [self._choice(index, events) for index, events in enumerate(by_choice(output, self.choices))],
            "usage": usage_body(finished.usage),
        }

    def _choice(self, index: int, events: list[Event]) -> dict:
        text = "".join(e.text for e in events if isinstance(e, TextDelta))
        thinking = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
        calls = [_tool_call(e, i, e.name in self.custom_tools)
                 for i, e in enumerate(e for e in events if isinstance(e, ToolCall))]
        message = {"role": "assistant", "content": text if text or not calls else None, "refusal": None}
        if thinking:
            message["reasoning_content"] = thinking
        if calls and self.legacy_functions:
            message["function_call"] = calls[0]["function"]
        elif calls:
            message["tool_calls"] = [{k: v for k, v in c.items() if k != "index"} for c in calls]
        tokens = [t for e in events if isinstance(e, Logprobs) for t in e.tokens]
        end = next(e for e in events if isinstance(e, ChoiceEnd))
        listed = {"content": logprob_content(tokens), "refusal": None} if self.with_logprobs else None
        return {"index": index, "message": message, "logprobs": listed, "finish_reason": self._finish_reason(end)}
