"""Speculative decoding's drafts: tokens a reply will likely go on with, which the model checks in one call.

Two drafters propose them. ``NgramDrafter`` looks the text's end up in the prompt and the reply so far (prompt
lookup decoding): of the earlier places where the reply's last tokens occurred, the one that shares the longest run
of tokens with the reply's end is taken, and what followed it there is proposed. A reply that quotes or rewrites
what the prompt holds (a file with one change, a JSON document transformed, code quoted back) takes most of it; the
longest match, not the latest, finds the right line of a file whose lines look alike. ``ModelDrafter`` asks a draft
model: a smaller model of the same vocabulary, on a slot of its own that follows the text, proposes its most likely
next tokens one after another.

How much is drafted is a bet: checking k drafted tokens costs a call of k + 1 rows, which on a CPU costs a good
part of decoding k + 1 tokens one by one, and pays only for the tokens taken. Each drafter weighs what it expects
taken against what calls of that size have cost on the slot (DraftCosts): the n-gram drafter by the share of its
drafts the reply has taken so far, the draft model by its own confidence. Where no length pays (a model whose rows
cost nearly a token each, a reply that strays from what it could copy), nothing is drafted.
"""

import collections
import dataclasses
import statistics
import time
from typing import Callable, Optional, Sequence

import numpy as np

from .base import Cancelled, DraftSlot
from .tokenizer import GGUFTokenizer

KEY = 3  # tokens an earlier occurrence is looked up by
MIN_MATCH = 8  # tokens an occurrence must share with the text's end to be drafted from: shorter matches mislead
LONGEST = 64  # how far back a match is measured
CANDIDATES = 64  # the latest occurrences of the key compared
LONG_MATCH = 32  # a match this long is counted apart: a reply copying a stretch of text takes its drafts more often
ROW_COST = 0.5  # what a call's row beyond the first costs, as a share of a call of one row, until measured
TAKEN, MISSED = 3, 1  # drafted tokens counted as taken and missed before a reply has any: a rate of 0.75
MEASURES = 7  # the latest measures of a call size whose median is its cost (a machine's hiccups stand out)
EXPLORE = 16  # every so many drafts that do not pay, one is checked anyway: costs are measured again
VOCABULARY_SLACK = 128  # tokens a draft model's vocabulary may have more or fewer of (padded sizes differ)
DRAFT_CALL_COST = 0.25  # what a draft model's call of one row costs, as a share of the target's, until measured
REST_MAX = 8  # the most steps a draft model rests after drafting nothing


class DraftCosts:
    """What decode calls cost on one slot, measured as they run: the median of the latest calls of one row, and of
    each row beyond the first in calls of 2-3, 4-7, 8-15, ... rows, as a share of the first. A size not measured
    yet is taken to cost a row what the nearest measured size does (the next smaller one first), or ROW_COST."""

    def __init__(self) -> None:
        self._single: collections.deque[float] = collections.deque(maxlen=MEASURES)  # seconds
        self._per_row: dict[int, collections.deque[float]] = {}  # by the rows' bit length: shares of one row
        self._shares: dict[int, float] = {}  # each size's share as last found (a draft asks for up to 64 lengths)

    def record(self, rows: int, seconds: float) -> None:
        if rows == 1:
            self._single.append(seconds)
        elif self._single:
            single = statistics.median(self._single)
            share = max(0.0, seconds - single) / (rows - 1) / single
            self._per_row.setdefault(rows.bit_length(), collections.deque(maxlen=MEASURES)).append(share)
            self._shares.clear()

    def single(self) -> Optional[float]:
        """What a call of one row costs, in seconds (None: not measured yet)."""
        return statistics.median(self._single) if self._single else None

    def relative(self, rows: int, measured: bool = True) -> float:
        """What a call of ``rows`` costs, as calls of one row (not ``measured``: as priced before any measure)."""
        return 1 + (self._share(rows.bit_length()) if measured and self._per_row else ROW_COST) * (rows - 1)

    def _share(self, size: int) -> float:
        """A row's share of a call of one row in calls of ``size`` (a bit length), as measured for it or the
        nearest size."""
        share = self._shares.get(size)
        if share is None:
            nearest = min(self._per_row, key=lambda known: (known > size, abs(known - size)))
            share = self._shares[size] = statistics.median(self._per_row[nearest])
        return share


@dataclasses.dataclass
class Drafting:
    """How speculation went: drafts checked, tokens drafted, tokens taken, and taken by place in their draft."""

    drafts: int = 0
    drafted: int = 0
    accepted: int = 0
    accepted_at: list[int] = dataclasses.field(default_factory=list)

    def took(self, place: int) -> None:
        """A drafted token was taken, the ``place``-th of its draft (from 1)."""
        self.accepted += 1
        self._count_at(place, 1)

    def add(self, other: "Drafting") -> None:
        self.drafts += other.drafts
        self.drafted += other.drafted
        self.accepted += other.accepted
        for place, count in enumerate(other.accepted_at, 1):
            self._count_at(place, count)

    def _count_at(self, place: int, count: int) -> None:
        self.accepted_at.extend([0] * (place - len(self.accepted_at)))
        self.accepted_at[place - 1] += count


