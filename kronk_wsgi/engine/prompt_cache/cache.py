"""The prompt cache: the two tiers looked up as one, and what it did counted."""

import collections
import dataclasses
import hashlib
from pathlib import Path
from typing import Optional, Sequence

from gevent import monkey

from .disk import DiskTier, Problems
from .index import BLOCK, MIN_TOKENS, BlockIndex, Entry, block_hashes, full_key, scope_seed, shared_prefix
from .ram import RamTier

_allocate_lock = monkey.get_original("_thread", "allocate_lock")
_sleep = monkey.get_original("time", "sleep")

PENDING_POLL_SECONDS = 0.02  # how often a prompt looks for an announced state
KEYS_REMEMBERED = 1024  # cache keys whose last prompt is remembered, least recently used first out


@dataclasses.dataclass
class CacheCounts:
    """What the cache did since the last ``take_counts``, and what it holds now."""

    hits: int = 0
    misses: int = 0
    restored_tokens: int = 0
    saved: int = 0
    evicted_ram: int = 0
    evicted_disk: int = 0
    corrupt: int = 0  # disk files that did not read as valid entries: skipped or removed
    ram_bytes: int = 0
    disk_bytes: int = 0
    problems: list[str] = dataclasses.field(default_factory=list)  # what was wrong with them, each file once


# The counts that only grow (take_counts reports how much they grew).
_GROWING = ("hits", "misses", "restored_tokens", "saved", "evicted_ram", "evicted_disk", "corrupt")


