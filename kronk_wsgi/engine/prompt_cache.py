"""Saved sequence states, in RAM and on disk: a conversation that comes back after its slot went to another one
restores its history instead of evaluating it again.

An entry is the KV state of one token sequence, as the engine saves it when a
slot is about to be overwritten, or once its answer is out. Entries are found
by a hash chain over blocks of BLOCK tokens: each block boundary of an entry is
indexed, so the longest cached prefix of a prompt is found in one pass over the
prompt's blocks. The chain starts from the entry's scope (a tenant: by default
each API key is its own), so one scope's prompts never find another's. RAM
holds the most recently used entries within its budget; the disk tier (a
directory shared by every worker of a server, and by servers pointed at it)
keeps them across unloads and restarts, within one budget for the whole
directory, least recently used first out. A disk entry is written to a
temporary file and renamed, authenticated over all of it with a key kept in
the directory (readable by its owner only): a crash mid-write, or a file
someone else put there, never reads as valid. Every entry belongs to one
identity (the model file, the engine's version and its context parameters):
another identity's entries are never restored.

When an answer is out, the slot announces on disk the entry it is about to
save (its tokens, no state yet), so that a next turn that reaches another
worker at once waits for the state instead of evaluating the prompt again.

Slot threads call it at once: a lock (a real one, not gevent's) guards the index, held for the index only,
never while a file is read, hashed or written; a second one keeps directory scans to one thread at a time. The
event loop takes neither: it reads the counts and the bytes held without a lock. A slot saves its state once
its answer is out (the client does not wait for it); its disk write follows once the slot is given back.
"""

import collections
import dataclasses
import hashlib
import hmac
import os
import re
import stat
import struct
import time
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
from gevent import monkey

from ..private_files import open_private, owner_only_key, private_folder, write_private

_allocate_lock = monkey.get_original("_thread", "allocate_lock")
_sleep = monkey.get_original("time", "sleep")

BLOCK = 64  # tokens per hashed block: entries are found at block boundaries
MIN_TOKENS = BLOCK  # shorter sequences are not worth saving
MAGIC = b"KRONKKV2"
STALE_PARTIAL_SECONDS = 600
SUFFIX = ".kv"
PENDING = ".pending"  # an announced entry: its tokens, its state on the way
ENTRY_NAME = re.compile(r"([0-9a-f]{32})(\.kv|\.pending)")
IDENTITY_DIR = re.compile(r"[0-9a-f]{16}")
KEY_FILE = ".key"
# How long a prompt waits for an announced entry's state (a writer gone for longer is taken to be dead), and
# how often it looks.
PENDING_SECONDS = 20.0
PENDING_POLL_SECONDS = 0.02
COMPARE_CHUNK = 1024  # tokens compared at once by shared_prefix
KEYS_REMEMBERED = 1024  # cache keys whose last prompt is remembered, least recently used first out
PROBLEMS_REMEMBERED = 1024  # files reported as unusable, each reported once


def scope_seed(scope: str) -> bytes:
    """Where a scope's hash chains start."""
    return hashlib.blake2b(scope.encode("utf-8", "surrogatepass"), digest_size=16, person=b"kronk-scope").digest()


def block_hashes(tokens: Sequence[int], seed: bytes = scope_seed("")) -> list[bytes]:
    """The chain hash at each block boundary: the i-th covers tokens[:BLOCK * (i + 1)], in the scope of ``seed``."""
    data = np.asarray(tokens, dtype="<i4").tobytes()
    hashes, previous = [], seed
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
    corrupt: int = 0  # disk files that did not read as valid entries: skipped or removed
    ram_bytes: int = 0
    disk_bytes: int = 0
    problems: list[str] = dataclasses.field(default_factory=list)  # what was wrong with them, each file once


# The counts that only grow (take_counts reports how much they grew).
_GROWING = ("hits", "misses", "restored_tokens", "saved", "evicted_ram", "evicted_disk", "corrupt")


class Entry:
    """A saved state, the tokens it holds and their block hashes; ``state`` is None for a disk entry (read when it
    is used). A disk entry whose path is an announcement has no state yet."""

    def __init__(self, tokens: tuple[int, ...], state: Optional[bytes], path: Optional[Path] = None,
                 hashes: Optional[list[bytes]] = None, seed: bytes = scope_seed(""), size: int = 0) -> None:
        self.tokens = tokens
        self.state = state
        self.path = path
        self.size = size  # of its file, for a disk entry
        self.seed = seed
        self.hashes = block_hashes(tokens, seed) if hashes is None else hashes

    @property
    def pending(self) -> bool:
        return self.path is not None and self.path.suffix == PENDING


