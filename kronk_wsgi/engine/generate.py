"""The decode loop: prefill, then sample, detokenize and check stops per token.

Runs in the slot's worker thread. It knows nothing of HTTP or gevent: it
yields text deltas and leaves counts and the finish reason on itself.
"""

import codecs
import dataclasses
from typing import Callable, Iterator, Optional, Sequence

import numpy as np

from .base import Cancelled, Slot
from .grammar import Constraint
from .sampling import Sampler, SamplingParams, logprobs
from .tokenizer import Tokenizer


@dataclasses.dataclass(frozen=True)
class SampledToken:
    """A generated token with the model's log probability of it and of the likeliest tokens."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


class StopScanner:
    """Cuts text at the first stop sequence, holding back possible starts of one."""

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = [s for s in stops if s]
        self._pending = ""
        self.matched: Optional[str] = None  # the stop sequence that was reached

    def feed(self, text: str) -> tuple[str, bool]:
        """Return (text safe to emit, whether a stop sequence was reached)."""
        self._pending += text
        if not self._stops:
            out, self._pending = self._pending, ""
            return out, False
        hits = [(i, stop) for stop in self._stops if (i := self._pending.find(stop)) >= 0]
        if hits:
            at, self.matched = min(hits, key=lambda hit: hit[0])
            out, self._pending = self._pending[:at], ""
            return out, True
        hold = 0
        for stop in self._stops:
            for k in range(min(len(stop) - 1, len(self._pending)), hold, -1):
                if self._pending.endswith(stop[:k]):
                    hold = k
                    break
        cut = len(self._pending) - hold
        out, self._pending = self._pending[:cut], self._pending[cut:]
        return out, False

    def flush(self) -> str:
        """Text held back when generation ends without a stop."""
        out, self._pending = self._pending, ""
        return out


class TagWatch:
    """Tells when generated text, fed piece by piece, has just reached ``tag``."""

    def __init__(self, tag: str) -> None:
        self.tag = tag
        self._tail = ""

    def feed(self, piece: bytes) -> bool:
        self._tail = (self._tail + piece.decode("utf-8", "replace"))[-len(self.tag):]
        return self._tail == self.tag


class Generation:
    """One request's generation on one slot; iterate it for text deltas.

    Generation stops at any of ``end_ids`` (EOS and the end-of-turn tokens),
    which never reach the text; other control tokens add no text either,
    except those in ``shown`` (a tag a parser reads that is a control token).
    With a ``constraint`` only tokens it allows are sampled, and generation
    stops when its grammar is complete; with ``constrain_after`` too, the
    constraint starts once the text has reached that text (the end of a
    reasoning model's thinking). A reply that starts inside a thinking block
    ended by ``thinking_close`` is made to close it after ``thinking_budget``
    tokens: the tag's tokens are forced then. With ``top_logprobs`` (0 or more),
    each sampled token is added to ``sampled`` with its log probability; the
    caller takes them as the text they make comes out. ``choice`` numbers the
    replies to one prompt: each draws its own random numbers.
    After iteration ``finish_reason`` is "stop" (an end token or a stop
    sequence) or "length" (max_tokens or the context window),
    ``stop_sequence`` is the stop sequence that ended it, if one did, and
    ``completion_tokens`` counts the sampled tokens. ``Cancelled`` propagates
    when ``cancelled()`` turns true between two engine calls.
    """

    def __init__(
        self,
        slot: Slot,
        prompt: list[int],
        *,
        tokenizer: Tokenizer,
        end_ids: frozenset[int],
        shown: frozenset[int] = frozenset(),
        max_tokens: int,
        context_length: int,
        sampling: SamplingParams,
        stop: Sequence[str] = (),
        cancelled: Callable[[], bool] = lambda: False,
        constraint: Optional[Constraint] = None,
        constrain_after: str = "",
        thinking_close: str = "",
        thinking_budget: Optional[int] = None,
        top_logprobs: Optional[int] = None,
        choice: int = 0,
    ) -> None:
        self.slot = slot
        self.prompt = prompt
        self.tokenizer = tokenizer
        self.end_ids = end_ids
        self.shown = shown
        self.max_tokens = max_tokens
        self.context_length = context_length
        self.sampling = sampling
        self.stop = stop
        self.cancelled = cancelled
        self.constraint = constraint
        self.constrain_after = constrain_after
        self.thinking_close = thinking_close
        self.thinking_budget = thinking_budget
        self.top_logprobs = top_logprobs
        self.choice = choice
        self.sampled: list[SampledToken] = []
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.finish_reason = ""
        self.stop_sequence: Optional[str] = None

    def _tokens_of(self, tag: str) -> list[int]:
        """A tag's tokens: its control token if it is one, else its text's."""
        control = self.tokenizer.control.get(tag)
        return [control] if control is not None else self.tokenizer.continuation(tag)

    def __iter__(self) -> Iterator[str]:
        slot = self.slot
        self.cached_tokens = slot.prefill(self.prompt, self.cancelled)
        sampler = Sampler(self.sampling, self.prompt, self.choice)
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        stops = StopScanner(self.stop)
        constraint = None if self.constrain_after else self.constraint
        constraint_start = TagWatch(self.constrain_after)
        thinking = bool(self.thinking_close) and self.thinking_budget is not None
        thinking_end = TagWatch(self.thinking_close)
        closing: list[int] = []  # the closing tag's tokens, forced once the budget is spent
        allowed: Optional[np.ndarray] = None  # what the next token may be (None: any), or
        forced: Optional[int] = None  # what it must be
        sampled: Optional[SampledToken] = None

        def pick(logits: np.ndarray) -> int:
            """The next token (and its log probabilities): the engine runs it right after its call."""
            nonlocal sampled
            mask = allowed
            if forced is not None:
                mask = np.zeros(len(logits), dtype=bool)
                mask[forced] = True
            token = sampler.sample(logits, mask)
            if self.top_logprobs is not None and token not in self.end_ids:
                logprob, top = logprobs(logits, token, self.top_logprobs)
                sampled = SampledToken(token, logprob, tuple(top))
            return token

        token: Optional[int] = None
        while True:
            allowed = constraint.allowed() if constraint else None
            forced = None
            if thinking and not closing and self.completion_tokens >= self.thinking_budget:
                closing = self._tokens_of(self.thinking_close)
            if closing:
                forced = closing.pop(0)
                thinking = bool(closing)
            token = pick(slot.logits()) if token is None else slot.decode([token], pick)
            if token in self.end_ids:
                self.finish_reason = "stop"
                break
            self.completion_tokens += 1
            if sampled is not None:
                self.sampled.append(sampled)
                sampled = None
            piece = self.tokenizer.token_text(token).encode() if token in self.shown else self.tokenizer.piece(token)
            if thinking and not closing:
                thinking = not thinking_end.feed(piece)
            if constraint:
                constraint.take(token)
            elif self.constraint and constraint_start.feed(piece):
                constraint = self.constraint
            text, stopped = stops.feed(decoder.decode(piece))
            if text:
                yield text
            if stopped:
                self.finish_reason = "stop"
                self.stop_sequence = stops.matched
                return
            if constraint and constraint.complete:
                self.finish_reason = "stop"
                break
            if self.completion_tokens >= self.max_tokens or len(slot.cached) >= self.context_length:
                self.finish_reason = "length"
                break
            if self.cancelled():
                raise Cancelled()
        tail, stopped = stops.feed(decoder.decode(b"", final=True))
        if stopped:
            self.finish_reason, self.stop_sequence = "stop", stops.matched
        else:
            tail += stops.flush()
        if tail:
            yield tail
