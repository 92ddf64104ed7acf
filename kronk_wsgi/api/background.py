"""Background responses: a Responses request answered after its POST returned, polled with GET, cancelled with
POST .../cancel.

The POST checks and plans the request (its failures are HTTP errors), stores the response as ``queued`` and
answers at once (or streams it, and the generation goes on if the client leaves). A greenlet of the worker then
waits for an admission place as a request would, stores the response ``in_progress``, runs it, and stores it
``completed``, ``incomplete``, ``failed`` or ``cancelled``. A cancel marks the stored response cancelled: the
store is shared by every worker, so the one running it sees that within CANCEL_POLL_SECONDS (its own cancels
at once), stops before the next token and frees its slot; a cancelled response stays cancelled. The run
stores its stream's events as they go out, so that a client on any worker can read the stream again from
where it left it (``resumed``). A worker that stops waits for its background responses as for its streams,
and stores those it must cut as failed.
"""

import os
import socket
import time
import uuid
from typing import Callable, Iterator, Optional

import gevent
import gevent.queue
import structlog
from flask import Response, jsonify

from ..serving import offload
from ..serving.drain import ShuttingDown
from ..serving.events import ChoiceEnd, Event, Failed
from ..serving.scheduler import ClientGone, Overloaded, QueueFull
from ..serving.session import Session
from .errors import ApiError
from .response import Encoder, watched
from .state import KronkState

log = structlog.get_logger("kronk_wsgi.background")

CANCEL_POLL_SECONDS = 1.0
HEARTBEAT_SECONDS = 1.0  # how often a worker says in the store that its runs are alive (see ORPHAN_SECONDS)
BACKGROUND_RETRY_SECONDS = 10  # Retry-After of a background response refused for the caps
EVENTS_SAVE_SECONDS = 0.25  # how often a run stores its new stream events, and a resumed stream looks for them
UNFINISHED = ("queued", "in_progress")
_END = object()  # the last item of a live stream's queue


class BackgroundEncoder(Encoder):
    """An encoder whose response a background run keeps: the response object so far (``base`` and its
    ``output`` items), its stream events numbered (``sequence``, the next number), and how it ended."""

    base: dict
    output: list[dict]
    sequence: int
    end: ChoiceEnd