class PromptCache:
    """Sequence states of one model identity, in RAM (``ram_bytes``) and on disk (``disk_dir``, ``disk_bytes`` for
    the whole directory, every identity's entries together)."""

    def __init__(self, identity: str, ram_bytes: int, disk_dir: Optional[Path], disk_bytes: int) -> None:
        self.identity = hashlib.sha256(identity.encode()).digest()
        self.ram_bytes = ram_bytes
        self.root = disk_dir if disk_dir is not None and disk_bytes > 0 else None
        self.disk_dir = self.root / self.identity.hex()[:16] if self.root is not None else None
        self.disk_bytes = disk_bytes
        self._ram: collections.OrderedDict[bytes, Entry] = collections.OrderedDict()  # by full hash, LRU first
        self._index: dict[bytes, list[bytes]] = {}  # block hash -> full hashes of the entries in RAM with that prefix
        self._disk: dict[bytes, Entry] = {}  # full hash -> disk entry (tokens read, state not)
        self._disk_index: dict[bytes, list[bytes]] = {}
        self._seen_files: set[str] = set()
        self._reported: collections.OrderedDict[str, None] = collections.OrderedDict()  # unusable files, told once
        self._key_prompts: collections.OrderedDict[tuple[bytes, str], list[bytes]] = collections.OrderedDict()
        self._unwritten: list[tuple[bytes, Entry]] = []  # saved while a prompt waited, not on disk yet
        self._lock = _allocate_lock()
        self._counts = CacheCounts()  # since the start
        self._taken = CacheCounts()  # as take_counts last read them
        self._problems: collections.deque[str] = collections.deque()  # not taken yet
        self._disk_lock = _allocate_lock()  # one thread at a time reads the directory or trims it
        self._secret = b""
        if self.disk_dir is not None:
            try:
                private_folder(self.disk_dir)
                self._secret = owner_only_key(self.root / KEY_FILE, lambda: os.urandom(32).hex().encode())
            except OSError as exc:  # the directory cannot be trusted or used: RAM only
                self._problem(str(self.root), f"the disk tier is off: {exc}", count=False)
                self.root = self.disk_dir = None
        if self.disk_dir is not None:
            self._remove_stale_partials()

    def _remove_stale_partials(self) -> None:
        """Temporary files of writes that a stopped process never finished (a live writer's are younger)."""
        now = time.time()
        for partial in self.disk_dir.glob(".*.tmp"):
            try:
                if now - partial.lstat().st_mtime > STALE_PARTIAL_SECONDS:
                    partial.unlink()
            except OSError:
                pass

    # -- looking up ---------------------------------------------------------------------------------------------

    def find(self, tokens: Sequence[int], scope: str = "", better_than: int = 0, whole: bool = False
             ) -> Optional[tuple[int, tuple[int, ...], bytes]]:
        """The saved state sharing the longest block-aligned prefix with ``tokens`` in ``scope``, if it serves more
        than ``better_than`` of them (what the slot holds already; at least the last token is evaluated): how many
        tokens it shares, the tokens it holds (it may hold more), and the state. A disk entry read comes into RAM
        too. If the longest is an announced entry, waits for its state (up to PENDING_SECONDS after the
        announcement). With ``whole``, only a state the prompt continues all of (a sliding-window cache's). Only a
        state returned counts as a hit."""
        hashes = block_hashes(tokens, scope_seed(scope))
        while True:
            self._scan_disk()
            with self._lock:
                candidates = self._candidates(tokens, hashes, better_than, whole)
            for shared, key, entry in candidates:
                if entry.pending:
                    if time.time() - _mtime(entry.path) < PENDING_SECONDS:
                        break  # its state is on the way: wait for it
                    entry.path.unlink(missing_ok=True)  # its writer is gone
                    with self._lock:
                        self._forget_disk(key)
                    continue
                state = entry.state if entry.state is not None else self._read(key, entry)
                if state is None:
                    continue
                with self._lock:
                    self._hold_in_ram(key, Entry(entry.tokens, state, hashes=entry.hashes, seed=entry.seed))
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
            found = [(key, tier[key]) for index, tier in ((self._index, self._ram), (self._disk_index, self._disk))
                     for key in index.get(hashes[blocks - 1], ()) if key in tier and key not in seen]
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
        key = _full_key(hashes, tokens)
        with self._lock:
            return key in self._ram or (key in self._disk and not self._disk[key].pending)

    def covers(self, tokens: Sequence[int], scope: str = "", within: int = 0) -> bool:
        """Whether a saved state (not an announced one) holds these tokens, or continues them by at most
        ``within`` tokens, in ``scope``: an engine that can cut a restored sequence back serves them from it."""
        hashes = block_hashes(tokens, scope_seed(scope))
        if not hashes:
            return False
        with self._lock:
            found = [tier[key] for index, tier in ((self._index, self._ram), (self._disk_index, self._disk))
                     for key in index.get(hashes[-1], ()) if key in tier and not tier[key].pending]
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
        if self.disk_dir is None or len(tokens) < MIN_TOKENS or self.holds(tokens, scope):
            return
        entry = Entry(tuple(tokens), None, seed=scope_seed(scope))
        key = _full_key(entry.hashes, tokens)
        head = self._head(entry.seed, len(tokens), 0)
        self._replace(self._path(key, PENDING), head + np.asarray(tokens, dtype="<i4").tobytes())

    def put(self, tokens: Sequence[int], state: bytes, defer_disk: bool = False, scope: str = "") -> None:
        """Keep a sequence's state, in RAM and on disk, each within its budget. With ``defer_disk`` (a prompt
        is waiting) the disk write waits for ``write_deferred``."""
        if len(tokens) < MIN_TOKENS:
            return
        entry = Entry(tuple(tokens), state, seed=scope_seed(scope))
        key = _full_key(entry.hashes, tokens)
        with self._lock:
            self._counts.saved += 1
            self._hold_in_ram(key, entry)
            written = self.disk_dir is not None and len(state) <= self.disk_bytes
            if written:
                self._unwritten.append((key, entry))
        if not written and self.disk_dir is not None:
            self._path(key, PENDING).unlink(missing_ok=True)  # announced, but never written
        if not defer_disk:
            self.write_deferred()

    def withdraw(self, tokens: Sequence[int], scope: str = "") -> None:
        """Take back an announcement whose state could not be saved."""
        if self.disk_dir is not None and len(tokens) >= MIN_TOKENS:
            self._path(_full_key(block_hashes(tokens, scope_seed(scope)), tokens), PENDING).unlink(missing_ok=True)

    def write_deferred(self) -> None:
        """Write the entries whose disk write was deferred."""
        with self._lock:
            unwritten, self._unwritten = self._unwritten, []
        for key, entry in unwritten:
            self._write(key, entry)

    def take_counts(self) -> CacheCounts:
        """The counts since the last call, with the bytes held now (for one caller, the event loop: it takes no
        lock; the counts only grow, written under the lock by the threads)."""
        now = dataclasses.replace(self._counts, problems=[])
        counts = CacheCounts(**{field.name: getattr(now, field.name) - getattr(self._taken, field.name)
                                for field in dataclasses.fields(CacheCounts) if field.name in _GROWING})
        self._taken = now
        while self._problems:
            counts.problems.append(self._problems.popleft())
        counts.ram_bytes, counts.disk_bytes = self.held()
        return counts

    def held(self) -> tuple[int, int]:
        """Bytes held in RAM, and on disk (of the entries this process knows of), without a lock or a file looked
        at (each list is copied at once)."""
        return (sum(len(e.state) for e in list(self._ram.values())),
                sum(e.size for e in list(self._disk.values())))

    def clear_ram(self) -> None:
        """Drop every state held in RAM (a gateway's flush); the disk tier keeps its files."""
        with self._lock:
            self._counts.evicted_ram += len(self._ram)
            self._ram.clear()
            self._index.clear()

    def _hold_in_ram(self, key: bytes, entry: Entry) -> None:
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

    def _path(self, key: bytes, suffix: str) -> Path:
        return self.disk_dir / (key.hex() + suffix)

    def _replace(self, path: Path, data: bytes) -> bool:
        """Write ``data`` to ``path`` whole or not at all (see write_private); whether it was written."""
        try:
            write_private(path, [data])
            return True
        except OSError:
            return False

    def _write(self, key: bytes, entry: Entry) -> None:
        """Write then rename, authenticated over all of it; then take back the entry's announcement."""
        body = self._head(entry.seed, len(entry.tokens), len(entry.state)) + np.asarray(entry.tokens, "<i4").tobytes()
        path = self._path(key, SUFFIX)
        written = self._replace(path, body + entry.state + self._mac(body, entry.state))
        self._path(key, PENDING).unlink(missing_ok=True)
        if not written:
            return
        with self._lock:
            self._seen_files.add(path.name)
            self._disk[key] = on_disk = Entry(entry.tokens, None, path, entry.hashes, entry.seed, len(body) +
                                              len(entry.state) + 32)
            _add(self._disk_index, key, on_disk)
        self._trim_disk()

    def _mac(self, *parts: bytes) -> bytes:
        mac = hmac.new(self._secret, digestmod=hashlib.sha256)
        for part in parts:
            mac.update(part)
        return mac.digest()

    def _scan_disk(self) -> None:
        """Index the entries and announcements other processes wrote since the last look (their tokens; states are
        read when used); forget those removed. The lock is held for the index only, never while a file is read."""
        if self.disk_dir is None:
            return
        with self._disk_lock:
            try:
                with os.scandir(self.disk_dir) as found:
                    names = {e.name for e in found if e.name.endswith((SUFFIX, PENDING))}
            except OSError:
                return
            with self._lock:
                for gone in self._seen_files - names:  # removed by another process, or its state written
                    self._seen_files.discard(gone)
                    match = ENTRY_NAME.fullmatch(gone)
                    key = bytes.fromhex(match.group(1)) if match else None
                    if key in self._disk and self._disk[key].path.name == gone:
                        self._forget_disk(key)
                new = sorted(names - self._seen_files, key=lambda n: n.endswith(SUFFIX))  # announcements first
                self._seen_files.update(new)
            for name in new:
                match = ENTRY_NAME.fullmatch(name)
                path = self.disk_dir / name
                if match is None:
                    self._unusable(path, "not a cache entry's name")
                    continue
                key = bytes.fromhex(match.group(1))
                if name.endswith(PENDING) and key in self._disk:  # the state is there already
                    continue
                read = self._read_tokens(path, pending=name.endswith(PENDING))
                if read is None:
                    continue
                seed, tokens, size = read
                entry = Entry(tokens, None, path, seed=seed, size=size)
                with self._lock:
                    self._disk[key] = entry
                    _add(self._disk_index, key, entry)

    def _head(self, seed: bytes, n_tokens: int, n_state: int) -> bytes:
        """A disk entry's header: what it is, whose, in which scope, and how many tokens and state bytes follow."""
        return MAGIC + self.identity + seed + struct.pack("<QQ", n_tokens, n_state)

    def _read_head(self, fd: int, size: int, pending: bool) -> tuple[bytes, int, int]:
        """The scope seed, token and state counts of an entry's header, checked against the file's size;
        ValueError unless it is a whole entry (or announcement) of this identity."""
        head_size = len(self._head(b"\0" * 16, 0, 0))
        data = os.read(fd, head_size)
        prefix = len(MAGIC) + len(self.identity)
        if len(data) < head_size or data[:prefix] != MAGIC + self.identity:
            raise ValueError("not an entry of this model identity")
        seed = data[prefix:prefix + 16]
        n_tokens, n_state = struct.unpack("<QQ", data[prefix + 16:])
        expected = head_size + 4 * n_tokens + (0 if pending else n_state + 32)
        if (pending and n_state) or n_tokens < MIN_TOKENS or size != expected:
            raise ValueError("its header does not match its size")
        return seed, n_tokens, n_state

    def _read_tokens(self, path: Path, pending: bool = False) -> Optional[tuple[bytes, tuple[int, ...], int]]:
        try:
            fd, size = open_private(path)
            try:
                seed, n_tokens, _ = self._read_head(fd, size, pending)
                data = os.read(fd, 4 * n_tokens)
            finally:
                os.close(fd)
            if len(data) != 4 * n_tokens:
                raise ValueError("cut short")
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            self._unusable(path, str(exc))
            return None
        return seed, tuple(np.frombuffer(data, dtype="<i4").tolist()), size

    def _read(self, key: bytes, entry: Entry) -> Optional[bytes]:
        """A disk entry's state, all of it authenticated; an entry that is not valid is counted and removed."""
        try:
            fd, size = open_private(entry.path)
            try:
                self._read_head(fd, size, pending=False)
                os.lseek(fd, 0, os.SEEK_SET)
                data = bytearray(size)
                view = memoryview(data)
                got = 0
                while got < size:
                    n = os.readv(fd, [view[got:]])
                    if n == 0:
                        break
                    got += n
            finally:
                os.close(fd)
        except FileNotFoundError:
            with self._lock:
                self._forget_disk(key)
            return None
        except (OSError, ValueError) as exc:
            self._unusable(entry.path, str(exc))
            with self._lock:
                self._forget_disk(key)
            return None
        head_size = len(self._head(entry.seed, 0, 0))
        body, mac = view[:size - 32], view[size - 32:]
        if got != size or not hmac.compare_digest(self._mac(body), mac):
            self._unusable(entry.path, "cut short, altered, or not written by this server")
            with self._lock:
                self._forget_disk(key)
            return None
        try:
            os.utime(entry.path)  # recently used: the disk budget removes it last
        except OSError:
            pass
        return bytes(body[head_size + 4 * len(entry.tokens):])

    def _unusable(self, path: Path, why: str) -> None:
        """A file in the directory that is no valid entry: counted and reported once; removed if it is a file.
        Called without the lock (it takes it)."""
        try:
            if stat.S_ISREG(path.lstat().st_mode):
                path.unlink()
        except OSError:
            pass
        with self._lock:
            self._problem(path.name, why)

    def _problem(self, name: str, why: str, count: bool = True) -> None:
        """Count and report a problem (under the lock)."""
        self._counts.corrupt += count
        if name in self._reported:
            return
        self._reported[name] = None
        while len(self._reported) > PROBLEMS_REMEMBERED:
            self._reported.popitem(last=False)
        self._problems.append(f"{name[:100]}: {why}")

    def _forget_disk(self, key: bytes) -> None:
        entry = self._disk.pop(key, None)
        if entry is None:
            return
        self._seen_files.discard(entry.path.name)
        _remove(self._disk_index, key, entry)

    def _trim_disk(self) -> None:
        """Hold the whole directory (every identity's entries, every worker's) to the budget, oldest first."""
        with self._disk_lock:
            files = []
            try:
                identities = [d.path for d in os.scandir(self.root)
                              if IDENTITY_DIR.fullmatch(d.name) and d.is_dir(follow_symlinks=False)]
                for directory in identities:
                    with os.scandir(directory) as entries:
                        for entry in entries:
                            if ENTRY_NAME.fullmatch(entry.name) and entry.is_file(follow_symlinks=False):
                                info = entry.stat(follow_symlinks=False)
                                files.append((info.st_mtime, info.st_size, Path(entry.path)))
            except OSError:
                return
            held = sum(size for _, size, _ in files)
            for _, size, path in sorted(files, key=lambda file: file[0]):
                if held <= self.disk_bytes:
                    break
                held -= size
                path.unlink(missing_ok=True)
                match = ENTRY_NAME.fullmatch(path.name)
                with self._lock:
                    if path.parent == self.disk_dir and match:
                        self._forget_disk(bytes.fromhex(match.group(1)))
                    self._counts.evicted_disk += 1


