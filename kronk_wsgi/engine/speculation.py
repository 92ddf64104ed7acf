"""Speculative decoding's drafts: tokens a reply will likely go on with, which the model checks in one call.

The drafter is n-gram lookup over the prompt and the reply so far (prompt lookup decoding): where the reply's last
few tokens occurred before, the tokens that followed them then are proposed. A reply that quotes or rewrites what
the prompt holds (a file with one change, a JSON document transformed, code quoted back) takes most of them.
"""

import dataclasses
from typing import Sequence

SIZES = (4, 3)  # the n-grams looked up, longest first: a longer match predicts better (two tokens recur too often)
FIRST_LENGTH = 4  # a draft's length at first; it doubles while drafts are taken whole, and shrinks to what was taken


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
        if len(self.accepted_at) < place:
            self.accepted_at.append(0)
        self.accepted_at[place - 1] += 1

    def add(self, other: "Drafting") -> None:
        self.drafts += other.drafts
        self.drafted += other.drafted
        self.accepted += other.accepted
        for place, count in enumerate(other.accepted_at, 1):
            if len(self.accepted_at) < place:
                self.accepted_at.append(0)
            self.accepted_at[place - 1] += count


@dataclasses.dataclass(frozen=True)
class Speculation:
    """How a reply is drafted: at most ``n_max`` tokens a step; a draft of fewer than ``n_min`` is not checked."""

    n_max: int = 16
    n_min: int = 1


class NgramDrafter:
    """Drafts from the latest earlier occurrence of the last few tokens, among ``tokens`` and those added since."""

    def __init__(self, tokens: Sequence[int]) -> None:
        self.length = FIRST_LENGTH  # how long the next draft may be
        self._tokens: list[int] = []
        self._seen: dict[int, dict[tuple[int, ...], int]] = {size: {} for size in SIZES}
        for token in tokens:
            self.add(token)

    def add(self, token: int) -> None:
        """The next token of the text; the n-grams it ends the continuation of become findable."""
        tokens = self._tokens
        tokens.append(token)
        end = len(tokens) - 1  # the n-grams that end before it now have a continuation
        for size, seen in self._seen.items():
            if end >= size:
                seen[tuple(tokens[end - size:end])] = end

    def checked(self, drafted: int, taken: int) -> None:
        """How the last draft went: a draft taken whole is followed by one twice as long, another by one a token
        longer than what was taken (checking a token costs a good part of decoding one)."""
        self.length = self.length * 2 if taken == drafted else taken + 1

    def draft(self, limit: int) -> list[int]:
        """Up to ``limit`` tokens (and the length the last drafts earned) that followed the longest n-gram ending
        the text, where it last occurred before."""
        limit = min(limit, self.length)
        tokens = self._tokens
        for size, seen in self._seen.items():
            if len(tokens) <= size:
                continue
            start = seen.get(tuple(tokens[-size:]))
            if start is not None:
                return tokens[start:start + limit]
        return []
