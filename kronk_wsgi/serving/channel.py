"""Handing items from an OS worker thread to a greenlet without blocking the thread."""

from collections import deque
from typing import Any, Optional

import gevent
import gevent.event


class ThreadChannel:
    """Items put by one OS thread, taken by greenlets of the hub that made it.

    ``put`` never waits for the reader: a deque append (thread-safe) and a
    libev async send (the one watcher that may be poked from another thread).
    """

    def __init__(self) -> None:
        self._items: deque = deque()
        self._ready = gevent.event.Event()
        self._watcher = gevent.get_hub().loop.async_()
        self._watcher.start(self._ready.set)

    def put(self, item: Any) -> None:
        """Add an item; callable from any thread."""
        self._items.append(item)
        self._watcher.send()

    def take_all(self, timeout: Optional[float]) -> list:
        """Every waiting item, waiting up to ``timeout`` for one; [] on timeout."""
        if not self._items:
            self._ready.clear()
            if not self._items:
                self._ready.wait(timeout)
        items = []
        while self._items:
            items.append(self._items.popleft())
        return items

    def close(self) -> None:
        self._watcher.stop()
        self._watcher.close()
