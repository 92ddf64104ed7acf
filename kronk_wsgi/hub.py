"""Model files from the Hugging Face hub: pull into the hub's cache, list what is cached, remove.

huggingface-hub does the hub's work: the download protocol, HF_TOKEN,
HF_ENDPOINT, HF_HUB_OFFLINE, the cache layout, progress bars, and resuming
a download its connection dropped. What kronk_wsgi adds: a file named by its
quantization, a repository's multimodal projector (its mmproj file) beside its
model, and a SHA-256 check of every pulled file against the hub's
(the cache names a large file's blob by its SHA-256; a file that does not
match is removed).
"""

import dataclasses
import hashlib
import os
import re
from pathlib import Path
from typing import Callable, Optional

import huggingface_hub
from huggingface_hub import constants
from huggingface_hub.utils import tqdm as hub_tqdm

from .config import cache_dir

SHA256 = re.compile(r"[0-9a-f]{64}")
# What a git ref or commit id can be, as far as a path goes: huggingface-hub writes refs/<revision> in the cache.
REVISION = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*(/[A-Za-z0-9_][A-Za-z0-9._-]*)*")


class HubError(RuntimeError):
    """A pull, lookup or removal that cannot be done; the message says why."""


@dataclasses.dataclass
class Download:
    """A download's progress, and why it must stop: ``stop`` is set by the event loop, and the downloading thread
    raises at its next piece (``progress``, handed to ``pull``)."""

    done: int = 0
    total: Optional[int] = None
    stop: Optional[str] = None

    def progress(self, done: int, total: Optional[int]) -> None:
        if self.stop is not None:
            raise HubError(self.stop)
        self.done, self.total = done, total


@dataclasses.dataclass(frozen=True)
class CachedFile:
    """A GGUF file in the hub's cache."""

    repo_id: str
    filename: str
    revision: str  # the commit it belongs to
    path: Path  # the snapshot's path to it
    size: int


def check_revision(revision: Optional[str]) -> None:
    """HubError unless ``revision`` is a branch, tag or commit name that stays inside the cache (no "..", no "/")."""
    if revision is None:
        return
    if (len(revision) > 255 or not REVISION.fullmatch(revision) or ".." in revision
            or revision.endswith((".lock", ".")) or "/." in revision):
        raise HubError(f"revision {revision[:100]!r} is not a branch, tag or commit name")


def check_filename(filename: Optional[str]) -> None:
    """HubError unless ``filename`` is a path inside a repository (no "..", not absolute)."""
    if filename is None:
        return
    parts = filename.split("/")
    if not filename or filename.startswith("/") or "\\" in filename or any(p in ("", ".", "..") for p in parts):
        raise HubError(f"file {filename[:100]!r} is not a path inside the repository")


REACH_SECONDS = 5.0  # how long the hub has to answer before a pull or a download gives up on it


def unreachable(timeout: float) -> Optional[str]:
    """Why the hub (HF_ENDPOINT) does not answer within ``timeout`` seconds, in one try; None if it answers.

    huggingface-hub retries a refused connection five times, backing off for 23 s in all: a first start
    asks this first, and works from the cache (``go_offline``) when the hub is not there.
    """
    try:
        huggingface_hub.get_session().head(constants.ENDPOINT, timeout=timeout)  # any answer will do
    except Exception as exc:  # httpx's connect and timeout errors, and whatever else stands in the way
        return str(exc) or type(exc).__name__
    return None


def go_offline() -> None:
    """From now on, in this process, only the hub's cache is read."""
    constants.HF_HUB_OFFLINE = True


def offline() -> bool:
    return constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")


def matches_quant(filename: str, quant: str) -> bool:
    """Whether a file name carries the quantization ``quant`` (Q4_K_M, q8_0, ...) as a word of its own."""
    return re.search(rf"(?<![A-Za-z0-9]){re.escape(quant)}(?![A-Za-z0-9])", Path(filename).stem, re.IGNORECASE) is not None


