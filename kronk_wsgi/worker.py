"""kronk_wsgi's gunicorn worker: the gevent worker, answering in the API's error shape, logging what it cuts,
and waiting for background responses."""

import http
import json
import logging
import os
import sys
import time

import gevent
import structlog
from gunicorn import util
from gunicorn.http import errors
from gunicorn.workers.ggevent import GeventWorker

# Loaded by gunicorn's master, before its workers patch the standard library: nothing that imports the app.
from .api.errors import ApiError, openai_error_body

log = structlog.get_logger("kronk_wsgi.http")

BACKGROUND_GRACE_SECONDS = 5  # a stopping worker's background responses have this long to be stored

# Statuses of the requests gunicorn cannot parse, where they are not 400.
_STATUS = {
    errors.LimitRequestLine: 414,
    errors.LimitRequestHeaders: 431,
    errors.ExpectationFailed: 417,
    errors.UnsupportedTransferCoding: 501,
    errors.ForbiddenProxyRequest: 403,
}


def error_answer(status: int, message: str) -> bytes:
    """A whole HTTP response with an OpenAI-shaped JSON error: what gunicorn answers itself says so too."""
    reason = http.HTTPStatus(status).phrase
    code = reason.lower().replace(" ", "_").replace("-", "_")
    body = json.dumps(openai_error_body(ApiError(status, message, code=code))).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\nConnection: close\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n")
    return head.encode("latin-1") + body


class Worker(GeventWorker):
    """gunicorn's gevent worker, with three changes: a request gunicorn refuses before the app sees it (a request
    line over limit_request_line, a malformed header) gets a JSON error and one log line, not an HTML page and a
    traceback; the requests a dying worker cuts (gunicorn's timeout, a quick shutdown) are logged as cut; and a
    stopping worker waits for its background responses as for its streams."""

    quitting = False  # a quick shutdown has begun

    def handle_error(self, req, client, addr, exc) -> None:
        if not isinstance(exc, errors.ParseException) or isinstance(exc, errors.ConfigurationProblem):
            super().handle_error(req, client, addr, exc)  # the server's fault: gunicorn logs the traceback
            return
        status = next((code for kind, code in _STATUS.items() if isinstance(exc, kind)), 400)
        message = str(exc)[:300] or type(exc).__name__
        log.warning("request refused", status=status, client=(addr or ("",))[0], error=message)
        try:
            util.write_nonblock(client, error_answer(status, message))
        except OSError:
            pass  # the client is gone

    def run(self) -> None:
        super().run()  # until the requests are done, or the graceful timeout
        kronk = getattr(self.wsgi, "extensions", {}).get("kronk")
        if kronk is None:
            return
        if kronk.background:
            from .api.background import wait_for_runs

            # Their sessions end at the drain's deadline, as streams do: then they are stored, or cut.
            deadline = kronk.pool.drain.deadline or time.monotonic()
            wait_for_runs(kronk, max(0.0, deadline - time.monotonic()) + BACKGROUND_GRACE_SECONDS)
        kronk.pool.write_now()  # the last answers' prompt-cache entries, for the next start

    def handle_abort(self, sig, frame) -> None:
        self._log_cut("worker_aborted")  # gunicorn's timeout: the event loop was blocked past it
        super().handle_abort(sig, frame)

    def handle_quit(self, sig, frame) -> None:
        """SIGINT or SIGQUIT: stop now, without the drain: the cut streams logged, the logs flushed, the process
        ended there. gunicorn's gevent worker ends a greenlet of its own with SystemExit, which gevent reports as
        a traceback, and the interpreter's exit after it could wait on the engines' native threads past the
        point where signals are handled (the master then waits its whole grace period). Told again while
        stopping (a terminal's Ctrl-C reaches the worker and the master, which passes it on), it ends at once."""
        if self.quitting:
            _exit_now()
        self.quitting = True
        self._log_cut("worker_stopped")  # here, before a second signal can end the process
        self.alive = False
        gevent.spawn(self._quit)  # out of the signal handler, which may run in the event loop

    def _quit(self) -> None:
        try:
            self.cfg.worker_int(self)
        finally:
            _exit_now()

    def _log_cut(self, outcome: str) -> None:
        kronk = getattr(getattr(self, "wsgi", None), "extensions", {}).get("kronk")  # None before the app loads
        if kronk is not None:
            from .api.hooks import log_cut

            log_cut(kronk, outcome)


def _exit_now() -> None:
    logging.shutdown()  # flushes every log handler
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