class BackgroundRun:
    """One background response, run by this worker. Made before its request is planned: it takes its place under
    the caps at once (a 429 past them), and is ``start``ed or ``forget``-ten."""

    def __init__(self, kronk: KronkState, response_id: str, owner: str) -> None:
        settings = kronk.settings
        runs = list(kronk.background.values())
        if len(runs) >= settings.max_background:
            raise _refused(f"{len(runs)} background responses are running or queued on this worker")
        if sum(run.owner == owner for run in runs) >= settings.max_key_background:
            raise _refused(f"this API key has {settings.max_key_background} background responses running or "
                           "queued already")
        self.kronk = kronk
        self.response_id = response_id
        self.owner = owner
        self.store_response: Callable[[dict], None] = lambda response: None
        self.cancelled_here = False  # set by a cancel this worker took
        self._looked = 0.0
        self.listener: Optional[gevent.queue.Queue] = None  # the live stream's frames, while its client reads
        self.greenlet: Optional[gevent.Greenlet] = None
        kronk.background[response_id] = self

    def forget(self) -> None:
        """The run will not start (its request failed before the commit): give its place back."""
        self.kronk.background.pop(self.response_id, None)

    def cancelled(self) -> bool:
        """Whether the response was cancelled (or deleted): here at once, from another worker within
        CANCEL_POLL_SECONDS."""
        now = time.monotonic()
        if not self.cancelled_here and now - self._looked >= CANCEL_POLL_SECONDS:
            self._looked = now
            kronk = self.kronk
            found = offload.call(kronk.store_thread, kronk.responses.get, self.response_id, self.owner)
            self.cancelled_here = found is None or found["status"] == "cancelled"
        return self.cancelled_here

    def start(self, admit: Callable[[Callable[[], bool]], Session], encoder: BackgroundEncoder,
              store_response: Callable[[dict], None], stream: bool) -> Response:
        """Say in the store that this worker runs the response, store it as queued (``store_response`` stores the
        response object as it goes), run it in a greenlet, and answer the POST: the queued response, or the stream
        of its events."""
        kronk = self.kronk
        self.store_response = store_response
        offload.call(kronk.store_thread, kronk.responses.run_started, self.response_id, worker_id())
        _start_heartbeat(kronk)
        base = encoder.base
        self._store(base)
        if stream:
            self.listener = gevent.queue.Queue()
        self.greenlet = gevent.spawn(self._run, admit, encoder)
        return encoder.protocol.stream(watched(self._listen())) if stream else jsonify(base)

    def _listen(self) -> Iterator[str]:
        try:
            for frame in self.listener:
                if frame is _END:
                    return
                yield frame
        finally:
            self.listener = None  # the client went: the response goes on without it

    def _run(self, admit: Callable[[Callable[[], bool]], Session], encoder: BackgroundEncoder) -> None:
        base, started, status = encoder.base, time.monotonic(), "failed"
        session: Optional[Session] = None
        try:
            try:
                session = admit(self.cancelled)
            except (Overloaded, QueueFull, ShuttingDown) as exc:
                code = "server_error" if isinstance(exc, ShuttingDown) else "rate_limit_exceeded"
                self._store({**base, "status": "failed", "error": {"code": code, "message": str(exc)}})
                return
            except ClientGone:
                status = "cancelled"
                self._store({**base, "status": status})
                return
            base["status"] = "in_progress"
            self._store(base)
            failure = self._stream(session, encoder)
            status = self._end(session, encoder, failure)
        except gevent.GreenletExit:
            self._store({**base, "status": "failed", "output": encoder.output,
                         "error": {"code": "server_error", "message": "the server stopped before the response "
                                                                     "was done"}})
        finally:
            if session is not None:
                session.close()
            self._finish(status, session, time.monotonic() - started)

    def _stream(self, session: Session, encoder: BackgroundEncoder) -> Optional[Failed]:
        """Run the session through the encoder (to the live client, if one reads); its failure, if it failed."""
        failure: list[Failed] = []

        def events() -> Iterator[Event]:
            for event in session:
                if isinstance(event, Failed):
                    failure.append(event)
                yield event

        keepalive = encoder.protocol.framing.keepalive
        kept: list[tuple[int, str]] = []  # events not in the store yet
        saved = time.monotonic()
        for frame in encoder.frames(events()):
            if self.listener is not None:
                self.listener.put(frame)
            if frame != keepalive:
                kept.append((encoder.sequence - 1, frame))
            if kept and time.monotonic() - saved >= EVENTS_SAVE_SECONDS:
                self._save_events(kept)
                kept, saved = [], time.monotonic()
        self._save_events(kept)
        return failure[0] if failure else None

    def _save_events(self, frames: list[tuple[int, str]]) -> None:
        """Store stream events, for clients that resume the stream (GET ...?stream=true)."""
        kronk = self.kronk
        try:
            offload.call(kronk.store_thread, kronk.responses.add_events, self.response_id, frames)
        except Exception as exc:  # sqlite3's and the file system's errors
            log.error("background events not stored", response_id=self.response_id,
                      error=f"{type(exc).__name__}: {exc}")

    def _end(self, session: Session, encoder: BackgroundEncoder, failure: Optional[Failed]) -> str:
        """Store how a run that was admitted ended (a finished one its encoder stored); its status."""
        if session.stats.outcome == "client_gone":
            self._store({**encoder.base, "status": "cancelled", "output": encoder.output})
            return "cancelled"
        if failure is not None:
            self._store({**encoder.base, "status": "failed", "output": encoder.output,
                         "error": {"code": "server_error", "message": failure.message}})
            return "failed"
        return "incomplete" if encoder.end.reason == "length" else "completed"

    def _store(self, response: dict) -> None:
        try:
            self.store_response(response)
        except ApiError as exc:
            log.error("background response not stored", response_id=self.response_id, error=exc.message)

    def _finish(self, status: str, session: Optional[Session], seconds: float) -> None:
        """Log and count how the run ended; forget it."""
        kronk = self.kronk
        kronk.background.pop(self.response_id, None)
        try:
            offload.call(kronk.store_thread, kronk.responses.run_ended, self.response_id)
        except Exception as exc:  # sqlite3's and the file system's errors: its heartbeat stops all the same
            log.error("background run not ended in the store", response_id=self.response_id,
                      error=f"{type(exc).__name__}: {exc}")
        if self.listener is not None:
            self.listener.put(_END)
        stats = session.stats if session is not None else None
        model = session.model.id if session is not None else ""
        self.kronk.metrics.background_responses.labels(model, status).inc()
        log.info("background response ended", response_id=self.response_id, model=model or None, status=status,
                 outcome=stats.outcome if stats else None, duration=round(seconds, 4),
                 prompt_tokens=stats.prompt_tokens if stats else None,
                 completion_tokens=stats.completion_tokens if stats else None)


