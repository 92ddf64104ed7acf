"""POST /v1/completions: OpenAI's legacy text completions, streamed or whole."""

import time
import uuid
from typing import Annotated, Iterator, Literal, Optional, Union

import pydantic
from flask import Blueprint
from pydantic import Field

from ..serving.events import Event, Finished, TextDelta
from .generation import start_generation
from .openai_chat import FINGERPRINT, OpenAIEncoder, usage_body
from .response import respond
from .schemas import SamplingFields, StreamOptions, parse_body
from .sse import sse
from .state import record

bp = Blueprint("openai_completions", __name__)


Tokens = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]


class CompletionRequest(SamplingFields):
    """``prompt`` as a string or token ids, or a list of one of them (several prompts: not yet)."""

    model: str
    prompt: Union[str, Tokens, Annotated[list[str], Field(min_length=1, max_length=1)],
                  Annotated[list[Tokens], Field(min_length=1, max_length=1)]]
    max_tokens: Optional[Annotated[int, Field(ge=1)]] = 16
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    echo: Literal[False] = False
    suffix: Optional[str] = None
    best_of: Literal[1] = 1

    @pydantic.field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, value):
        if isinstance(value, list) and len(value) > 1 and not isinstance(value[0], int):
            raise ValueError("several prompts in one request are not supported yet: send one prompt")
        return value

    @pydantic.model_validator(mode="after")
    def _checks(self) -> "CompletionRequest":
        if self.suffix:
            raise ValueError("suffix (fill-in-the-middle) is not supported")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        if isinstance(self.prompt, list) and not isinstance(self.prompt[0], int):
            self.prompt = self.prompt[0]  # a list of one prompt is that prompt
        return self


@bp.post("/v1/completions")
def completions():
    """Continue a prompt."""
    body = parse_body(CompletionRequest)
    session = start_generation(
        body.model,
        text=body.prompt if isinstance(body.prompt, str) else None,
        token_ids=None if isinstance(body.prompt, str) else body.prompt,
        prompt_param="prompt",
        max_tokens=body.max_tokens,
        max_tokens_param="max_tokens",
        sampling=lambda model: body.sampling(model.engine.tokenizer.vocab_size),
        stop=body.stop_sequences(),
    )
    completion_id = record().response_id = "cmpl-" + uuid.uuid4().hex
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return respond(session, CompletionEncoder(body.model, completion_id, include_usage), body.stream)


def _choice(text: str, finish: Optional[str]) -> dict:
    return {"text": text, "index": 0, "logprobs": None, "finish_reason": finish}


class CompletionEncoder(OpenAIEncoder):
    """text_completion frames: an empty choice first (the commit), text, finish, usage, [DONE]."""

    def __init__(self, model: str, completion_id: str, include_usage: bool) -> None:
        head = {"id": completion_id, "object": "text_completion", "created": int(time.time()), "model": model,
                "system_fingerprint": FINGERPRINT}
        super().__init__(head, include_usage)

    def _frame(self, text: str, finish: Optional[str] = None) -> str:
        extra = {"usage": None} if self.include_usage else {}
        return sse({**self.head, "choices": [_choice(text, finish)], **extra})

    def start(self) -> Iterator[str]:
        yield self._frame("")

    def text(self, event: TextDelta) -> Iterator[str]:
        yield self._frame(event.text)

    def _finish(self, reason: str) -> str:
        return self._frame("", reason)

    def whole(self, output: list[Event], finished: Finished) -> dict:
        text = "".join(e.text for e in output if isinstance(e, TextDelta))
        return {**self.head, "choices": [_choice(text, finished.reason)], "usage": usage_body(finished.usage)}
