"""What one gRPC worker's cache most likely holds: the prompts and replies this server sent it, newest last, within
a budget of tokens, found by the prompt cache's block hash chain (so at block boundaries, in a scope's own chain).
The cache-aware choice of a worker is the one that holds the longest prefix of a prompt."""

import collections
from typing import Optional, Sequence

from .prompt_cache.index import BLOCK, block_hashes, full_key, scope_seed


def prompt_hashes(tokens: Sequence[int], scope: str) -> list[bytes]:
    """A prompt's block hashes in the chain of its scope."""
    return block_hashes(tokens, scope_seed(scope))


class WorkerPrefixes:
    """Sequences by their key, least recently sent first, and how many of them reach each block hash. Its users
    hold the engine's lock while they use it."""

    def __init__(self, budget: int) -> None:
        self.budget = budget  # tokens remembered, counted by whole blocks
        self.blocks = 0
        self._sequences: collections.OrderedDict[bytes, list[bytes]] = collections.OrderedDict()
        self._reaching: collections.Counter[bytes] = collections.Counter()

    def add(self, tokens: Sequence[int], scope: str, replacing: Optional[bytes] = None) -> Optional[bytes]:
        """Remember ``tokens`` as sent most recently (in place of the sequence keyed ``replacing``, such as the
        prompt a reply continues); their key, or None if they are shorter than a block."""
        if replacing is not None:
            self._forget(replacing)
        hashes = prompt_hashes(tokens, scope)
        if not hashes:
            return None
        key = full_key(hashes, tokens)
        self._forget(key)
        self._sequences[key] = hashes
        self._reaching.update(hashes)
        self.blocks += len(hashes)
        while self.blocks * BLOCK > self.budget and len(self._sequences) > 1:
            self._forget(next(iter(self._sequences)))
        return key

    def longest(self, hashes: list[bytes]) -> int:
        """How many leading tokens of a prompt a remembered sequence begins with, given the prompt's ``hashes``
        (``prompt_hashes``): whole blocks. A sequence that reaches a block reaches every block before it."""
        low, high = 0, len(hashes)  # hashes[:low] are reached; hashes[high:] are not
        while low < high:
            middle = (low + high + 1) // 2
            if hashes[middle - 1] in self._reaching:
                low = middle
            else:
                high = middle - 1
        return low * BLOCK

    def clear(self) -> None:
        self._sequences.clear()
        self._reaching.clear()
        self.blocks = 0

    def _forget(self, key: bytes) -> None:
        hashes = self._sequences.pop(key, None)
        if hashes is None:
            return
        self._reaching.subtract(hashes)
        for block_hash in hashes:
            if self._reaching[block_hash] <= 0:
                del self._reaching[block_hash]
        self.blocks -= len(hashes)
