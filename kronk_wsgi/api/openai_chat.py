"""POST /v1/chat/completions: OpenAI chat completions, streamed or whole."""

import abc
import time
import uuid
from typing import Iterator, Optional

from flask import Blueprint

from ..serving.events import Event, Failed, Finished, TextDelta, ToolCall, Usage
from .generation import start_generation
from .response import Encoder, respond
from .schemas import ChatCompletionRequest, parse_body
from .sse import DONE, sse
from .state import record

bp = Blueprint("openai_chat", __name__)

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


def _tool_choice(choice) -> tuple[str, Optional[str]]:
    """OpenAI's tool_choice as (mode, forced function name)."""
    if choice is None or isinstance(choice, str):
        return choice or "auto", None
    return "required", choice.function.name


@bp.post("/v1/chat/completions")
def chat_completions():
    """Generate a chat reply."""
    body = parse_body(ChatCompletionRequest)
    tool_choice, tool_name = _tool_choice(body.tool_choice)
    session = start_generation(
        body.model,
        messages=[m.for_template() for m in body.messages],
        thinking=body.thinking_switch(),
        prompt_param="messages",
        tools=body.template_tools(),
        strict_tools=body.strict_tools(),
        tool_choice=tool_choice,
        tool_name=tool_name,
        one_tool_call=body.parallel_tool_calls is False,
        max_tokens=body.token_limit,
        max_tokens_param="max_completion_tokens" if body.max_completion_tokens else "max_tokens",
        sampling=lambda model: body.sampling(model.engine.tokenizer.vocab_size),
        stop=body.stop_sequences(),
    )
    completion_id = record().response_id = "chatcmpl-" + uuid.uuid4().hex
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return respond(session, ChatEncoder(body.model, completion_id, int(time.time()), include_usage), body.stream)


def _tool_call(call: ToolCall, index: int) -> dict:
    return {"index": index, "id": "call_" + call.id, "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}


class OpenAIEncoder(Encoder):
    """What OpenAI's chunk protocols share: a finish chunk, usage if asked for, [DONE]; a failure as data."""

    def __init__(self, head: dict, include_usage: bool) -> None:
        self.head = head
        self.include_usage = include_usage

    @abc.abstractmethod
    def _finish(self, reason: str) -> str:
        """The chunk that carries the finish reason."""

    def finished(self, event: Finished) -> Iterator[str]:
        yield self._finish(event.reason)
        if self.include_usage:
            yield sse({**self.head, "choices": [], "usage": usage_body(event.usage)})
        yield DONE

    def failed(self, event: Failed) -> Iterator[str]:
        yield sse(failure_body(event))


class ChatEncoder(OpenAIEncoder):
    """chat.completion.chunk frames: role first (the commit), text and tool calls, finish, usage, [DONE]."""

    def __init__(self, model: str, completion_id: str, created: int, include_usage: bool) -> None:
        head = {"id": completion_id, "object": "chat.completion.chunk", "created": created, "model": model,
                "system_fingerprint": FINGERPRINT}
        super().__init__(head, include_usage)
        self.calls = 0

    def _chunk(self, delta: dict, finish: Optional[str] = None) -> str:
        chunk = {**self.head, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}
        if self.include_usage:
            chunk["usage"] = None
        return sse(chunk)

    def start(self) -> Iterator[str]:
        yield self._chunk({"role": "assistant", "content": ""})

    def text(self, event: TextDelta) -> Iterator[str]:
        yield self._chunk({"content": event.text})

    def tool_call(self, event: ToolCall) -> Iterator[str]:
        # The call's head, then its arguments: clients accumulate the deltas by index.
        head = _tool_call(event, self.calls)
        yield self._chunk({"tool_calls": [{**head, "function": {"name": event.name, "arguments": ""}}]})
        yield self._chunk({"tool_calls": [{"index": self.calls, "function": {"arguments": event.arguments}}]})
        self.calls += 1

    def _finish(self, reason: str) -> str:
        return self._chunk({}, reason)

    def whole(self, output: list[Event], finished: Finished) -> dict:
        text = "".join(e.text for e in output if isinstance(e, TextDelta))
        calls = [_tool_call(e, i) for i, e in enumerate(e for e in output if isinstance(e, ToolCall))]
        message = {"role": "assistant", "content": text if text or not calls else None, "refusal": None}
        if calls:
            message["tool_calls"] = [{k: v for k, v in c.items() if k != "index"} for c in calls]
        return {
            **self.head, "object": "chat.completion",
            "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": finished.reason}],
            "usage": usage_body(finished.usage),
        }
