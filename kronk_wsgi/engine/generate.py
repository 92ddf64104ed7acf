"""The decode loop: prefill, then sample, detokenize and check stops per token.

Runs in the slot's worker thread. It knows nothing of HTTP or gevent: it
yields text deltas and leaves counts and the finish reason on itself.
"""

import codecs
import dataclasses
import time
from typing import Callable, Iterator, Optional, Sequence, Union

import numpy as np

from .base import Cancelled, Slot
from .grammar import Grammar
from .sampling import Sampler, SamplingParams, logprobs
from .speculation import Drafting, ModelDrafter, NgramDrafter, Speculation
from .tokenizer import Tokenizer


@dataclasses.dataclass(frozen=True)
class SampledToken:
    """A generated token with the model's log probability of it and of the likeliest tokens."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


def partial_tag(text: str, tags: Sequence[str]) -> int:
    """How many characters at the end of ``text`` could be the start of one of ``tags``: text to hold back."""
    longest = 0
    for tag in tags:
        for k in range(min(len(tag) - 1, len(text)), longest, -1):
            if text.endswith(tag[:k]):
                longest = k
                break
    return longest


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
        cut = len(self._pending) - partial_tag(self._pending, self._stops)
        out, self._pending = self._pending[:cut], self._pending[cut:]
        return out, False

    def flush(self) -> str:
        """Text held back when generation ends without a stop."""
        out, self._pending = self._pending, ""
        return out


class ReplyText:
    """A reply's tokens as its text: each token's piece (a control token's adds none, except those ``shown``)
    decoded as UTF-8 and cut at the first stop text (``stop`` and ``end_texts``)."""

    def __init__(self, tokenizer: Tokenizer, options: "DecodeOptions") -> None:
        self._tokenizer = tokenizer
        self._shown = options.shown
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._stops = StopScanner(options.stop + options.end_texts)
        self._asked = options.stop
        self.stopped = False

    def piece(self, token: int) -> bytes:
        tokenizer = self._tokenizer
        return tokenizer.token_text(token).encode() if token in self._shown else tokenizer.piece(token)

    def feed(self, piece: bytes) -> str:
        """The text ``piece`` lets out; ``stopped`` turns true at a stop text."""
        text, self.stopped = self._stops.feed(self._decoder.decode(piece))
        return text

    def finish(self) -> str:
        """What is held back when the reply ends."""
        tail, self.stopped = self._stops.feed(self._decoder.decode(b"", final=True))
        return tail if self.stopped else tail + self._stops.flush()

    @property
    def stop_sequence(self) -> Optional[str]:
        """The stop sequence the text reached (None: none, or a text that ends the reply as an end token does)."""
        matched = self._stops.matched
        return matched if self.stopped and matched in self._asked else None


class TagWatch:
    """Tells when generated text, fed piece by piece, has just reached ``tag``."""

    def __init__(self, tag: str) -> None:
        self.tag = tag
        self._tail = ""

    def feed(self, piece: bytes) -> bool:
        self._tail = (self._tail + piece.decode("utf-8", "replace"))[-len(self.tag):]
        return self._tail == self.tag


@dataclasses.dataclass(frozen=True)
class DecodeOptions:
    """How a reply is decoded, the same for each reply of a request.

    Decoding stops at any of ``end_ids`` (EOS and the end-of-turn tokens),
    which never reach the text, but not before ``min_tokens`` tokens, and at
    any of ``end_texts``, which do not reach it either; other control tokens
    add no text either,
    except those in ``shown`` (a tag a parser reads that is a control token).
    With a ``grammar`` only tokens it allows are sampled, and decoding stops
    when it is complete; with ``constrain_after`` too, the constraint starts
    once the text has reached that text (the end of a reasoning model's
    thinking). A reply that starts inside a thinking block ended by
    ``thinking_close`` is made to close it after ``thinking_budget`` tokens:
    the tag's tokens are forced then. With ``top_logprobs`` (0 or more), each
    sampled token is reported with its log probability; with ``token_ids``,
    each generated token's id (an end token's too). With ``speculation`` (on an
    engine that ``speculates``), drafted tokens are checked several in one call:
    each is picked as it would have been without (the same sampler, the same
    random draw) and kept only if the pick is the draft; the reply is the same
    token for token where the engine computes a token's logits the same in a
    batch as alone (docs/ENGINES.rst).
    """

    end_ids: frozenset[int]
    max_tokens: int
    sampling: SamplingParams = SamplingParams()
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    end_texts: tuple[str, ...] = ()  # text that ends the reply as an end token does (a marker not in the vocabulary)
    shown: frozenset[int] = frozenset()
    grammar: Optional[Grammar] = None
    constrain_after: str = ""
    thinking_close: str = ""
    thinking_budget: Optional[int] = None
    top_logprobs: Optional[int] = None
    token_ids: bool = False
    speculation: Optional[Speculation] = None


class Generation:
    """One reply on one slot, decoded as ``options`` say; iterate it for text deltas.

    Sampled tokens are added to ``sampled`` with their log probabilities, and
    generated tokens' ids to ``token_ids``, when the options ask for them; the
    caller takes them as the text they make comes out. ``choice`` numbers the
    replies to one prompt: each draws its own random numbers. The prefill
    saves the prompt's prefix at each of ``save_at`` (see ``Slot.prefill``). After iteration ``finish_reason`` is
    "stop" (an end token, a stop sequence or a complete grammar) or "length" (max_tokens or the
    context window), ``stop_sequence`` is the stop sequence that ended it, if
    one did, ``window_full`` says the context window has no room left, and
    ``completion_tokens`` counts the sampled tokens; ``cached_tokens`` and
    ``cache_written`` count the prompt's tokens reused and newly saved.
    ``drafting`` counts speculation's drafts and the tokens taken of them.
    ``Cancelled`` propagates when ``cancelled()`` turns true between two
    engine calls.
    """

    def __init__(
        self,
        slot: Slot,
        prompt: list[int],
        tokenizer: Tokenizer,
        options: DecodeOptions,
        context_length: int,
        cancelled: Callable[[], bool] = lambda: False,
        choice: int = 0,
        save_at: Sequence[int] = (),
    ) -> None:
        self.slot = slot
        self.prompt = prompt
        self.tokenizer = tokenizer
        self.options = options
        self.context_length = context_length
        self.cancelled = cancelled
        self.choice = choice
        self.save_at = save_at
        self.sampled: list[SampledToken] = []
        self.token_ids: list[int] = []
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.cache_written = 0
        self._reused = False
        self.finish_reason = ""
        self.stop_sequence: Optional[str] = None
        self.window_full = False
        self.drafting = Drafting()

    def _tokens_of(self, tag: str) -> list[int]:
        """A tag's tokens: its control token if it is one, else its text's."""
        control = self.tokenizer.control.get(tag)
        return [control] if control is not None else self.tokenizer.continuation(tag)

    @property
    def _evaluated(self) -> int:
        """Where the last token picked goes in the cache once decoded: the prompt, then every token picked before it
        (drafted ones the cache holds beyond it do not count)."""
        return len(self.prompt) + self.completion_tokens - 1

    def _drafter(self, speculation: Speculation) -> Union[NgramDrafter, ModelDrafter]:
        """The slot's draft model, if it has one, following the prompt; else n-gram lookup in it. A draft model's
        slot holds no other cache scope's text (what it reuses would show in how fast a reply comes)."""
        slot = self.slot
        if slot.draft is None:
            return NgramDrafter(self.prompt, slot.draft_costs)
        slot.draft.slot.enter(slot.scope)
        return ModelDrafter(self.prompt, slot.draft_costs, slot.draft, speculation.p_min, self.cancelled)

    def _draft(self, drafter: Union[NgramDrafter, ModelDrafter], speculation: Speculation) -> list[int]:
        """A draft to check after the last token picked: no longer than the reply or the context has room for."""
        room = min(speculation.n_max, self.options.max_tokens - self.completion_tokens,
                   self.context_length - self._evaluated - 1)
        draft = drafter.draft(room, speculation.n_min) if room > 0 else []
        if draft:
            self.drafting.drafts += 1
            self.drafting.drafted += len(draft)
        return draft

    def reuse(self) -> None:
        """Decide how much of the prompt the slot's cache serves (``cached_tokens``, ``cache_written``), before
        anything is evaluated; iterating does it if it was not done."""
        self.cached_tokens = self.slot.reuse(self.prompt, self.save_at)
        self.cache_written = self.slot.cache_written
        self._reused = True

    def __iter__(self) -> Iterator[str]:
        slot, options = self.slot, self.options
        if not self._reused:
            self.reuse()
        slot.evaluate(self.prompt, self.cancelled)
        if options.max_tokens <= 0:  # the prompt evaluated into the cache, and nothing generated
            self.finish_reason = "length"
            return
        sampler = Sampler(options.sampling, self.prompt, self.choice)
        text = ReplyText(self.tokenizer, options)
        later = options.grammar.constraint() if options.grammar else None  # once the text reaches constrain_after
        constraint = None if options.constrain_after else later
        constraint_start = TagWatch(options.constrain_after)
        thinking = bool(options.thinking_close) and options.thinking_budget is not None
        thinking_end = TagWatch(options.thinking_close)
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
            elif self.completion_tokens < options.min_tokens and options.end_ids:
                mask = np.ones(len(logits), dtype=bool) if mask is None else mask.copy()
                mask[list(options.end_ids)] = False
            token = sampler.sample(logits, mask)
            if options.top_logprobs is not None and token not in options.end_ids:
                logprob, top = logprobs(logits, token, options.top_logprobs)
                sampled = SampledToken(token, logprob, tuple(top))
            return token

        speculation = options.speculation
        drafter = self._drafter(speculation) if speculation else None
        draft: list[int] = []  # drafted tokens in the cache, after the token before them
        rows: Optional[np.ndarray] = None  # the logits after that token and after each drafted one
        checked = 0  # drafted tokens taken so far

        def advance(previous: Optional[int]) -> int:
            """The next token: picked on the prefill's logits, on a checked draft's, or after decoding ``previous``
            (with a draft after it, when one is found)."""
            nonlocal draft, rows, checked
            if previous is None:
                token = pick(slot.logits())
            else:
                if rows is None and drafter is not None:
                    draft = self._draft(drafter, speculation)
                    if draft:
                        started = time.perf_counter()
                        rows, checked = slot.decode_each([previous, *draft]), 0
                        drafter.costs.record(len(draft) + 1, time.perf_counter() - started)
                if rows is None:
                    started = time.perf_counter()
                    token = slot.decode([previous], pick)
                    if drafter is not None:
                        drafter.costs.record(1, time.perf_counter() - started)
                else:
                    token = pick(rows[checked])
                    if checked < len(draft) and token == draft[checked]:
                        checked += 1  # in the cache already: the next pick is on the next row
                        self.drafting.took(checked)
                    else:
                        if checked < len(draft):
                            slot.truncate(len(slot.cached) - (len(draft) - checked))
                        drafter.checked(len(draft), checked)
                        rows = None
            if drafter is not None:
                drafter.add(token)
            return token

        token: Optional[int] = None
        while True:
            allowed = constraint.allowed() if constraint else None
            forced = None
            if thinking and not closing and self.completion_tokens >= options.thinking_budget:
                closing = self._tokens_of(options.thinking_close)
            if closing:
                forced = closing.pop(0)
                thinking = bool(closing)
            token = advance(token)
            if options.token_ids:  # an end token's too, as llama-server reports them
                self.token_ids.append(token)
            if token in options.end_ids:
                self.finish_reason = "stop"
                break
            self.completion_tokens += 1
            if sampled is not None:
                self.sampled.append(sampled)
                sampled = None
            piece = text.piece(token)
            if thinking and not closing:
                thinking = not thinking_end.feed(piece)
            if constraint:
                constraint.take(token)
            elif later and constraint_start.feed(piece):
                constraint = later
            out = text.feed(piece)
            if out:
                yield out
            if text.stopped:
                self.finish_reason = "stop"
                self.stop_sequence = text.stop_sequence
                return
            if constraint and constraint.complete:
                self.finish_reason = "stop"
                break
            if self.completion_tokens >= options.max_tokens or self._evaluated >= self.context_length:
                self.finish_reason = "length"
                self.window_full = len(self.prompt) + self.completion_tokens >= self.context_length
                break
            if self.cancelled():
                raise Cancelled()
        tail = text.finish()
        if text.stopped:
            self.finish_reason = "stop"
            self.stop_sequence = text.stop_sequence
        if tail:
            yield tail