def is_projector(filename: str) -> bool:
    """Whether a GGUF file of a repository is a multimodal projector (llama.cpp's conversions name them mmproj-...)."""
    return "mmproj" in Path(filename).name.lower()


def _projector_order(filename: str) -> tuple[bool, str]:
    """Which of a repository's projectors to take first: a 16-bit one, then by name."""
    return not re.search(r"(?i)f16|bf16", filename), filename


def _gguf_names(repo_id: str, revision: Optional[str]) -> list[str]:
    """The GGUF files of ``repo_id``: the hub's listing; offline, or when the hub cannot be reached, those of the
    repository in the cache."""
    check_revision(revision)
    cached = sorted({f.filename for f in cached_files() if f.repo_id == repo_id})
    if offline():
        names = cached
    else:
        try:
            problem = unreachable(REACH_SECONDS)  # one try, not huggingface-hub's five backing off for 23 s
            if problem is not None:
                raise HubError(f"the hub at {constants.ENDPOINT} cannot be reached ({problem})")
            names = sorted(huggingface_hub.list_repo_files(repo_id, revision=revision))
        except Exception as exc:  # the hub raises many types: missing repository, auth, network
            if not any(n.endswith(".gguf") for n in cached):
                raise HubError(f"cannot list the files of {repo_id}: {exc}") from None
            names = cached  # a hub that cannot be reached does not keep a cached model from serving
    return [n for n in names if n.endswith(".gguf")]


def resolve(repo_id: str, file_or_quant: Optional[str] = None, revision: Optional[str] = None) -> str:
    """The GGUF model file of ``repo_id`` that ``file_or_quant`` names: a file name, a quantization, or none if the
    repository has only one model file (its projectors are not models)."""
    check_filename(file_or_quant)
    names = _gguf_names(repo_id, revision)
    ggufs = [n for n in names if not is_projector(n)]
    if file_or_quant and file_or_quant.endswith(".gguf"):  # a file name: it must be there
        chosen, what = [n for n in names if n == file_or_quant], f"file {file_or_quant!r}"
    elif file_or_quant:
        chosen, what = [n for n in ggufs if matches_quant(n, file_or_quant)], f"quantization {file_or_quant!r}"
    else:
        chosen, what = ggufs, "a file name or quantization"
    if len(chosen) == 1:
        return chosen[0]
    if not chosen:
        listing = ", ".join(ggufs) or "none"
        raise HubError(f"no GGUF file of {repo_id} matches {what}; its GGUF files: {listing}")
    raise HubError(f"several GGUF files of {repo_id} match: {', '.join(chosen)}; give {what} that names one")


def pull(
    repo_id: str, file_or_quant: Optional[str] = None, revision: Optional[str] = None,
    progress: Optional[Callable[[int, Optional[int]], None]] = None,
) -> Path:
    """Download a GGUF file into the hub's cache (or find it there) and check its SHA-256; its path.

    ``progress(done, total)`` is called as bytes arrive; without it,
    huggingface-hub's progress bar is shown.
    """
    filename = resolve(repo_id, file_or_quant, revision)
    tqdm_class = None if progress is None else _reporting(progress)
    try:
        path = Path(huggingface_hub.hf_hub_download(repo_id, filename, revision=revision, tqdm_class=tqdm_class))
    except Exception as exc:  # the hub raises many types: offline, missing, auth, network
        raise HubError(f"cannot get {filename} from {repo_id}: {exc}") from None
    verify(path)
    return path


def pull_with_projector(repo_id: str, file_or_quant: Optional[str] = None, revision: Optional[str] = None,
                        progress: Optional[Callable[[int, Optional[int]], None]] = None) -> tuple[Path, Optional[Path]]:
    """``pull`` a model file, then its repository's projector if it has one (as llama-server and Ollama fetch it
    with the model): both paths."""
    model = pull(repo_id, file_or_quant, revision, progress)
    return model, None if is_projector(model.name) else pull_projector(repo_id, None, revision, progress)


