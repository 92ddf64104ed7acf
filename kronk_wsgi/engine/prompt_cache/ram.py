"""The RAM tier: the most recently used states, within a byte budget."""

from .index import BlockIndex, Entry


class RamTier:
    """States held in memory, least recently used first out. Its caller holds the cache's lock, except to read
    ``held`` (an int, read at once)."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.index = BlockIndex()
        self.held = 0  # bytes of the states held
        self.evicted = 0  # states let go for the budget, or cleared, since the start

    def hold(self, key: bytes, entry: Entry) -> None:
        """Keep ``entry`` as the most recently used, letting the least recently used go to stay within budget; a
        state larger than the whole budget is not kept."""
        if len(entry.state) > self.budget:
            return
        replaced = self.index.get(key)
        self.held -= len(replaced.state) if replaced is not None else 0
        self.index.add(key, entry)
        self.held += len(entry.state)
        while self.held > self.budget:
            self.held -= len(self.index.remove(self.index.oldest()).state)
            self.evicted += 1

    def clear(self) -> None:
        self.evicted += len(self.index)
        self.index.clear()
        self.held = 0
