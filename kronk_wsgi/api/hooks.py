"""The onion around every API request: request id, logs, auth, body limit, errors, metrics."""

import hmac
import time
import uuid

import structlog
from flask import Flask, Response, g, request
from werkzeug.exceptions import HTTPException

from .errors import ANTHROPIC_PREFIX, ApiError, error_response
from .state import RequestRecord, state

log = structlog.get_logger("kronk_wsgi.http")

API_PREFIX = "/v1/"
OPEN_PATHS = ("/v1/liveness", "/v1/readiness")


def _is_api(path: str) -> bool:
    return path.startswith(API_PREFIX) or path == "/metrics"


def _check_auth() -> None:
    keys = state().settings.api_keys
    if not keys or request.path in OPEN_PATHS or request.path == "/metrics":
        return
    header = request.headers.get("Authorization", "")
    given = header[7:] if header[:7].lower() == "bearer " else request.headers.get("x-api-key", "")
    # Compare against every key, so the time taken does not tell which one nearly matched.
    matched = False
    for key in keys:
        matched |= hmac.compare_digest(given.encode(), key.encode())
    if not matched:
        raise ApiError(401, "invalid or missing API key", code="invalid_api_key")


def _start() -> None:
    if not _is_api(request.path):
        return
    structlog.contextvars.clear_contextvars()
    request_id = request.headers.get("X-Request-ID", "")[:128] or uuid.uuid4().hex
    rule = request.url_rule.rule if request.url_rule else "unmatched"
    g.kronk_record = RequestRecord(request_id=request_id, route=rule)
    structlog.contextvars.bind_contextvars(request_id=request_id)
    log.info("request started", method=request.method, path=request.path)
    request.max_content_length = state().settings.max_body_bytes
    _check_auth()


def _finish(response: Response) -> Response:
    rec = g.get("kronk_record")
    if rec is None:
        return response
    rec.status = response.status_code
    response.headers["X-Request-ID"] = rec.request_id
    if request.path.startswith(ANTHROPIC_PREFIX):
        # Anthropic's clients read the id here: the message's id once there is one.
        response.headers["request-id"] = response.headers["anthropic-request-id"] = rec.response_id or rec.request_id
    metrics = state().metrics
    response.call_on_close(lambda: _log_completed(rec, metrics))
    return response


def _log_completed(rec: RequestRecord, metrics) -> None:
    """Runs when the WSGI server closes the response: a stream's real end."""
    duration = time.monotonic() - rec.started
    stats = rec.stats
    outcome = rec.outcome or (stats.outcome if stats and stats.outcome else None)
    outcome = outcome or ("ok" if rec.status < 400 else "error")
    fields = dict(
        route=rec.route, model=rec.model, status=rec.status, outcome=outcome, duration=round(duration, 4),
        response_id=rec.response_id,
    )
    if stats is not None:
        fields.update(
            prompt_tokens=stats.prompt_tokens, completion_tokens=stats.completion_tokens,
            cached_tokens=stats.cached_tokens,
            time_to_first_token=None if stats.time_to_first_token is None else round(stats.time_to_first_token, 4),
            queue_wait=None if stats.queue_wait is None else round(stats.queue_wait, 4),
        )
    log.info("request completed", request_id=rec.request_id, **fields)
    metrics.requests.labels(rec.route, rec.model or "", str(rec.status), outcome).inc()
    metrics.request_duration.labels(rec.route).observe(duration)


def _api_error(error: ApiError):
    return error_response(error, request.path)


def _http_error(exc: HTTPException):
    if not _is_api(request.path):
        return exc  # the host app's pages keep their own error handling
    return error_response(ApiError.from_http(exc), request.path)


def _unexpected(exc: Exception):
    if isinstance(exc, HTTPException):
        return _http_error(exc)
    if not _is_api(request.path):
        raise exc
    log.exception("unexpected error")
    return error_response(ApiError(500, "internal server error", code="server_error"), request.path)


def install(app: Flask) -> None:
    """Wire the onion into an app; it acts on API paths only."""
    app.before_request(_start)
    app.after_request(_finish)
    app.register_error_handler(ApiError, _api_error)
    app.register_error_handler(HTTPException, _http_error)
    app.register_error_handler(Exception, _unexpected)