def pull_projector(repo_id: str, filename: Optional[str] = None, revision: Optional[str] = None,
                   progress: Optional[Callable[[int, Optional[int]], None]] = None) -> Optional[Path]:
    """Download the repository's multimodal projector (``filename``, or its only mmproj file; of several, the
    16-bit one) as ``pull`` does; None if it has none and none is named."""
    if filename is None:
        projectors = [n for n in _gguf_names(repo_id, revision) if is_projector(n)]
        if not projectors:
            return None
        filename = min(projectors, key=_projector_order)
    return pull(repo_id, filename, revision, progress)


def verify(path: Path) -> None:
    """Check a cached file against the SHA-256 its blob is named by; a file that fails is removed.

    Small files kept in git are named by their git hash instead: they are not checked.
    """
    blob = path.resolve()
    if not SHA256.fullmatch(blob.name):
        return
    stat = blob.stat()
    marker = cache_dir() / "verified" / blob.name  # a blob checked once is not read again while it stays the same
    stamp = f"{stat.st_size} {stat.st_mtime_ns}"
    if marker.is_file() and marker.read_text() == stamp:
        return
    digest = hashlib.sha256()
    with open(blob, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    if digest.hexdigest() != blob.name:
        path.unlink(missing_ok=True)
        blob.unlink(missing_ok=True)
        raise HubError(f"{path.name}: its SHA-256 is {digest.hexdigest()}, the hub's is {blob.name}; "
                       "the download was corrupted and is removed: pull it again")
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(stamp)


def _reporting(progress: Callable[[int, Optional[int]], None]) -> type:
    """A progress bar class that hands each update to ``progress`` instead of drawing."""

    class Reporting(hub_tqdm):
        def __init__(self, *args, **kwargs):
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)
            self._done = kwargs.get("initial", 0)
            self._total = kwargs.get("total")

        def update(self, n=1):
            self._done += n
            progress(self._done, self._total)

    return Reporting


def cached_files() -> list[CachedFile]:
    """The GGUF files in the hub's cache, newest revision of each repository first."""
    try:
        cache = huggingface_hub.scan_cache_dir()
    except huggingface_hub.CacheNotFound:
        return []
    found = []
    for repo in cache.repos:
        for revision in sorted(repo.revisions, key=lambda r: r.last_modified, reverse=True):
            for file in revision.files:
                if file.file_name.endswith(".gguf"):
                    filename = str(file.file_path.relative_to(revision.snapshot_path))
                    found.append(CachedFile(repo.repo_id, filename, revision.commit_hash, file.file_path, file.size_on_disk))
    return found


def cached_path(repo_id: str, file_or_quant: Optional[str] = None) -> Optional[Path]:
    """The cached GGUF file of ``repo_id`` that ``file_or_quant`` names (newest revision), without asking the hub."""
    files = [f for f in cached_files() if f.repo_id == repo_id]
    for file in files:
        if file.filename == file_or_quant or not is_projector(file.filename) and (
                file_or_quant is None or matches_quant(file.filename, file_or_quant)):
            return file.path
    return None


def cached_projector(repo_id: str, filename: Optional[str] = None) -> Optional[Path]:
    """The cached projector of ``repo_id`` (``filename``, or its 16-bit one, or any), without asking the hub."""
    projectors = sorted((f for f in cached_files() if f.repo_id == repo_id and is_projector(f.filename)),
                        key=lambda f: (f.filename != filename, *_projector_order(f.filename)))
    found = projectors[0] if projectors else None
    return found.path if found is not None and (filename is None or found.filename == filename) else None


def remove(repo_id: str, filename: Optional[str] = None) -> list[CachedFile]:
    """Remove a repository's cached GGUF files (all of them, or those named ``filename``); the ones removed."""
    files = cached_files()
    gone = [f for f in files if f.repo_id == repo_id and (filename is None or f.filename == filename)]
    if not gone:
        raise HubError(f"nothing of {repo_id}{' ' + filename if filename else ''} is in the hub's cache")
    kept_blobs = {f.path.resolve() for f in files if f not in gone}
    for file in gone:
        blob = file.path.resolve()
        file.path.unlink()
        if blob not in kept_blobs:
            blob.unlink(missing_ok=True)
    return gone
