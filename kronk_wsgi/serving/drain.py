"""A worker's shutdown: once it begins, nothing new is admitted; running work may finish until a deadline."""

import time
from typing import Optional


class ShuttingDown(RuntimeError):
    """The server is shutting down: no new work is taken."""


class Drain:
    """The shutdown state of one app, set when the worker is told to stop."""

    def __init__(self) -> None:
        self.deadline: Optional[float] = None  # monotonic time at which running work is cut

    @property
    def started(self) -> bool:
        return self.deadline is not None

    def begin(self, seconds: float) -> None:
        """Refuse new work from now on; cut running work ``seconds`` from now (the first call decides)."""
        if self.deadline is None:
            self.deadline = time.monotonic() + seconds

    def expired(self, now: float) -> bool:
        return self.deadline is not None and now >= self.deadline
