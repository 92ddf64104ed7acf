"""POST /v1/chat/completions: OpenAI chat completions, streamed or whole."""

import time
import uuid
from typing import Iterator, Optional

from flask import Blueprint, jsonify

from ..serving.events import Failed, Finished, KeepAlive, TextDelta, ToolCall, Usage
from ..serving.session import Session
from .generation import run_to_end, start_generation
from .schemas import ChatCompletionRequest, parse_body
from .sse import DONE, KEEPALIVE_COMMENT, event_stream, sse
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
    created = int(time.time())
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        response = event_stream(_stream(session, body.model, completion_id, created, include_usage))
        response.call_on_close(session.close)
        return response
    return _whole(session, body.model, completion_id, created)


def _chunk(completion_id: str, created: int, model: str, delta: dict, finish: Optional[str], include_usage: bool) -> dict:
    chunk = {
        "id": completion_id, "object": "chat.completion.chunk", "created": created, "model": model,
        "system_fingerprint": FINGERPRINT,
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
    }
    if include_usage:
        chunk["usage"] = None
    return chunk


def _tool_call(call: ToolCall, index: int) -> dict:
    return {"index": index, "id": "call_" + call.id, "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}


def _stream(session: Session, model: str, completion_id: str, created: int, include_usage: bool) -> Iterator[str]:
    """The chunks: role first (the commit), then text and tool calls, finish, usage, [DONE]."""

    def chunk(delta: dict, finish: Optional[str] = None) -> str:
        return sse(_chunk(completion_id, created, model, delta, finish, include_usage))

    calls = 0
    try:
        yield chunk({"role": "assistant", "content": ""})
        for event in session:
            if isinstance(event, TextDelta):
                yield chunk({"content": event.text})
            elif isinstance(event, ToolCall):
                # The call's head, then its arguments: clients accumulate the deltas by index.
                head = _tool_call(event, calls)
                yield chunk({"tool_calls": [{**head, "function": {"name": event.name, "arguments": ""}}]})
                yield chunk({"tool_calls": [{"index": calls, "function": {"arguments": event.arguments}}]})
                calls += 1
            elif isinstance(event, KeepAlive):
                yield KEEPALIVE_COMMENT
            elif isinstance(event, Finished):
                yield chunk({}, event.reason)
                if include_usage:
                    final = _chunk(completion_id, created, model, {}, None, include_usage)
                    yield sse({**final, "choices": [], "usage": usage_body(event.usage)})
                yield DONE
            elif isinstance(event, Failed):
                yield sse(failure_body(event))
    finally:
        session.close()


def _whole(session: Session, model: str, completion_id: str, created: int):
    """Run the session to its end and answer with one chat.completion object."""
    output, finished = run_to_end(session)
    text = "".join(e.text for e in output if isinstance(e, TextDelta))
    calls = [_tool_call(e, i) for i, e in enumerate(e for e in output if isinstance(e, ToolCall))]
    message = {"role": "assistant", "content": text if text or not calls else None, "refusal": None}
    if calls:
        message["tool_calls"] = [{k: v for k, v in c.items() if k != "index"} for c in calls]
    return jsonify({
        "id": completion_id, "object": "chat.completion", "created": created, "model": model,
        "system_fingerprint": FINGERPRINT,
        "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": finished.reason}],
        "usage": usage_body(finished.usage),
    })