def _add(index: dict[bytes, list[bytes]], key: bytes, entry: Entry) -> None:
    """Index an entry at each of its block boundaries."""
    for block_hash in entry.hashes:
        keys = index.setdefault(block_hash, [])
        if key not in keys:
            keys.append(key)


def _remove(index: dict[bytes, list[bytes]], key: bytes, entry: Entry) -> None:
    """Take an entry out of an index."""
    for block_hash in entry.hashes:
        keys = index.get(block_hash, [])
        if key in keys:
            keys.remove(key)
            if not keys:
                del index[block_hash]


def _full_key(hashes: list[bytes], tokens: Sequence[int]) -> bytes:
    """An entry's own key: the chain hash over all its tokens, the partial last block included."""
    tail = np.asarray(tokens[len(hashes) * BLOCK:], dtype="<i4").tobytes()
    return hashlib.blake2b(hashes[-1] + tail + struct.pack("<Q", len(tokens)), digest_size=16).digest()


def shared_prefix(tokens: Sequence[int], other: Sequence[int]) -> int:
    """How many leading tokens two token sequences have in common (compared a chunk at a time: about 1 ms for
    128k tokens, where a token-by-token loop takes 13)."""
    n, start, same_type = min(len(tokens), len(other)), 0, type(tokens) is type(other)
    while start < n:
        left, right = tokens[start:start + COMPARE_CHUNK], other[start:start + COMPARE_CHUNK]
        if (left != right) if same_type else (list(left) != list(right)):
            break
        start = min(start + COMPARE_CHUNK, n)
    while start < n and tokens[start] == other[start]:
        start += 1
    return start


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0
