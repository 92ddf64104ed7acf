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


class _Constraint:
    """A grammar's hold on the reply: from its first token, or (``after``) once the text has reached that tag."""

    def __init__(self, grammar: Optional[Grammar], after: str) -> None:
        self._later = grammar.constraint() if grammar else None
        self.active = None if after else self._later
        self._start = TagWatch(after)

    def allowed(self) -> Optional[np.ndarray]:
        """What the next token may be (None: any)."""
        return self.active.allowed() if self.active else None

    def take(self, token: int, piece: bytes) -> None:
        if self.active:
            self.active.take(token)
        elif self._later and self._start.feed(piece):
            self.active = self._later

    @property
    def complete(self) -> bool:
        return bool(self.active) and self.active.complete


class _ThinkingBudget:
    """Closes a reply that starts inside a thinking block after ``budget`` tokens, by forcing the closing tag's
    tokens (``closing``), unless the text closed it first."""

    def __init__(self, close: str, budget: Optional[int], closing: Callable[[], list[int]]) -> None:
        self.open = bool(close) and budget is not None
        self._budget = budget or 0
        self._end = TagWatch(close)
        self._closing = closing
        self._forcing: list[int] = []

    def forced(self, produced: int) -> Optional[int]:
        """The token the next pick must be, ``produced`` tokens into the reply (None: no such token)."""
        if self.open and not self._forcing and produced >= self._budget:
            self._forcing = self._closing()
        if not self._forcing:
            return None
        self.open = len(self._forcing) > 1
        return self._forcing.pop(0)

    def feed(self, piece: bytes) -> None:
        if self.open and not self._forcing:
            self.open = not self._end.feed(piece)


class _Picker:
    """Picks a reply's next token from the logits after the last one (the engine calls it right after its call):
    the sampler's draw among the ``allowed`` tokens, or the ``forced`` one, and no end token before ``min_tokens``
    (``produced`` so far); ``picked`` keeps its log probabilities, when the options ask for them."""

    def __init__(self, options: DecodeOptions, sampler: Sampler) -> None:
        self._options = options
        self._sampler = sampler
        self.allowed: Optional[np.ndarray] = None
        self.forced: Optional[int] = None
        self.produced = 0
        self.picked: Optional[SampledToken] = None

    def __call__(self, logits: np.ndarray) -> int:
        options = self._options
        mask = self.allowed
        if self.forced is not None:
            mask = np.zeros(len(logits), dtype=bool)
            mask[self.forced] = True
        elif self.produced < options.min_tokens and options.end_ids:
            mask = np.ones(len(logits), dtype=bool) if mask is None else mask.copy()
            mask[list(options.end_ids)] = False
        token = self._sampler.sample(logits, mask)
        if options.top_logprobs is not None and token not in options.end_ids:
            logprob, top = logprobs(logits, token, options.top_logprobs)
            self.picked = SampledToken(token, logprob, tuple(top))
        return token


