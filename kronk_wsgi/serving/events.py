"""The neutral stream of generation events that every protocol encodes.

A job answers with one or more choices (``index`` numbers them: n replies
to one prompt, or one per prompt); each ends with ChoiceEnd, and the job with
Finished. Most protocols have one choice, index 0.
"""

import dataclasses
from typing import Iterable, Optional

import numpy as np


@dataclasses.dataclass(frozen=True)
class Usage:
    """Token counts of one generation: of the prompt's, ``cached_tokens`` came from a cache and
    ``cache_written`` were saved into the prompt cache at the request's save points."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    cache_written: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclasses.dataclass(frozen=True)
class TextDelta:
    """New generated text of the answer."""

    text: str
    index: int = 0


@dataclasses.dataclass(frozen=True)
class ReasoningDelta:
    """New generated text of the model's thinking, before its answer."""

    text: str
    index: int = 0


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    """A generated token's bytes and log probability, with the likeliest tokens at its place (``top_ids`` their
    ids, in the same order)."""

    piece: bytes
    logprob: float
    top: tuple[tuple[bytes, float], ...]
    id: int = -1
    top_ids: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class Logprobs:
    """Generated tokens with their log probabilities: the tokens of the text that follows (or that ended)."""

    tokens: tuple[TokenLogprob, ...]
    index: int = 0


@dataclasses.dataclass(frozen=True)
class TokenIds:
    """The ids of generated tokens: of the text that follows (or that ended), when the request asked for them."""

    ids: tuple[int, ...]
    index: int = 0


@dataclasses.dataclass(frozen=True)
class ToolCallStart:
    """A tool call the model has begun to write, its tool named: its arguments follow as ArgumentsDelta events,
    then the ToolCall with the same ``id`` ends it."""

    id: str
    name: str
    index: int = 0


@dataclasses.dataclass(frozen=True)
class ArgumentsDelta:
    """More of the arguments' JSON text of the started call ``id``."""

    id: str
    text: str
    index: int = 0


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """A tool call parsed out of the generated text; ``arguments`` is a JSON object's text.

    A call that was started (ToolCallStart) ends here; its arguments begin with the deltas sent, in order.
    A call cut off by the token limit is not ``complete``: its arguments are the text written so far.
    """

    id: str
    name: str
    arguments: str
    index: int = 0
    complete: bool = True


@dataclasses.dataclass(frozen=True)
class Embedding:
    """The model's vector for the ``index``-th input: its embedding, or a reranker's scores."""

    index: int
    vector: np.ndarray  # float32


@dataclasses.dataclass(frozen=True)
class KeepAlive:
    """Nothing was sent for a keep-alive interval."""


@dataclasses.dataclass(frozen=True)
class ChoiceEnd:
    """A choice ended normally: reason is "stop", "length" or "tool_calls".

    ``stop_sequence`` is the request's stop sequence that ended it, if one did.
    """

    reason: str
    stop_sequence: Optional[str] = None
    index: int = 0
    window_full: bool = False  # a "length" end at the end of the context window, not of max_tokens
    drafted: int = 0  # speculative decoding: the choice's tokens drafted, and those the model took
    accepted: int = 0


@dataclasses.dataclass(frozen=True)
class PromptCached:
    """How much of the prompt the cache serves, known before the prompt is evaluated (the first event of a
    generation): of ``usage``, only the prompt's counts."""

    usage: Usage


@dataclasses.dataclass(frozen=True)
class Finished:
    """The job ended normally, every choice with it."""

    usage: Usage


@dataclasses.dataclass(frozen=True)
class Failed:
    """Generation ended with an error after it started; code is "engine_error", "timeout", "shutdown",
    "grammar_error" or "model_busy" (an engine elsewhere did not take it within its admission wait)."""

    code: str
    message: str


@dataclasses.dataclass(frozen=True)
class Compacting:
    """The model has begun to summarize the conversation, which its summary will take the place of."""


@dataclasses.dataclass(frozen=True)
class Compacted:
    """The model's summary of the conversation is written (``usage`` is its generation's); the reply follows."""

    summary: str
    usage: Usage


@dataclasses.dataclass(frozen=True)
class ToolsListed:
    """The tools of a server the request lets the model use, listed before the model began (or why they are not:
    ``error``); each tool a dict of its ``name``, ``description`` and ``input_schema``."""

    server: str
    tools: tuple[dict, ...] = ()
    error: Optional[str] = None


@dataclasses.dataclass(frozen=True)
class ServerToolCall:
    """The model called a tool the server runs (``tool`` of ``server``); its result follows."""

    call: ToolCall
    server: str
    tool: str


@dataclasses.dataclass(frozen=True)
class ServerToolResult:
    """A server-run tool's result: its text, or ``error`` (``by_tool``: the tool's own failure, else its server's);
    ``approval`` names the request for approval the client answered, if the call waited for one."""

    call: ToolCall
    server: str
    tool: str
    output: str = ""
    error: Optional[str] = None
    by_tool: bool = False
    approval: Optional[str] = None


@dataclasses.dataclass(frozen=True)
class ApprovalAsked:
    """The model called a server-run tool that waits for the client's approval: the answer ends here."""

    call: ToolCall
    server: str
    tool: str


Event = (TextDelta | ReasoningDelta | Logprobs | TokenIds | ToolCallStart | ArgumentsDelta | ToolCall | ChoiceEnd
         | Embedding | KeepAlive | PromptCached | Finished | Failed | Compacting | Compacted | ToolsListed
         | ServerToolCall | ServerToolResult | ApprovalAsked)
KEEPALIVE = KeepAlive()


def coalesce(events: Iterable[Event]) -> list[Event]:
    """Events with each run of one choice's text, token ids and log probabilities merged: the run's TokenIds and
    Logprobs, then its text; and each run of one call's argument deltas merged."""
    out: list[Event] = []
    texts: list[str] = []
    tokens: list[TokenLogprob] = []
    ids: list[int] = []
    index = 0

    def end_run() -> None:
        if ids:
            out.append(TokenIds(tuple(ids), index))
        if tokens:
            out.append(Logprobs(tuple(tokens), index))
        if texts:
            out.append(TextDelta("".join(texts), index))
        texts.clear()
        tokens.clear()
        ids.clear()

    for event in events:
        if isinstance(event, (TextDelta, Logprobs, TokenIds)):
            if event.index != index:
                end_run()
                index = event.index
            if isinstance(event, TextDelta):
                texts.append(event.text)
            elif isinstance(event, TokenIds):
                ids.extend(event.ids)
            else:
                tokens.extend(event.tokens)
        else:
            end_run()
            last = out[-1] if out else None
            if isinstance(event, ArgumentsDelta) and isinstance(last, ArgumentsDelta) and last.id == event.id:
                out[-1] = dataclasses.replace(last, text=last.text + event.text)
            else:
                out.append(event)
    end_run()
    return out
