"""Secret keys kept in files readable by their owner only, made by whichever process needs one first."""

import os
import stat
import tempfile
from pathlib import Path
from typing import Callable


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