def _refused(why: str) -> ApiError:
    return ApiError(429, f"too many background responses: {why}; retry later", code="rate_limit_exceeded",
                    headers={"Retry-After": str(BACKGROUND_RETRY_SECONDS)})


_worker: tuple[int, str] = (0, "")


def worker_id() -> str:
    """This worker process, as the store names it (host, pid and a random part: a pid is reused)."""
    global _worker
    if _worker[0] != os.getpid():
        _worker = (os.getpid(), f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}")
    return _worker[1]


def _start_heartbeat(kronk: KronkState) -> None:
    """Beat for this worker's runs while it has any (and mark failed the runs of workers that stopped)."""
    if kronk.beating:
        return
    kronk.beating = True

    def beat() -> None:
        try:
            while kronk.background:
                try:
                    offload.call(kronk.store_thread, kronk.responses.beat, worker_id())
                except Exception as exc:  # sqlite3's and the file system's errors: tried again at the next beat
                    log.error("background heartbeat not stored", error=f"{type(exc).__name__}: {exc}")
                gevent.sleep(HEARTBEAT_SECONDS)
        finally:
            kronk.beating = False

    gevent.spawn(beat)


def resumed(kronk: KronkState, owner: str, response_id: str, after: int, keepalive: float,
            keepalive_frame: str) -> Iterator[str]:
    """A background response's stream from the event after sequence number ``after``, as the store has it:
    what is there, then what the run adds, until the response ends (keep-alives while it is quiet)."""
    quiet_since, ending = time.monotonic(), False
    while True:
        frames = offload.call(kronk.store_thread, kronk.responses.events, response_id, owner, after)
        for after, frame in frames:
            yield frame
        now = time.monotonic()
        quiet_since = now if frames else quiet_since
        if ending:
            return
        found = offload.call(kronk.store_thread, kronk.responses.get, response_id, owner)
        ending = found is None or found["status"] not in UNFINISHED  # one more look: its last events follow
        if now - quiet_since >= keepalive:
            yield keepalive_frame
            quiet_since = now
        gevent.sleep(EVENTS_SAVE_SECONDS)


def wait_for_runs(kronk: KronkState, timeout: float) -> None:
    """At a worker's stop: let its background responses finish for up to ``timeout`` seconds, then cut the rest
    (each stored as failed)."""
    greenlets = [run.greenlet for run in list(kronk.background.values()) if run.greenlet is not None]
    gevent.joinall(greenlets, timeout=timeout)
    gevent.killall([g for g in greenlets if not g.dead], timeout=5)