class _DraftAndCheck:
    """Speculation's step: after a token, a draft of those to follow goes into the same engine call, and the next
    picks are made on its rows of logits, each kept while it is the drafted token; at the first that differs, the
    rest of the draft leaves the cache. The slot's draft model drafts, if it has one, following the prompt (unless
    the prompt holds an image, which it cannot read); else n-gram lookup in it. A draft model's slot holds no other
    cache scope's text (what it reuses would show in how fast a reply comes)."""

    def __init__(self, generation: "Generation", speculation: Speculation) -> None:
        self._generation = generation
        self._speculation = speculation
        slot = generation.slot
        if slot.draft is None or min(generation.prompt, default=0) < 0:
            self.drafter: Union[NgramDrafter, ModelDrafter] = NgramDrafter(generation.prompt, slot.draft_costs)
        else:
            slot.draft.slot.enter(slot.scope)
            self.drafter = ModelDrafter(generation.prompt, slot.draft_costs, slot.draft, speculation.p_min,
                                        generation.cancelled)
        self._draft: list[int] = []  # drafted tokens in the cache, after the token before them
        self._rows: Optional[np.ndarray] = None  # the logits after that token and after each drafted one
        self._checked = 0  # drafted tokens taken so far

    def next(self, previous: int, pick: Callable[[np.ndarray], int]) -> int:
        """The token after ``previous``: on a checked draft's row, or decoded with a new draft after it, or alone."""
        slot, drafter = self._generation.slot, self.drafter
        if self._rows is None:
            self._draft = self._drafted()
            if self._draft:
                started = time.perf_counter()
                self._rows, self._checked = slot.decode_each([previous, *self._draft]), 0
                drafter.costs.record(len(self._draft) + 1, time.perf_counter() - started)
        if self._rows is None:
            started = time.perf_counter()
            token = slot.decode([previous], pick)
            drafter.costs.record(1, time.perf_counter() - started)
            return token
        token = pick(self._rows[self._checked])
        if self._checked < len(self._draft) and token == self._draft[self._checked]:
            self._checked += 1  # in the cache already: the next pick is on the next row
            self._generation.drafting.took(self._checked)
        else:
            if self._checked < len(self._draft):
                slot.truncate(len(slot.cached) - (len(self._draft) - self._checked))
            drafter.checked(len(self._draft), self._checked)
            self._rows = None
        return token

    def _drafted(self) -> list[int]:
        """A draft to check after the last token picked: no longer than the reply or the context has room for."""
        generation, speculation = self._generation, self._speculation
        room = min(speculation.n_max, generation.options.max_tokens - generation.completion_tokens,
                   generation.context_length - generation.evaluated - 1)
        draft = self.drafter.draft(room, speculation.n_min) if room > 0 else []
        if draft:
            generation.drafting.drafts += 1
            generation.drafting.drafted += len(draft)
        return draft


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
    def evaluated(self) -> int:
        """Where the last token picked goes in the cache once decoded: the prompt, then every token picked before it
        (drafted ones the cache holds beyond it do not count)."""
        return len(self.prompt) + self.completion_tokens - 1

    def reuse(self) -> None:
        """Decide how much of the prompt the slot's cache serves (``cached_tokens``, ``cache_written``), before
        anything is evaluated; iterating does it if it was not done."""
        self.cached_tokens = self.slot.reuse(self.prompt, self.save_at)
        self.cache_written = self.slot.cache_written
        self._reused = True

    def __iter__(self) -> Iterator[str]:
        """Prefill, then per token: pick it (drafting and checking ahead, with speculation), turn it into text,
        and stop where the options say."""
        options, slot = self.options, self.slot
        self._prefill()
        if options.max_tokens <= 0:  # the prompt evaluated into the cache, and nothing generated
            self.finish_reason = "length"
            return
        pick = _Picker(options, Sampler(options.sampling, self.prompt, self.choice))
        constraint = _Constraint(options.grammar, options.constrain_after)
        thinking = _ThinkingBudget(options.thinking_close, options.thinking_budget,
                                   lambda: self._tokens_of(options.thinking_close))
        speculating = _DraftAndCheck(self, options.speculation) if options.speculation else None
        text = ReplyText(self.tokenizer, options)
        token: Optional[int] = None
        while True:
            pick.allowed, pick.forced = constraint.allowed(), thinking.forced(self.completion_tokens)
            pick.produced = self.completion_tokens
            if token is None:
                token = pick(slot.logits())
            elif speculating is not None:
                token = speculating.next(token, pick)
            else:
                token = slot.decode([token], pick)
            if speculating is not None:
                speculating.drafter.add(token)
            if not self._took(token, pick):
                break
            piece = text.piece(token)
            thinking.feed(piece)
            constraint.take(token, piece)
            out = text.feed(piece)
            if out:
                yield out
            if text.stopped:
                self._stopped(text)
                return
            if self._ended(constraint):
                break
            if self.cancelled():
                raise Cancelled()
        tail = text.finish()
        if text.stopped:
            self._stopped(text)
        if tail:
            yield tail

    def _prefill(self) -> None:
        """The prompt into the slot's cache, past what the cache served."""
        if not self._reused:
            self.reuse()
        self.slot.evaluate(self.prompt, self.cancelled)

    def _took(self, token: int, pick: _Picker) -> bool:
        """Count a picked token into the reply; False if it is an end token, which ends it."""
        if self.options.token_ids:  # an end token's too, as llama-server reports them
            self.token_ids.append(token)
        if token in self.options.end_ids:
            self.finish_reason = "stop"
            return False
        self.completion_tokens += 1
        if pick.picked is not None:
            self.sampled.append(pick.picked)
            pick.picked = None
        return True

    def _ended(self, constraint: _Constraint) -> bool:
        """Whether the reply ends after its last token: its grammar complete, or no room left."""
        if constraint.complete:
            self.finish_reason = "stop"
            return True
        if self.completion_tokens >= self.options.max_tokens or self.evaluated >= self.context_length:
            self.finish_reason = "length"
            self.window_full = len(self.prompt) + self.completion_tokens >= self.context_length
            return True
        return False

    def _stopped(self, text: ReplyText) -> None:
        self.finish_reason = "stop"
        self.stop_sequence = text.stop_sequence
