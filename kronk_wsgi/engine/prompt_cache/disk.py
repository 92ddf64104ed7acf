"""The disk tier: states in a directory shared by every worker of a server (and by servers pointed at it), kept
across unloads and restarts within one budget for the whole directory, least recently used first out.

An entry is written to a temporary file and renamed, authenticated over all of it with a key kept in the
directory (readable by its owner only): a crash mid-write, or a file someone else put there, never reads as
valid. Each model identity has a folder of its own; another identity's entries are never read. An announcement
is an entry's tokens without its state, written when an answer is out, so that a next turn reaching another
worker at once waits for the state instead of evaluating its prompt again.

The cache's lock is held for the index only, never while a file is read, hashed or written; a lock of the tier's
own keeps directory scans and trims to one thread at a time.
"""

import collections
import hashlib
import hmac
import os
import re
import stat
import struct
import time
from pathlib import Path
from typing import Optional

import numpy as np
from gevent import monkey

from ...private_files import open_private, owner_only_key, private_folder, write_private
from .index import MIN_TOKENS, PENDING, BlockIndex, Entry

_allocate_lock = monkey.get_original("_thread", "allocate_lock")

MAGIC = b"KRONKKV2"
SUFFIX = ".kv"
ENTRY_NAME = re.compile(r"([0-9a-f]{32})(\.kv|\.pending)")
IDENTITY_DIR = re.compile(r"[0-9a-f]{16}")
KEY_FILE = ".key"
STALE_PARTIAL_SECONDS = 600
# How long a prompt waits for an announced entry's state: a writer gone for longer is taken to be dead.
PENDING_SECONDS = 20.0
PROBLEMS_REMEMBERED = 1024  # files reported as unusable, each reported once


class Problems:
    """What was wrong with the cache's files, each file reported once, and how many were unusable."""

    def __init__(self) -> None:
        self.corrupt = 0  # files that did not read as valid entries: skipped or removed
        self._reported: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._untold: collections.deque[str] = collections.deque()
        self._lock = _allocate_lock()

    def report(self, name: str, why: str, count: bool = True) -> None:
        with self._lock:
            self.corrupt += count
            if name in self._reported:
                return
            self._reported[name] = None
            while len(self._reported) > PROBLEMS_REMEMBERED:
                self._reported.popitem(last=False)
            self._untold.append(f"{name[:100]}: {why}")

    def take(self) -> list[str]:
        """The reports not taken yet."""
        taken = []
        while self._untold:
            taken.append(self._untold.popleft())
        return taken


