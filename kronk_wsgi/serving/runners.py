"""Models run by a runner process (``runner = "process"``): one process per model and host owns the weights, the
slots, the batches and the prompt cache's RAM tier, and serves vLLM's engine protocol on a Unix socket to every
worker process that has the model loaded (its fronts), whose engine is then the gRPC engine.

A runner and its fronts meet through files in the runner directory (``RunnerFiles``),
with flock(2) locks, which the kernel drops when a process ends, however it ends:

- ``.lock`` is held exclusively by the runner for its whole life. A front that can
  take it knows no runner runs and starts one, which inherits the lock.
- ``.users`` is held shared by each front that has the model. A runner that can take
  it exclusively has no front left, and stops.
- ``.ready`` is written once the runner has loaded the model, ``.failed`` (the
  reason) if it could not; ``.sock`` is its socket.

So a runner that dies is started again by the next request of any front (its
streams end with the protocol's in-band error), and a front that dies lets go of
the runner with its locks (its calls are cancelled with its connections).
"""

import dataclasses
import fcntl
import hashlib
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional

import structlog
from gevent import monkey

from ..config import ModelSpec, Settings
from ..engine import grpc_engine
from ..engine.base import Cancelled, Engine, EngineError

log = structlog.get_logger("kronk_wsgi.runners")

POLL_SECONDS = 0.05  # how often a front waiting for its runner looks again
SETTINGS_VARIABLE = "KRONK_RUNNER_SETTINGS"  # the runner's settings, as JSON, in its environment
_process_dir: Optional[str] = None  # the runner directory of an embedded app that sets none
# A front waits for its runner in a worker thread, never on the event loop: the real calls, not gevent's.
_sleep = monkey.get_original("time", "sleep")
_waitpid = monkey.get_original("os", "waitpid")
_posix_spawn = monkey.get_original("os", "posix_spawn")


@dataclasses.dataclass(frozen=True)
class RunnerFiles:
    """One model's files in the runner directory: its runner's, and (``workers``) the gRPC workers it was given at
    run time."""

    folder: Path
    model_id: str

    def path(self, suffix: str) -> Path:
        return self.folder / f"{hashlib.sha256(self.model_id.encode()).hexdigest()[:16]}.{suffix}"

    @property
    def socket(self) -> Path:
        return self.path("sock")

    def mark_ready(self) -> None:
        self.path("ready").write_text(str(os.getpid()))

    def mark_failed(self, reason: str) -> None:
        self.path("failed").write_text(reason)

    def unused(self, users: int) -> bool:
        """Whether no front holds the model (``users``: the runner's descriptor of ``.users``); taking the lock
        that tells is let go at once."""
        try:
            fcntl.flock(users, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        fcntl.flock(users, fcntl.LOCK_UN)
        return True


def runner_dir(settings: Settings) -> Path:
    """The settings' runner directory, or this process's own."""
    global _process_dir
    if settings.runner_dir:
        return Path(settings.runner_dir)
    if _process_dir is None:
        _process_dir = tempfile.mkdtemp(prefix="kronk-runners-")
    return Path(_process_dir)


class RunnerLease:
    """A front's hold on a model's runner: the runner started if none runs, kept while the lease is held. Its
    blocking calls are for worker threads."""

    def __init__(self, model_id: str, spec: ModelSpec, settings: Settings) -> None:
        self.files = RunnerFiles(runner_dir(settings), model_id)
        self.files.folder.mkdir(parents=True, exist_ok=True)
        # The runner's settings: these, its model run inline and the default, its one process the host's engine
        # (its decode calls' threads are not shared with other workers').
        inline = settings.model_copy(update={
            "default_model": model_id, "workers": 1,
            "models": {**settings.models, model_id: spec.model_copy(update={"runner": "inline"})}})
        self._settings = inline.model_dump_json()
        self._starting: Optional[int] = None  # the runner this front started, until it is ready (its pid)
        self._started: list[int] = []  # the runners this front started that have not been reaped
        self._users = os.open(self.files.path("users"), os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(self._users, fcntl.LOCK_SH)  # waits out a runner that is stopping (it holds it a moment)

    @property
    def pid(self) -> Optional[int]:
        """The running runner's process id, if it is ready."""
        try:
            return int(self.files.path("ready").read_text())
        except (OSError, ValueError):
            return None

    def ensure(self, timeout: float, cancelled: Callable[[], bool] = lambda: False) -> None:
        """Blocking: return once the model's runner is ready, starting one if none runs; EngineError if the one this
        front started fails, or none is ready within ``timeout`` seconds, Cancelled once ``cancelled()``."""
        deadline = time.monotonic() + timeout
        while not cancelled():
            self._reap()  # the one this front started failed: why, before another is started
            lock = os.open(self.files.path("lock"), os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # a runner runs, or is starting
                os.close(lock)
                if self.files.path("ready").exists():
                    self._starting = None
                    return
            else:
                self._start(lock)
            if time.monotonic() >= deadline:
                raise EngineError(f"the model's runner was not ready within {timeout:g} s")
            _sleep(POLL_SECONDS)
        raise Cancelled()

    def _start(self, lock: int) -> None:
        """Start a runner, which inherits ``lock`` (taken here) and holds it while it lives."""
        for suffix in ("ready", "failed", "sock"):
            self.files.path(suffix).unlink(missing_ok=True)
        command = [sys.executable, "-m", "kronk_wsgi.grpc_worker.runner", "--model", self.files.model_id,
                   "--folder", str(self.files.folder)]
        try:
            os.set_inheritable(lock, True)
            self._starting = _posix_spawn(
                sys.executable, command, {**os.environ, SETTINGS_VARIABLE: self._settings}, setsid=True,
                file_actions=[(os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0)])
        finally:
            os.close(lock)
        self._started.append(self._starting)
        log.info("runner started", model=self.files.model_id, pid=self._starting)

    def _reap(self) -> None:
        """Reap the runners this front started that have ended; EngineError, with its reason, if one ended before
        it was ready."""
        for pid in list(self._started):
            done, status = _waitpid(pid, os.WNOHANG)
            if done == 0:
                continue
            self._started.remove(pid)
            if pid == self._starting:
                self._starting = None
                try:
                    reason = self.files.path("failed").read_text()
                except OSError:
                    reason = (f"it exited with status {os.waitstatus_to_exitcode(status)} before the model loaded "
                              f"(its log says why)")
                raise EngineError(f"the model's runner failed: {reason}")

    def release(self) -> None:
        """Let go of the runner: it stops once no front holds the model."""
        if self._users >= 0:
            os.close(self._users)
            self._users = -1
        self._starting = None
        self._reap()


def runner_engine(model_id: str, spec: ModelSpec, path: Path, settings: Settings) -> Engine:
    """Blocking: the engine of a model its runner runs, the runner started if none runs."""
    if not grpc_engine.available():
        raise EngineError(f'runner "process" speaks gRPC to its runner: {grpc_engine.KIND.missing}')
    from .runner_engine import RunnerEngine  # gRPC is an optional extra

    lease = RunnerLease(model_id, spec, settings)
    try:
        lease.ensure(settings.load_timeout)
        return RunnerEngine(model_id, path, spec.context_length, lease, settings.load_timeout)
    except BaseException:
        lease.release()
        raise
