"""Calling blocking work in a thread pool from a greenlet, its exceptions raised in the caller only."""

from typing import Any, Callable

from gevent.threadpool import ThreadPool


def call(threads: ThreadPool, func: Callable[..., Any], *args: Any) -> Any:
    """``func(*args)`` in one of ``threads``, waited for here; what it raises is raised here.

    gevent would print each exception of a pool's task as a crash of that thread: a 400 for bad
    input would leave a traceback in the log.
    """
    return _value(threads.apply(_captured, (func, *args)))


class Running:
    """Work started in a thread pool: look whether it is done, wait for it a while, or get its value."""

    def __init__(self, threads: ThreadPool, func: Callable[..., Any], *args: Any) -> None:
        self._result = threads.spawn(_captured, func, *args)

    def ready(self) -> bool:
        return self._result.ready()

    def wait(self, timeout: float) -> None:
        self._result.wait(timeout)

    def get(self) -> Any:
        """Its value, waited for; what it raised is raised here."""
        return _value(self._result.get())


def _captured(func: Callable[..., Any], *args: Any) -> tuple[bool, Any]:
    try:
        return True, func(*args)
    except Exception as exc:  # handed to the caller, to raise
        return False, exc


def _value(outcome: tuple[bool, Any]) -> Any:
    done, value = outcome
    if not done:
        raise value
    return value