class DiskTier:
    """The entries of one model identity (``identity``, a digest) under ``root``, within ``budget`` bytes for
    all of ``root``. OSError if the directory or its key cannot be trusted."""

    def __init__(self, root: Path, identity: bytes, budget: int, lock, problems: Problems) -> None:
        self.root = root
        self.directory = root / identity.hex()[:16]
        self.identity = identity
        self.budget = budget
        self.index = BlockIndex()  # entries and announcements: their tokens read, their states not
        self.evicted = 0  # files removed for the budget since the start
        self._lock = lock  # the cache's, for the index
        self._problems = problems
        self._seen_files: set[str] = set()
        self._scan_lock = _allocate_lock()
        private_folder(self.directory)
        self._secret = owner_only_key(root / KEY_FILE, lambda: os.urandom(32).hex().encode())
        self._remove_stale_partials()

    def _remove_stale_partials(self) -> None:
        """Temporary files of writes that a stopped process never finished (a live writer's are younger)."""
        now = time.time()
        for partial in self.directory.glob(".*.tmp"):
            try:
                if now - partial.lstat().st_mtime > STALE_PARTIAL_SECONDS:
                    partial.unlink()
            except OSError:
                pass

    def holds(self, key: bytes) -> bool:
        """Whether the state under ``key`` is here (not only announced); under the cache's lock."""
        entry = self.index.get(key)
        return entry is not None and not entry.pending

    def held(self) -> int:
        """Bytes of the entries this process knows of (the list copied at once: no lock)."""
        return sum(e.size for e in list(self.index.entries.values()))

    # -- writing ------------------------------------------------------------------------------------------------

    def announce(self, key: bytes, entry: Entry) -> None:
        """Say that ``entry``'s state is about to be written."""
        _replace(self._path(key, PENDING), self._head(entry.seed, len(entry.tokens), 0)
                 + np.asarray(entry.tokens, dtype="<i4").tobytes())

    def withdraw(self, key: bytes) -> None:
        """Take back an announcement."""
        self._path(key, PENDING).unlink(missing_ok=True)

    def write(self, key: bytes, entry: Entry) -> None:
        """Write then rename, authenticated over all of it; take back the entry's announcement; trim."""
        body = self._head(entry.seed, len(entry.tokens), len(entry.state)) + np.asarray(entry.tokens, "<i4").tobytes()
        path = self._path(key, SUFFIX)
        written = _replace(path, body + entry.state + self._mac(body, entry.state))
        self.withdraw(key)
        if not written:
            return
        with self._lock:
            self._seen_files.add(path.name)
            self.index.add(key, Entry(entry.tokens, None, path, entry.hashes, entry.seed,
                                      len(body) + len(entry.state) + 32))
        self._trim()

    def _trim(self) -> None:
        """Hold the whole directory (every identity's entries, every worker's) to the budget, oldest first."""
        with self._scan_lock:
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
                if held <= self.budget:
                    break
                held -= size
                path.unlink(missing_ok=True)
                match = ENTRY_NAME.fullmatch(path.name)
                with self._lock:
                    if path.parent == self.directory and match:
                        self._forget(bytes.fromhex(match.group(1)))
                    self.evicted += 1

    # -- reading ------------------------------------------------------------------------------------------------

    def scan(self) -> None:
        """Index the entries and announcements other processes wrote since the last look (their tokens; states
        are read when used); forget those removed."""
        with self._scan_lock:
            try:
                with os.scandir(self.directory) as found:
                    names = {e.name for e in found if e.name.endswith((SUFFIX, PENDING))}
            except OSError:
                return
            with self._lock:
                for gone in self._seen_files - names:  # removed by another process, or its state written
                    self._seen_files.discard(gone)
                    match = ENTRY_NAME.fullmatch(gone)
                    entry = self.index.get(bytes.fromhex(match.group(1))) if match else None
                    if entry is not None and entry.path.name == gone:
                        self._forget(bytes.fromhex(match.group(1)))
                new = sorted(names - self._seen_files, key=lambda n: n.endswith(SUFFIX))  # announcements first
                self._seen_files.update(new)
            for name in new:
                self._index_file(name)

    def _index_file(self, name: str) -> None:
        match = ENTRY_NAME.fullmatch(name)
        path = self.directory / name
        if match is None:
            self._unusable(path, "not a cache entry's name")
            return
        key = bytes.fromhex(match.group(1))
        if name.endswith(PENDING) and key in self.index:  # the state is there already
            return
        read = self._read_tokens(path, pending=name.endswith(PENDING))
        if read is not None:
            seed, tokens, size = read
            with self._lock:
                self.index.add(key, Entry(tokens, None, path, seed=seed, size=size))

    def announcement_alive(self, key: bytes, entry: Entry) -> bool:
        """Whether an announced state may still come; an announcement older than PENDING_SECONDS is removed."""
        if time.time() - _mtime(entry.path) < PENDING_SECONDS:
            return True
        entry.path.unlink(missing_ok=True)  # its writer is gone
        with self._lock:
            self._forget(key)
        return False

    def read(self, key: bytes, entry: Entry) -> Optional[bytes]:
        """An entry's state, all of it authenticated; an entry that is not valid is counted and removed."""
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
                self._forget(key)
            return None
        except (OSError, ValueError) as exc:
            self._unusable(entry.path, str(exc), key)
            return None
        body, mac = view[:size - 32], view[size - 32:]
        if got != size or not hmac.compare_digest(self._mac(body), mac):
            self._unusable(entry.path, "cut short, altered, or not written by this server", key)
            return None
        try:
            os.utime(entry.path)  # recently used: the budget removes it last
        except OSError:
            pass
        return bytes(body[len(self._head(entry.seed, 0, 0)) + 4 * len(entry.tokens):])

    def _read_tokens(self, path: Path, pending: bool) -> Optional[tuple[bytes, tuple[int, ...], int]]:
        """An entry's scope seed, tokens and file size."""
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

    def _head(self, seed: bytes, n_tokens: int, n_state: int) -> bytes:
        """An entry's header: what it is, whose, in which scope, and how many tokens and state bytes follow."""
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

    def _mac(self, *parts: bytes) -> bytes:
        mac = hmac.new(self._secret, digestmod=hashlib.sha256)
        for part in parts:
            mac.update(part)
        return mac.digest()

    def _unusable(self, path: Path, why: str, key: Optional[bytes] = None) -> None:
        """A file in the directory that is no valid entry: reported, removed if it is a file, and forgotten if
        indexed under ``key``. Called without the cache's lock (it takes it)."""
        try:
            if stat.S_ISREG(path.lstat().st_mode):
                path.unlink()
        except OSError:
            pass
        self._problems.report(path.name, why)
        if key is not None:
            with self._lock:
                self._forget(key)

    def _forget(self, key: bytes) -> None:
        entry = self.index.remove(key)
        if entry is not None:
            self._seen_files.discard(entry.path.name)

    def _path(self, key: bytes, suffix: str) -> Path:
        return self.directory / (key.hex() + suffix)


def _replace(path: Path, data: bytes) -> bool:
    """Write ``data`` to ``path`` whole or not at all (see write_private); whether it was written."""
    try:
        write_private(path, [data])
        return True
    except OSError:
        return False


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0
