"""Calling blocking work in a thread pool from a greenlet, its exceptions raised in the caller only."""

from typing import Any, Callable

from gevent.threadpool import ThreadPool


def call(threads: ThreadPool, func: Callable[..., Any], *args: Any) -> Any:
    """``func(*args)`` in one of ``threads``, waited for here; what it raises is raised here.

    gevent would print each exception of a pool's task as a crash of that thread: a 400 for bad
    input would leave a traceback in the log.
    """

    def captured() -> tuple[bool, Any]:
        try:
            return True, func(*args)
        except Exception as exc:  # handed to the caller, to raise
            return False, exc

    done, value = threads.apply(captured)
    if not done:
        raise value
    return value
