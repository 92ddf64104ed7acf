"""The neutral stream of generation events that every protocol encodes."""

import dataclasses
from typing import Optional

import numpy as np


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
class ToolCall:
    """A complete tool call parsed out of the generated text; ``arguments`` is a JSON object's text."""

    id: str
    name: str
    arguments: str


@dataclasses.dataclass(frozen=True)
class Embedding:
    """The embedding vector of the ``index``-th input."""

    index: int
    vector: np.ndarray  # float32


@dataclasses.dataclass(frozen=True)
class KeepAlive:
    """Nothing was sent for a keep-alive interval."""


@dataclasses.dataclass(frozen=True)
class Finished:
    """Generation ended normally: reason is "stop", "length" or "tool_calls".

    ``stop_sequence`` is the request's stop sequence that ended it, if one did.
    """

    reason: str
    usage: Usage
    stop_sequence: Optional[str] = None


@dataclasses.dataclass(frozen=True)
class Failed:
    """Generation ended with an error after it started; code is "engine_error" or "timeout"."""

    code: str
    message: str


Event = TextDelta | ToolCall | Embedding | KeepAlive | Finished | Failed
KEEPALIVE = KeepAlive()