@dataclasses.dataclass(frozen=True)
class Speculation:
    """How a reply is drafted: at most ``n_max`` tokens a step, as many as pay; at least ``n_min`` wherever a match
    (or the draft model) offers that many, paying or not (llama-server drafts without weighing costs), and never
    fewer. A draft model's drafts stop at a token it gives less than ``p_min`` of its probability."""

    n_max: int = 64
    n_min: int = 0
    p_min: float = 0.0


class NgramDrafter:
    """Drafts from the earlier occurrence of the text's end that matches it longest, among ``tokens`` and those
    added since, as much of what followed it as pays by ``costs``."""

    def __init__(self, tokens: Sequence[int], costs: Optional[DraftCosts] = None) -> None:
        self.costs = costs or DraftCosts()
        # drafted tokens taken, and drafts not taken whole, after matches shorter than LONG_MATCH and after longer
        self._taken, self._missed = [TAKEN, TAKEN], [MISSED, MISSED]
        self._long = 0  # which of those the last match was
        self._declined = 0  # drafts found that did not pay
        self._tokens: list[int] = []
        self._seen: dict[tuple[int, ...], list[int]] = {}  # each key's occurrences, by where their continuation starts
        for token in tokens:
            self.add(token)

    def add(self, token: int) -> None:
        """The next token of the text; the key it ends the continuation of becomes findable there."""
        tokens = self._tokens
        tokens.append(token)
        end = len(tokens) - 1
        if end >= KEY:
            self._seen.setdefault(tuple(tokens[end - KEY:end]), []).append(end)

    def checked(self, drafted: int, taken: int) -> None:
        """How the last draft went: of ``drafted`` tokens, the first ``taken`` were taken."""
        self._taken[self._long] += taken
        self._missed[self._long] += taken < drafted

    def paying_length(self, available: int) -> int:
        """How many of ``available`` drafted tokens to check: the length with the most tokens expected per unit of
        cost (a token is taken with the rate so far after matches as long as the last, if the one before it was), 0
        if none beats decoding one. Every
        EXPLORE-th time none does, the length that would pay at the costs assumed before any measure: a size
        measured once at a bad moment is measured again."""
        best = self._best(available, measured=True)
        if not best:
            self._declined += 1
            if self._declined % EXPLORE == 0:
                return self._best(available, measured=False)
        return best

    def _best(self, available: int, measured: bool) -> int:
        rate = self._taken[self._long] / (self._taken[self._long] + self._missed[self._long])
        best, value, expected, chance = 0, 1.0, 0.0, 1.0
        for length in range(1, available + 1):
            chance *= rate
            expected += chance
            tokens_per_cost = (1 + expected) / self.costs.relative(length + 1, measured)
            if tokens_per_cost > value:
                best, value = length, tokens_per_cost
        return best

    def draft(self, limit: int, least: int = 0) -> list[int]:
        """Up to ``limit`` tokens that followed the best match of the text's end, as many as pay and at least
        ``least``: none if no earlier occurrence shares MIN_MATCH tokens with it, or fewer follow it."""
        tokens = self._tokens
        size = len(tokens)
        found = self._seen.get(tuple(tokens[-KEY:])) if size > KEY else None
        best, longest = 0, 0
        for start in reversed((found or [])[-CANDIDATES:]):
            shared = KEY
            while shared < LONGEST and start - shared > 0 and tokens[start - shared - 1] == tokens[size - shared - 1]:
                shared += 1
            if shared > longest:
                best, longest = start, shared
                if longest == LONGEST:
                    break
        following = tokens[best:best + limit]
        if min(following, default=0) < 0:  # an image's placeholders (negative ids) are never drafted
            following = following[:next(i for i, token in enumerate(following) if token < 0)]
        if longest < MIN_MATCH or len(following) < max(least, 1):
            return []
        self._long = int(longest >= LONG_MATCH)
        return following[:max(least, self.paying_length(len(following)))]


