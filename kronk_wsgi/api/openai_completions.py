"""POST /v1/completions: OpenAI's legacy text completions, streamed or whole."""

import time
import uuid
from typing import Annotated, Iterator, Literal, Optional

import pydantic
from flask import Blueprint, jsonify
from pydantic import Field

from ..serving.events import Failed, Finished, KeepAlive, TextDelta
from ..serving.session import Session
from .generation import run_to_end, start_generation
from .openai_chat import FINGERPRINT, failure_body, usage_body
from .schemas import SamplingFields, StreamOptions, parse_body
from .sse import DONE, KEEPALIVE_COMMENT, event_stream, sse
from .state import record

bp = Blueprint("openai_completions", __name__)


class CompletionRequest(SamplingFields):
    model: str
    prompt: str
    max_tokens: Optional[Annotated[int, Field(ge=1)]] = 16
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    echo: Literal[False] = False
    suffix: Optional[str] = None
    best_of: Literal[1] = 1

    @pydantic.model_validator(mode="after")
    def _checks(self) -> "CompletionRequest":
        if self.suffix:
            raise ValueError("suffix (fill-in-the-middle) is not supported")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self


@bp.post("/v1/completions")
def completions():
    """Continue a prompt."""
    body = parse_body(CompletionRequest)
    session = start_generation(
        body.model,
        text=body.prompt,
        prompt_param="prompt",
        max_tokens=body.max_tokens,
        max_tokens_param="max_tokens",
        sampling=lambda model: body.sampling(model.engine.tokenizer.vocab_size),
        stop=body.stop_sequences(),
    )
    head = {
        "id": "cmpl-" + uuid.uuid4().hex, "object": "text_completion", "created": int(time.time()),
        "model": body.model, "system_fingerprint": FINGERPRINT,
    }
    record().response_id = head["id"]
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        response = event_stream(_stream(session, head, include_usage))
        response.call_on_close(session.close)
        return response
    return _whole(session, head)


def _choice(text: str, finish: Optional[str]) -> dict:
    return {"text": text, "index": 0, "logprobs": None, "finish_reason": finish}


def _stream(session: Session, head: dict, include_usage: bool) -> Iterator[str]:
    """Text chunks, the finish chunk, usage, [DONE]; the first frame is the commit."""
    extra = {"usage": None} if include_usage else {}
    try:
        yield sse({**head, "choices": [_choice("", None)], **extra})
        for event in session:
            if isinstance(event, TextDelta):
                yield sse({**head, "choices": [_choice(event.text, None)], **extra})
            elif isinstance(event, KeepAlive):
                yield KEEPALIVE_COMMENT
            elif isinstance(event, Finished):
                yield sse({**head, "choices": [_choice("", event.reason)], **extra})
                if include_usage:
                    yield sse({**head, "choices": [], "usage": usage_body(event.usage)})
                yield DONE
            elif isinstance(event, Failed):
                yield sse(failure_body(event))
    finally:
        session.close()


def _whole(session: Session, head: dict):
    output, finished = run_to_end(session)
    text = "".join(e.text for e in output if isinstance(e, TextDelta))
    return jsonify({**head, "choices": [_choice(text, finished.reason)], "usage": usage_body(finished.usage)})
