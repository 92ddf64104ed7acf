"""Files only their owner reads: secret keys, made by whichever process needs one first, and saved states,
written whole or not at all, never through a link planted in their folder."""

import os
import stat
import tempfile
import uuid
from pathlib import Path
from typing import Callable, Iterable


def owner_only_key(path: Path, make: Callable[[], bytes]) -> bytes:
    """The key in ``path``, made with ``make()`` if there is none yet (the first process's key wins; the others
    read it). PermissionError if the file is not this user's own, or others may read or write it."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, temporary = tempfile.mkstemp(dir=path.parent)  # 0600
        try:
            os.write(fd, make())
            os.close(fd)
            os.link(temporary, path)
        except FileExistsError:
            pass
        finally:
            os.unlink(temporary)
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
            raise PermissionError(f"{path} must be a file of this user's, readable and writable by it alone (0600)")
        return os.read(fd, 4096).strip()
    finally:
        os.close(fd)


def private_folder(path: Path) -> None:
    """Make ``path`` (and its parents) if missing, for this user alone (0700)."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)


def write_private(path: Path, parts: Iterable[bytes]) -> None:
    """Write ``parts`` to a new file beside ``path`` (0600, made here, never through a link), then rename it to
    ``path``: a reader sees the old file or the whole new one. The new file is removed if anything fails."""
    partial = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "wb") as out:
            for part in parts:
                out.write(part)
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise


def open_private(path: Path) -> tuple[int, int]:
    """``path`` opened to read, and its size; ValueError unless it is a regular file (never a link or a FIFO),
    OSError if it cannot be opened."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise ValueError("not a regular file")
    return fd, info.st_size