class PromptCache:
    """Sequence states of one model identity, in RAM (``ram_bytes``) and on disk (``disk_dir``, ``disk_bytes`` for
    the whole directory, every identity's entries together)."""

    def __init__(self, identity: str, ram_bytes: int, disk_dir: Optional[Path], disk_bytes: int) -> None:
        self._lock = _allocate_lock()  # guards both indexes and the counts
        self._problems = Problems()
        self.ram = RamTier(ram_bytes)
        self.disk: Optional[DiskTier] = None
        if disk_dir is not None and disk_bytes > 0:
            try:
                self.disk = DiskTier(disk_dir, hashlib.sha256(identity.encode()).digest(), disk_bytes, self._lock,
                                     self._problems)
            except OSError as exc:  # the directory cannot be trusted or used: RAM only
                self._problems.report(str(disk_dir), f"the disk tier is off: {exc}", count=False)
        self._key_prompts: collections.OrderedDict[tuple[bytes, str], list[bytes]] = collections.OrderedDict()
        self._unwritten: list[tuple[bytes, Entry]] = []  # saved while a prompt waited, not on disk yet
        self._counts = CacheCounts()  # of this class's own doing, since the start
        self._taken = CacheCounts()  # as take_counts last read them

    @property
    def disk_dir(self) -> Optional[Path]:
        """This identity's folder of the disk tier, if it has one."""
        return self.disk.directory if self.disk is not None else None

    def _indexes(self) -> tuple[BlockIndex, ...]:
        """The tiers' indexes, RAM first."""
        return (self.ram.index,) if self.disk is None else (self.ram.index, self.disk.index)

    # -- looking up ---------------------------------------------------------------------------------------------

    def find(self, tokens: Sequence[int], scope: str = "", better_than: int = 0, whole: bool = False
             ) -> Optional[tuple[int, tuple[int, ...], bytes]]:
        """The saved state sharing the longest block-aligned prefix with ``tokens`` in ``scope``, if it serves more
        than ``better_than`` of them (what the slot holds already; at least the last token is evaluated): how many
        tokens it shares, the tokens it holds (it may hold more), and the state. A disk entry read comes into RAM
        too. If the longest is an announced entry, waits for its state (while its announcement is young). With
        ``whole``, only a state the prompt continues all of (a sliding-window cache's). Only a state returned
        counts as a hit."""
        hashes = block_hashes(tokens, scope_seed(scope))
        while True:
            if self.disk is not None:
                self.disk.scan()
            with self._lock:
                candidates = self._candidates(tokens, hashes, better_than, whole)
            for shared, key, entry in candidates:
                if entry.pending:
                    if self.disk.announcement_alive(key, entry):
                        break  # its state is on the way: wait for it
                    continue
                state = entry.state if entry.state is not None else self.disk.read(key, entry)
                if state is None:
                    continue
                with self._lock:
                    self.ram.hold(key, Entry(entry.tokens, state, hashes=entry.hashes, seed=entry.seed))
                    self._counts.hits += 1
                    self._counts.restored_tokens += shared
                return shared, entry.tokens, state
            else:
                with self._lock:
                    self._counts.misses += 1
                return None
            _sleep(PENDING_POLL_SECONDS)

    def _candidates(self, tokens: Sequence[int], hashes: list[bytes], better_than: int, whole: bool
                    ) -> list[tuple[int, bytes, Entry]]:
        """The entries that may serve ``tokens``, best first (RAM first of equals): how many tokens each shares,
        its key, the entry."""
        candidates, seen = [], set()
        # An entry found at a block count shares less than one block more: fewer blocks cannot serve more.
        for blocks in range(len(hashes), max(0, better_than // BLOCK - 1), -1):
            found = [(key, entry) for index in self._indexes() for key, entry in index.at(hashes[blocks - 1])
                     if key not in seen]
            for shared, key, entry in sorted(((shared_prefix(tokens, e.tokens), k, e) for k, e in found),
                                             key=lambda candidate: -candidate[0]):
                seen.add(key)
                if shared < blocks * BLOCK or min(shared, len(tokens) - 1) <= better_than:  # a collision, or no gain
                    continue
                if whole and (shared < len(entry.tokens) or shared >= len(tokens)):  # not continued all of
                    continue
                candidates.append((shared, key, entry))
        return candidates

    def holds(self, tokens: Sequence[int], scope: str = "") -> bool:
        """Whether these very tokens are saved already, in ``scope``."""
        hashes = block_hashes(tokens, scope_seed(scope))
        if not hashes:
            return False
        key = full_key(hashes, tokens)
        with self._lock:
            return key in self.ram.index or (self.disk is not None and self.disk.holds(key))

    def covers(self, tokens: Sequence[int], scope: str = "", within: int = 0) -> bool:
        """Whether a saved state (not an announced one) holds these tokens, or continues them by at most
        ``within`` tokens, in ``scope``: an engine that can cut a restored sequence back serves them from it."""
        hashes = block_hashes(tokens, scope_seed(scope))
        if not hashes:
            return False
        with self._lock:
            found = [entry for index in self._indexes() for _, entry in index.at(hashes[-1]) if not entry.pending]
        return any(len(tokens) <= len(e.tokens) <= len(tokens) + within and shared_prefix(tokens, e.tokens) == len(tokens)
                   for e in found)

    def key_branch(self, key: str, tokens: Sequence[int], scope: str = "") -> int:
        """Where ``tokens`` leave the last prompt sent with the same cache key (a client's prompt_cache_key) in
        ``scope``, at a block boundary; 0 if they continue it or share no block with it. Requests that share a key
        share a prefix: that is where it is worth saving."""
        seed = scope_seed(scope)
        hashes = block_hashes(tokens, seed)
        with self._lock:
            last = self._key_prompts.pop((seed, key), [])
            self._key_prompts[seed, key] = hashes
            while len(self._key_prompts) > KEYS_REMEMBERED:
                self._key_prompts.popitem(last=False)
        shared = next((i for i, (a, b) in enumerate(zip(hashes, last)) if a != b), min(len(hashes), len(last)))
        return shared * BLOCK if shared < len(last) else 0

    # -- saving ---------------------------------------------------------------------------------------------

    def announce(self, tokens: Sequence[int], scope: str = "") -> None:
        """Say on disk that the state of ``tokens`` is about to be saved (``put``), so that a prompt continuing
        them in another process waits for it."""
        if self.disk is None or len(tokens) < MIN_TOKENS or self.holds(tokens, scope):
            return
        entry = Entry(tuple(tokens), None, seed=scope_seed(scope))
        self.disk.announce(full_key(entry.hashes, tokens), entry)

    def put(self, tokens: Sequence[int], state: bytes, defer_disk: bool = False, scope: str = "") -> None:
        """Keep a sequence's state, in RAM and on disk, each within its budget. With ``defer_disk`` (a prompt
        is waiting) the disk write waits for ``write_deferred``."""
        if len(tokens) < MIN_TOKENS:
            return
        entry = Entry(tuple(tokens), state, seed=scope_seed(scope))
        key = full_key(entry.hashes, tokens)
        written = self.disk is not None and len(state) <= self.disk.budget
        with self._lock:
            self._counts.saved += 1
            self.ram.hold(key, entry)
            if written:
                self._unwritten.append((key, entry))
        if self.disk is not None and not written:
            self.disk.withdraw(key)  # announced, but never written
        if not defer_disk:
            self.write_deferred()

    def withdraw(self, tokens: Sequence[int], scope: str = "") -> None:
        """Take back an announcement whose state could not be saved."""
        if self.disk is not None and len(tokens) >= MIN_TOKENS:
            self.disk.withdraw(full_key(block_hashes(tokens, scope_seed(scope)), tokens))

    def write_deferred(self) -> None:
        """Write the entries whose disk write was deferred."""
        with self._lock:
            unwritten, self._unwritten = self._unwritten, []
        for key, entry in unwritten:
            self.disk.write(key, entry)

    def clear_ram(self) -> None:
        """Drop every state held in RAM (a gateway's flush); the disk tier keeps its files."""
        with self._lock:
            self.ram.clear()

    # -- counting -----------------------------------------------------------------------------------------------

    def take_counts(self) -> CacheCounts:
        """The counts since the last call, with the bytes held now (for one caller, the event loop: it takes no
        lock; the counts only grow, written under the locks by the threads)."""
        now = dataclasses.replace(self._counts, evicted_ram=self.ram.evicted, corrupt=self._problems.corrupt,
                                  evicted_disk=self.disk.evicted if self.disk is not None else 0)
        counts = CacheCounts(**{name: getattr(now, name) - getattr(self._taken, name) for name in _GROWING})
        self._taken = now
        counts.problems = self._problems.take()
        counts.ram_bytes, counts.disk_bytes = self.held()
        return counts

    def held(self) -> tuple[int, int]:
        """Bytes held in RAM, and on disk (of the entries this process knows of), without a lock or a file looked
        at."""
        return self.ram.held, self.disk.held() if self.disk is not None else 0
