"""A download from the hub into its cache (a model file, and its repository's projector if it has one), in a
worker thread, seen from a stream as a few kinds of news.

The admin API and the Ollama API each write this news in their own frames.
A download stops when its client leaves (what it fetched stays in the hub's
cache, and the next pull of the file goes on from there) or when it has
taken ``load_timeout`` seconds.
"""

import dataclasses
import time
from typing import Callable, Iterator, Optional, Union

import gevent

from .. import hub
from ..serving import offload
from ..serving.channel import ThreadChannel

PROGRESS_INTERVAL = 0.25  # seconds between two progress reports


@dataclasses.dataclass(frozen=True)
class Progress:
    done: int
    total: Optional[int]


@dataclasses.dataclass(frozen=True)
class Pulled:
    path: str
    size: int


@dataclasses.dataclass(frozen=True)
class PullFailed:
    message: str


@dataclasses.dataclass(frozen=True)
class Quiet:
    """Nothing new for a keep-alive interval."""


News = Union[Progress, Pulled, PullFailed, Quiet]


def resolve(repo_id: str, file_or_quant: Optional[str], revision: Optional[str]) -> str:
    """The file a pull would fetch, looked up off the event loop; hub.HubError if there is none."""
    return offload.call(gevent.get_hub().threadpool, hub.resolve, repo_id, file_or_quant, revision)


def pull(repo_id: str, filename: str, revision: Optional[str], keepalive: float, timeout: float,
         client_gone: Callable[[], bool]) -> Iterator[News]:
    """Start downloading; its news until it ends with ``Pulled`` or ``PullFailed``. The download stops when the
    news is no longer read (its client left), or after ``timeout`` seconds."""
    channel = ThreadChannel()
    downloading = hub.Download()

    def progress(done: int, total: Optional[int]) -> None:
        downloading.progress(done, total)
        channel.put(Progress(done, total))

    def download() -> None:
        try:
            path, _ = hub.pull_with_projector(repo_id, filename, revision, progress=progress)
            channel.put(Pulled(str(path), path.stat().st_size))
        except hub.HubError as exc:
            channel.put(PullFailed(str(exc)))

    worker = gevent.get_hub().threadpool.spawn(download)
    worker.rawlink(lambda _: channel.close())
    return _news(channel, keepalive, timeout, client_gone, downloading)


def _news(channel: ThreadChannel, keepalive: float, timeout: float, client_gone: Callable[[], bool],
          download: hub.Download) -> Iterator[News]:
    sent = quiet_since = time.monotonic()
    deadline = sent + timeout
    ended = False
    try:
        while True:
            # A short wait: the channel closes when the download ends, and may miss its last wake-up.
            items = channel.take_all(PROGRESS_INTERVAL)
            now = time.monotonic()
            if items and isinstance(items[-1], (Pulled, PullFailed)):
                ended = True
                yield items[-1]
                return
            if now >= deadline:
                ended = True
                download.stop = "the pull took longer than load_timeout"
                yield PullFailed(f"the pull took longer than load_timeout ({timeout:g} s); what it "
                                 "fetched is kept, and the next pull goes on from there")
                return
            if client_gone():
                return
            if not items:
                if now - quiet_since >= keepalive:
                    quiet_since = now
                    yield Quiet()
                continue
            if now - sent >= PROGRESS_INTERVAL:
                sent = quiet_since = now
                yield items[-1]
    finally:
        if not ended:
            download.stop = "its client left"
