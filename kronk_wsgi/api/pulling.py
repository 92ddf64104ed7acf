"""A download from the hub into its cache, in a worker thread, seen from a stream as a few kinds of news.

The admin API and the Ollama API each write this news in their own frames.
A client that leaves does not stop the download: it finishes in the
background.
"""

import dataclasses
import time
from typing import Iterator, Optional, Union

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


def pull(repo_id: str, filename: str, revision: Optional[str], keepalive: float) -> Iterator[News]:
    """Start downloading; its news until it ends with ``Pulled`` or ``PullFailed``."""
    channel = ThreadChannel()

    def download() -> None:
        try:
            path = hub.pull(repo_id, filename, revision, progress=lambda done, total: channel.put(Progress(done, total)))
            channel.put(Pulled(str(path), path.stat().st_size))
        except hub.HubError as exc:
            channel.put(PullFailed(str(exc)))

    worker = gevent.get_hub().threadpool.spawn(download)
    worker.rawlink(lambda _: channel.close())
    return _news(channel, keepalive)


def _news(channel: ThreadChannel, keepalive: float) -> Iterator[News]:
    sent = quiet_since = time.monotonic()
    while True:
        # A short wait: the channel closes when the download ends, and may miss its last wake-up.
        items = channel.take_all(PROGRESS_INTERVAL)
        now = time.monotonic()
        if not items:
            if now - quiet_since >= keepalive:
                quiet_since = now
                yield Quiet()
            continue
        last = items[-1]
        if isinstance(last, (Pulled, PullFailed)):
            yield last
            return
        if now - sent >= PROGRESS_INTERVAL:
            sent = quiet_since = now
            yield last
