"""The decode loop: prefill, then sample, detokenize and check stops per token.

Runs in the slot's worker thread. It knows nothing of HTTP or gevent: it
yields text deltas and leaves counts and the finish reason on itself.
"""

import codecs
from typing import Callable, Iterator, Optional, Sequence

from .base import Cancelled, Slot
from .sampling import Sampler, SamplingParams
from .tokenizer import Tokenizer


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


class Generation:
    """One request's generation on one slot; iterate it for text deltas.

    Generation stops at any of ``end_ids`` (EOS and the end-of-turn tokens),
    which never reach the text; other control tokens add no text either,
    except those in ``shown`` (a tool-call tag that is a control token).
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
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.finish_reason = ""
        self.stop_sequence: Optional[str] = None

    def __iter__(self) -> Iterator[str]:
        slot = self.slot
        self.cached_tokens = slot.prefill(self.prompt, self.cancelled)
        sampler = Sampler(self.sampling, self.prompt)
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        stops = StopScanner(self.stop)
        while True:
            token = sampler.sample(slot.logits())
            if token in self.end_ids:
                self.finish_reason = "stop"
                break
            self.completion_tokens += 1
            piece = self.tokenizer.token_text(token).encode() if token in self.shown else self.tokenizer.piece(token)
            text, stopped = stops.feed(decoder.decode(piece))
            if text:
                yield text
            if stopped:
                self.finish_reason = "stop"
                self.stop_sequence = stops.matched
                return
            if self.completion_tokens >= self.max_tokens or len(slot.cached) >= self.context_length:
                self.finish_reason = "length"
                break
            if self.cancelled():
                raise Cancelled()
            slot.decode([token])
        tail, stopped = stops.feed(decoder.decode(b"", final=True))
        if stopped:
            self.finish_reason, self.stop_sequence = "stop", stops.matched
        else:
            tail += stops.flush()
        if tail:
            yield tail