class ModelDrafter:
    """Drafts with a draft model on its own slot: from the text (``tokens`` and those added since), its most likely
    next token, then the next after that, as long as each pays by ``costs``.

    The slot follows the text as a slot follows its prompts: what it holds of it is reused, and what a draft added
    that the reply did not take is cut off. A drafted token pays while the draft model's chance that every drafted
    token so far is taken (the product of its probabilities) beats what drafting and checking one more costs: a
    draft model's call and a checked row, as shares of a call of one row on the target. A draft model that costs
    too much for even a sure token to pay is not asked (every EXPLORE-th time it is, to measure again); after a
    step it drafted nothing, it rests 1, 2, 4 ... up to REST_MAX steps, which it then catches up in one call. The
    draft is greedy, so the target's pick-and-compare keeps its distribution (standard speculative sampling with a
    one-hot proposal)."""

    def __init__(self, tokens: Sequence[int], costs: DraftCosts, draft: DraftSlot, p_min: float = 0.0,
                 cancelled: Callable[[], bool] = lambda: False) -> None:
        self.costs = costs
        self._slot = draft.slot
        self._vocabulary = draft.vocabulary
        self._p_min = p_min
        self._cancelled = cancelled
        self._tokens: list[int] = []
        self._known = True  # every token of the text is one the draft model has
        self._calls: collections.deque[float] = collections.deque(maxlen=MEASURES)  # seconds of calls of one row
        self._declined = 0  # steps where even a sure token would not have paid
        self._rest = self._resting = 0  # steps to rest after a step that drafted nothing, and those left
        for token in tokens:
            self.add(token)

    def add(self, token: int) -> None:
        self._tokens.append(token)
        self._known = self._known and token < self._vocabulary

    def checked(self, drafted: int, taken: int) -> None:
        """Nothing to learn: the draft model's probabilities say how far it goes."""

    def draft(self, limit: int, least: int = 0) -> list[int]:
        """Up to ``limit`` tokens, at least ``least``, as many as pay and none given less than ``p_min`` of the draft
        model's probability (none if fewer than ``least`` are above it); none once the text has a token the draft
        model lacks."""
        if not self._known:
            return []
        if not least:
            if self._resting:
                self._resting -= 1
                return []
            if self._call_cost() + self.costs.relative(2) - 1 >= 1:  # a sure token would not pay
                self._declined += 1
                if self._declined % EXPLORE:
                    return []
        drafted = self._draft(limit, least)
        self._rest = 0 if drafted else min(2 * self._rest or 1, REST_MAX)
        self._resting = self._rest
        return drafted

    def _call_cost(self) -> float:
        """A draft model's call of one row, as a share of the target's."""
        single = self.costs.single()
        return statistics.median(self._calls) / single if self._calls and single else DRAFT_CALL_COST

    def _draft(self, limit: int, least: int) -> list[int]:
        slot = self._slot
        slot.prefill(self._tokens, self._cancelled)  # past what it holds: the reply's tokens since, or a new prompt
        logits = slot.logits()
        call_cost = self._call_cost()
        draft: list[int] = []
        chance = 1.0
        while True:
            token = int(np.argmax(logits))
            probability = 1 / float(np.sum(np.exp(logits - logits[token])))
            chance *= probability
            if token >= self._vocabulary or probability < self._p_min:  # all it offers
                return draft if len(draft) >= least else []
            rows = len(draft) + 2
            if len(draft) >= least and chance <= call_cost + self.costs.relative(rows) - self.costs.relative(rows - 1):
                return draft
            draft.append(token)
            if len(draft) >= limit:
                return draft
            if self._cancelled():
                raise Cancelled()
            started = time.perf_counter()
            slot.decode([token])
            self._calls.append(time.perf_counter() - started)
            logits = slot.logits()


def shared_vocabulary(target: GGUFTokenizer, draft: GGUFTokenizer) -> int:
    """How many token ids two models share (a draft model drafts those only), as llama-server checks them: the same
    kind of vocabulary, the same BOS and EOS as each adds them, sizes within VOCABULARY_SLACK, and the same text for
    every id both have past the first five. ValueError saying what differs."""
    if target.kind != draft.kind:
        raise ValueError(f"its vocabulary is of another kind ({draft.kind}, not {target.kind})")

    def added(tokenizer: GGUFTokenizer, name: str) -> tuple[bool, Optional[int]]:
        """Whether the vocabulary adds its BOS (or EOS) token, and which token it adds."""
        adds = getattr(tokenizer, f"add_{name}")
        return adds, getattr(tokenizer, f"{name}_id") if adds else None

    for name in ("bos", "eos"):
        if added(target, name) != added(draft, name):
            raise ValueError(f"its {name.upper()} token differs")
    if abs(target.vocab_size - draft.vocab_size) > VOCABULARY_SLACK:
        raise ValueError(f"its vocabulary has {draft.vocab_size} tokens, not about {target.vocab_size}")
    shared = min(target.vocab_size, draft.vocab_size)
    differs = next((i for i in range(5, shared) if target.texts[i] != draft.texts[i]), None)
    if differs is not None:
        raise ValueError(f"its token {differs} is {draft.texts[differs]!r}, not {target.texts[differs]!r}")
    return shared
