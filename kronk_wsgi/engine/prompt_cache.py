"""Saved sequence states, in RAM and on disk: a conversation that comes back after its slot went to another one
restores its history instead of evaluating it again.

An entry is the KV state of one token sequence, as the engine saves it when a
slot is about to be overwritten. Entries are found by a hash chain over
blocks of BLOCK tokens: each block boundary of an entry is indexed, so the
longest cached prefix of a prompt is found in one pass over the prompt's
blocks. RAM holds the most recently used entries within its budget; the disk
tier (a directory shared by every worker of a server, and by servers pointed
at it) keeps them across unloads and restarts, within its own budget, least
recently used first out. A disk entry is written to a temporary file and
renamed, with a checksum over all of it: a crash mid-write leaves nothing that
reads as valid. Every entry belongs to one identity (the model file, the
engine's version and its context parameters): another identity's entries are
never looked at.

Slot threads call it at once: one lock (a real one, not gevent's) guards it. A slot saves its state once its
answer is out (the client does not wait for it), and the disk write is done before the slot is given back.
"""

import collections
import dataclasses
import hashlib
import os
import struct
import time
import uuid
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
from gevent import monkey

_allocate_lock = monkey.get_original("_thread", "allocate_lock")

BLOCK = 64  # tokens per hashed block: entries are found at block boundaries
MIN_TOKENS = BLOCK  # shorter sequences are not worth saving
MAGIC = b"KRONKKV1"
STALE_PARTIAL_SECONDS = 600
SUFFIX = ".kv"
KEYS_REMEMBERED = 1024  # cache keys whose last prompt is remembered, least recently used first out


def block_hashes(tokens: Sequence[int]) -> list[bytes]:
    """The chain hash at each block boundary: the i-th covers tokens[:BLOCK * (i + 1)]."""
    data = np.asarray(tokens, dtype="<i4").tobytes()
    hashes, previous = [], b""
    for start in range(0, len(tokens) - len(tokens) % BLOCK, BLOCK):
        previous = hashlib.blake2b(previous + data[4 * start:4 * (start + BLOCK)], digest_size=16).digest()
        hashes.append(previous)
    return hashes


@dataclasses.dataclass
class CacheCounts:
    """What the cache did since the last ``take_counts``, and what it holds now."""

    hits: int = 0
    misses: int = 0
    restored_tokens: int = 0
    saved: int = 0
    evicted_ram: int = 0
    evicted_disk: int = 0
    corrupt: int = 0  # disk entries that did not read as valid: ignored and removed
    ram_bytes: int = 0
    disk_bytes: int = 0


class Entry:
    """A saved state, the tokens it holds and their block hashes; ``state`` is None for a disk entry (read when it
    is used)."""

    def __init__(self, tokens: tuple[int, ...], state: Optional[bytes], path: Optional[Path] = None,
                 hashes: Optional[list[bytes]] = None) -> None:
        self.tokens = tokens
        self.state = state
        self.path = path
        self.hashes = block_hashes(tokens) if hashes is None else hashes


