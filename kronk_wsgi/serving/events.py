"""The neutral stream of generation events that every protocol encodes."""

import dataclasses


@dataclasses.dataclass(frozen=True)
class Usage:
    """Token counts of one generation."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclasses.dataclass(frozen=True)
class TextDelta:
    """New generated text."""

    text: str


@dataclasses.dataclass(frozen=True)
class KeepAlive:
    """Nothing was sent for a keep-alive interval."""


@dataclasses.dataclass(frozen=True)
class Finished:
    """Generation ended normally: reason is "stop" or "length"."""

    reason: str
    usage: Usage


@dataclasses.dataclass(frozen=True)
class Failed:
    """Generation ended with an error after it started; code is "engine_error" or "timeout"."""

    code: str
    message: str


Event = TextDelta | KeepAlive | Finished | Failed
KEEPALIVE = KeepAlive()
