"""Speculative decoding's drafts: tokens a reply will likely go on with, which the model checks in one call.

The drafter is n-gram lookup over the prompt and the reply so far (prompt lookup decoding): of the earlier places
where the reply's last tokens occurred, the one that shares the longest run of tokens with the reply's end is
taken, and what followed it there is proposed. A reply that quotes or rewrites what the prompt holds (a file with
one change, a JSON document transformed, code quoted back) takes most of it; the longest match, not the latest,
finds the right line of a file whose lines look alike.
"""

import dataclasses
from typing import Sequence

KEY = 3  # tokens an earlier occurrence is looked up by
MIN_MATCH = 8  # tokens an occurrence must share with the text's end to be drafted from: shorter matches mislead
LONGEST = 64  # how far back a match is measured
CANDIDATES = 64  # the latest occurrences of the key compared
FIRST_LENGTH = 8  # a draft's length at first; it doubles while drafts are taken whole, and shrinks to what was taken


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
    """How a reply is drafted: at most ``n_max`` tokens a step; a draft of fewer than ``n_min`` is not checked."""

    n_max: int = 64
    n_min: int = 1


class NgramDrafter:
    """Drafts from the earlier occurrence of the text's end that matches it longest, among ``tokens`` and those
    added since."""

    def __init__(self, tokens: Sequence[int]) -> None:
        self.length = FIRST_LENGTH  # how long the next draft may be
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
        """How the last draft went: a draft taken whole is followed by one twice as long, another by one a token
        longer than what was taken (checking a token costs a good part of decoding one)."""
        self.length = self.length * 2 if taken == drafted else taken + 1

    def draft(self, limit: int) -> list[int]:
        """Up to ``limit`` tokens (and the length the last drafts earned) that followed the best match of the text's
        end: none if no earlier occurrence shares MIN_MATCH tokens with it."""
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
        if longest < MIN_MATCH:
            return []
        return tokens[best:best + min(limit, self.length)]