class PromptCache:
    """Sequence states of one model identity, in RAM (``ram_bytes``) and on disk (``disk_dir``, ``disk_bytes``)."""

    def __init__(self, identity: str, ram_bytes: int, disk_dir: Optional[Path], disk_bytes: int) -> None:
        self.identity = hashlib.sha256(identity.encode()).digest()
        self.ram_bytes = ram_bytes
        self.disk_dir = disk_dir / self.identity.hex()[:16] if disk_dir is not None and disk_bytes > 0 else None
        self.disk_bytes = disk_bytes
        self._ram: collections.OrderedDict[bytes, Entry] = collections.OrderedDict()  # by full hash, LRU first
        self._index: dict[bytes, bytes] = {}  # block hash -> full hash of an entry in RAM that has that prefix
        self._disk: dict[bytes, Entry] = {}  # full hash -> disk entry (tokens read, state not)
        self._disk_index: dict[bytes, bytes] = {}
        self._seen_files: set[str] = set()
        self._key_prompts: collections.OrderedDict[str, list[bytes]] = collections.OrderedDict()  # LRU first
        self._unwritten: list[tuple[bytes, Entry]] = []  # saved while a prompt waited, not on disk yet
        self._lock = _allocate_lock()
        self._counts = CacheCounts()
        if self.disk_dir is not None:
            self.disk_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
            self._remove_stale_partials()

    def _remove_stale_partials(self) -> None:
        """Temporary files of writes that a stopped process never finished (a live writer's are younger)."""
        now = time.time()
        for partial in self.disk_dir.glob(".*.tmp"):
            try:
                if now - partial.stat().st_mtime > STALE_PARTIAL_SECONDS:
                    partial.unlink()
            except OSError:
                pass

    # -- looking up ---------------------------------------------------------------------------------------------

    def find(self, tokens: Sequence[int]) -> Optional[tuple[int, tuple[int, ...], bytes]]:
        """The saved state sharing the longest block-aligned prefix with ``tokens``: how many tokens it shares,
        the tokens it holds (it may hold more), and the state. A disk entry read comes into RAM too."""
        hashes = block_hashes(tokens)
        with self._lock:
            self._scan_disk()
            for blocks in range(len(hashes), 0, -1):
                for index, tier in ((self._index, self._ram), (self._disk_index, self._disk)):
                    key = index.get(hashes[blocks - 1])
                    entry = tier.get(key) if key is not None else None
                    if entry is None:
                        continue
                    shared = _shared(tokens, entry.tokens)
                    if shared < blocks * BLOCK:  # a hash collision: not this one
                        continue
                    state = entry.state if entry.state is not None else self._read(key, entry)
                    if state is None:
                        continue
                    self._keep_in_ram(key, Entry(entry.tokens, state, hashes=entry.hashes))
                    self._counts.hits += 1
                    self._counts.restored_tokens += shared
                    return shared, entry.tokens, state
            self._counts.misses += 1
            return None

    def holds(self, tokens: Sequence[int]) -> bool:
        """Whether these very tokens are saved already."""
        hashes = block_hashes(tokens)
        if not hashes:
            return False
        key = _full_key(hashes, tokens)
        with self._lock:
            return key in self._ram or key in self._disk

    def key_branch(self, key: str, tokens: Sequence[int]) -> int:
        """Where ``tokens`` leave the last prompt sent with the same cache key (a client's prompt_cache_key), at
        a block boundary; 0 if they continue it or share no block with it. Requests that share a key share a
        prefix: that is where it is worth saving."""
        hashes = block_hashes(tokens)
        with self._lock:
            last = self._key_prompts.pop(key, [])
            self._key_prompts[key] = hashes
            while len(self._key_prompts) > KEYS_REMEMBERED:
                self._key_prompts.popitem(last=False)
        shared = next((i for i, (a, b) in enumerate(zip(hashes, last)) if a != b), min(len(hashes), len(last)))
        return shared * BLOCK if shared < len(last) else 0

    # -- saving ---------------------------------------------------------------------------------------------

    def put(self, tokens: Sequence[int], state: bytes, defer_disk: bool = False) -> None:
        """Keep a sequence's state, in RAM and on disk, each within its budget. With ``defer_disk`` (a prompt
        is waiting) the disk write waits for ``write_deferred``."""
        if len(tokens) < MIN_TOKENS:
            return
        entry = Entry(tuple(tokens), state)
        key = _full_key(entry.hashes, tokens)
        with self._lock:
            self._counts.saved += 1
            self._keep_in_ram(key, entry)
            if self.disk_dir is not None and len(state) <= self.disk_bytes:
                self._unwritten.append((key, entry))
        if not defer_disk:
            self.write_deferred()

    def write_deferred(self) -> None:
        """Write the entries whose disk write was deferred."""
        with self._lock:
            unwritten, self._unwritten = self._unwritten, []
        for key, entry in unwritten:
            self._write(key, entry)

    def take_counts(self) -> CacheCounts:
        """The counts since the last call, with the bytes held now."""
        with self._lock:
            counts, self._counts = self._counts, CacheCounts()
        counts.ram_bytes, counts.disk_bytes = self.held()
        return counts

    def held(self) -> tuple[int, int]:
        """Bytes held in RAM, and on disk (of the entries this process knows of)."""
        with self._lock:
            return (sum(len(e.state) for e in self._ram.values()),
                    sum(_size(e.path) for e in self._disk.values()))

    def _keep_in_ram(self, key: bytes, entry: Entry) -> None:
        if len(entry.state) > self.ram_bytes:
            return
        self._ram[key] = entry
        self._ram.move_to_end(key)
        _add(self._index, key, entry)
        self._trim_ram()

    def _trim_ram(self) -> None:
        held = sum(len(e.state) for e in self._ram.values())
        while held > self.ram_bytes and self._ram:
            key, entry = self._ram.popitem(last=False)
            held -= len(entry.state)
            self._counts.evicted_ram += 1
            _remove(self._index, key, entry)

    # -- the disk tier ------------------------------------------------------------------------------------------

    def _write(self, key: bytes, entry: Entry) -> None:
        """Write then rename, the checksum last: a partial file never reads as valid."""
        tokens = np.asarray(entry.tokens, dtype="<i4").tobytes()
        head = self._head(len(entry.tokens), len(entry.state))
        checksum = hashlib.sha256(head + tokens + entry.state).digest()
        path = self.disk_dir / (key.hex() + SUFFIX)
        partial = self.disk_dir / f".{key.hex()}.{uuid.uuid4().hex}.tmp"
        try:
            with open(partial, "wb") as out:
                out.write(head + tokens + entry.state + checksum)
            os.replace(partial, path)
        except OSError:
            partial.unlink(missing_ok=True)
            return
        with self._lock:
            self._seen_files.add(path.name)
            self._disk[key] = on_disk = Entry(entry.tokens, None, path, entry.hashes)
            _add(self._disk_index, key, on_disk)
            self._trim_disk()

    def _scan_disk(self) -> None:
        """Index the entries other processes wrote since the last look (their tokens; states are read when used)."""
        if self.disk_dir is None:
            return
        try:
            names = {e.name for e in os.scandir(self.disk_dir) if e.name.endswith(SUFFIX)}
        except OSError:
            return
        for gone in self._seen_files - names:  # removed by another process's budget
            self._forget_disk(bytes.fromhex(gone.removesuffix(SUFFIX)))
        for name in names - self._seen_files:
            self._seen_files.add(name)
            path = self.disk_dir / name
            tokens = self._read_tokens(path)
            if tokens is None:
                continue
            key = bytes.fromhex(name.removesuffix(SUFFIX))
            self._disk[key] = entry = Entry(tokens, None, path)
            _add(self._disk_index, key, entry)

    def _head(self, n_tokens: int, n_state: int) -> bytes:
        """A disk entry's header: what it is, whose, and how many tokens and state bytes follow."""
        return MAGIC + self.identity + struct.pack("<QQ", n_tokens, n_state)

    def _read_head(self, data: bytes) -> tuple[int, int]:
        """The token and state sizes of a header; ValueError unless it is one of this identity's."""
        size = len(self._head(0, 0))
        if len(data) < size or data[:size - 16] != MAGIC + self.identity:
            raise ValueError("not an entry of this identity")
        return struct.unpack("<QQ", data[size - 16:size])

    def _read_tokens(self, path: Path) -> Optional[tuple[int, ...]]:
        try:
            with open(path, "rb") as f:
                n_tokens, _ = self._read_head(f.read(len(self._head(0, 0))))
                data = f.read(4 * n_tokens)
                if len(data) != 4 * n_tokens:
                    raise ValueError("truncated")
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            self._corrupt(path)
            return None
        return tuple(np.frombuffer(data, dtype="<i4").tolist())

    def _read(self, key: bytes, entry: Entry) -> Optional[bytes]:
        """A disk entry's state, all of it checked; a corrupt entry is counted and removed."""
        try:
            data = entry.path.read_bytes()
        except OSError:
            self._forget_disk(key)
            return None
        head_size = len(self._head(0, 0))
        body, checksum = data[:-32], data[-32:]
        try:
            n_tokens, n_state = self._read_head(body)
            if hashlib.sha256(body).digest() != checksum or len(body) != head_size + 4 * n_tokens + n_state:
                raise ValueError("cut short or altered")
        except ValueError:
            self._corrupt(entry.path)
            self._forget_disk(key)
            return None
        try:
            os.utime(entry.path)  # recently used: the disk budget removes it last
        except OSError:
            pass
        return body[head_size + 4 * n_tokens:]

    def _corrupt(self, path: Path) -> None:
        self._counts.corrupt += 1
        path.unlink(missing_ok=True)

    def _forget_disk(self, key: bytes) -> None:
        entry = self._disk.pop(key, None)
        if entry is None:
            return
        self._seen_files.discard(entry.path.name)
        _remove(self._disk_index, key, entry)

    def _trim_disk(self) -> None:
        files = sorted(((_mtime(e.path), key) for key, e in self._disk.items()), key=lambda item: item[0])
        held = sum(_size(self._disk[key].path) for _, key in files)
        for _, key in files:
            if held <= self.disk_bytes:
                break
            path = self._disk[key].path
            held -= _size(path)
            path.unlink(missing_ok=True)
            self._forget_disk(key)
            self._counts.evicted_disk += 1


def _add(index: dict[bytes, bytes], key: bytes, entry: Entry) -> None:
    """Index an entry at each of its block boundaries."""
    for block_hash in entry.hashes:
        index[block_hash] = key


def _remove(index: dict[bytes, bytes], key: bytes, entry: Entry) -> None:
    """Take an entry out of an index, where another entry has not taken its place."""
    for block_hash in entry.hashes:
        if index.get(block_hash) == key:
            del index[block_hash]


def _full_key(hashes: list[bytes], tokens: Sequence[int]) -> bytes:
    """An entry's own key: the chain hash over all its tokens, the partial last block included."""
    tail = np.asarray(tokens[len(hashes) * BLOCK:], dtype="<i4").tobytes()
    return hashlib.blake2b(hashes[-1] + tail + struct.pack("<Q", len(tokens)), digest_size=16).digest()


def _shared(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    left, right = np.asarray(a[:n]), np.asarray(b[:n])
    differ = np.flatnonzero(left != right)
    return int(differ[0]) if len(differ) else n


def _size(path: Optional[Path]) -> int:
    try:
        return path.stat().st_size if path else 0
    except OSError:
        return 0


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0
