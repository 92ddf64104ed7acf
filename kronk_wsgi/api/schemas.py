"""Request bodies, validated strictly: wrong types and unknown fields are 400s, never guesses."""

from typing import Annotated, Literal, Optional, Type, TypeVar, Union

import pydantic
from flask import request
from pydantic import BaseModel, ConfigDict, Field

from ..engine.sampling import SamplingParams
from .errors import invalid

M = TypeVar("M", bound=BaseModel)


class Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class TextPart(Strict):
    type: Literal["text"]
    text: str


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: Union[str, list[TextPart]]
    name: Optional[str] = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class StreamOptions(Strict):
    include_usage: bool = False


class SamplingFields(Strict):
    """Sampling fields shared by the OpenAI endpoints; top_k, min_p and repetition_penalty are extensions."""

    temperature: Annotated[float, Field(ge=0, le=2)] = 1.0
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    top_k: Annotated[int, Field(ge=0)] = 0
    min_p: Annotated[float, Field(ge=0, le=1)] = 0.0
    repetition_penalty: Annotated[float, Field(gt=0, le=10)] = 1.0
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] = 0.0
    logit_bias: Optional[dict[str, Annotated[float, Field(ge=-100, le=100)]]] = None
    seed: Optional[int] = None
    stop: Union[str, Annotated[list[str], Field(max_length=4)], None] = None
    n: Literal[1] = 1
    user: Optional[str] = None

    def sampling(self, vocab_size: int) -> SamplingParams:
        bias = []
        for key, value in (self.logit_bias or {}).items():
            if not key.isdigit() or int(key) >= vocab_size:
                raise invalid(f"logit_bias: {key!r} is not a token id of this model", param="logit_bias")
            bias.append((int(key), value))
        return SamplingParams(
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
            repetition_penalty=self.repetition_penalty, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, logit_bias=tuple(bias), seed=self.seed,
        )

    def stop_sequences(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class ChatCompletionRequest(SamplingFields):
    model: str
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    max_tokens: Optional[Annotated[int, Field(ge=1)]] = None
    max_completion_tokens: Optional[Annotated[int, Field(ge=1)]] = None

    @pydantic.model_validator(mode="after")
    def _checks(self) -> "ChatCompletionRequest":
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise ValueError("give max_tokens or max_completion_tokens, not both")
        return self

    @property
    def token_limit(self) -> Optional[int]:
        return self.max_completion_tokens or self.max_tokens


def _param(loc: tuple) -> Optional[str]:
    """pydantic's error location as OpenAI's param string: messages[0].content."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in ("str", "list[TextPart]", "list[str]") or "[" in str(part) or str(part).startswith(("function-", "constrained-")):
            continue  # the name of a union member, not a field
        else:
            out += ("." if out else "") + str(part)
    return out or None


def parse_body(schema: Type[M]) -> M:
    """The JSON body as ``schema``; a 400 naming the offending param otherwise."""
    if not request.is_json:
        raise invalid("the body must be JSON, sent with Content-Type: application/json")
    data = request.get_json(silent=True)
    if data is None:
        raise invalid("the body is not valid JSON")
    if not isinstance(data, dict):
        raise invalid("the body must be a JSON object")
    try:
        return schema.model_validate(data)
    except pydantic.ValidationError as exc:
        # The deepest error: for a union (str or list of parts) the branch that got furthest.
        error = max(exc.errors(include_url=False), key=lambda e: len(e["loc"]))
        param = _param(error["loc"])
        if error["type"] == "extra_forbidden":
            raise invalid(f"unrecognized request argument supplied: {param}", param=param) from None
        if error["type"] == "missing":
            raise invalid(f"missing required parameter: {param}", param=param) from None
        where = f"{param}: " if param else ""
        raise invalid(f"{where}{error['msg']}", param=param) from None
