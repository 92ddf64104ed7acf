"""The onion around every API request: request id, logs, auth, body limit, errors, metrics.

It is installed on kronk_wsgi's own blueprint, so it acts on its routes only:
a host app's pages, error handlers and logging stay the host's. Paths below
are relative to the blueprint's url_prefix.
"""

import hmac
import re
import socket
import time
import urllib.parse
import uuid

import structlog
from flask import Blueprint, Response, current_app, g, request
from werkzeug.exceptions import HTTPException, MethodNotAllowed, NotFound, default_exceptions

from ..config import host_name
from .errors import ApiError
from .protocol import Protocols
from .response_store import owner_of
from .state import KronkState, RequestRecord, api_path, state

log = structlog.get_logger("kronk_wsgi.http")


def _check_host() -> None:
    """400 for a Host header the server does not answer to (allowed_hosts): a page on another name that
    resolves to this machine (DNS rebinding) sends its own. Probes are answered whatever their Host (a
    balancer's or an orchestrator's name the instance by its address)."""
    allowed = state().settings.allowed_hosts
    if not allowed or "*" in allowed or api_path() in state().protocols.open_paths:
        return
    host = request.host.lower()
    if host_name(host) not in allowed:
        raise ApiError(400, f"the Host {host[:100]!r} is not one this server answers to (allowed_hosts)",
                       code="host_not_allowed")


# Web origins of this machine, allowed by default as Ollama allows them: local web apps on any port, and the
# pages of desktop apps, editors' webviews and local files.
LOCAL_ORIGINS = (
    re.compile(r"https?://(localhost|127\.0\.0\.1|0\.0\.0\.0|\[::1\])(:[0-9]{1,5})?\Z"),
    re.compile(r"(app|file|tauri|vscode-webview)://[^\s]*\Z"),
)

def _check_origin() -> None:
    """403 for a browser's cross-site request: an Origin that is neither this server's nor an allowed CORS origin.

    A browser always sends Origin on a cross-site POST (a page elsewhere unloading a model through /admin of
    a server without keys); curl and the SDKs send none. The scheme is not compared: behind a TLS proxy the
    server sees plain HTTP. Pages of this machine (LOCAL_ORIGINS) are allowed, as Ollama allows them.
    """
    origin = request.headers.get("Origin")
    if origin is None:
        return
    allowed = state().settings.cors_origins
    if ("*" in allowed or origin in allowed or urllib.parse.urlsplit(origin).netloc == request.host
            or any(local.fullmatch(origin) for local in LOCAL_ORIGINS)):
        return
    raise ApiError(403, f"requests from the web origin {origin[:200]!r} are not allowed (cors_origins)",
                   code="origin_not_allowed")


def _check_coding() -> None:
    """501 for a body in a transfer coding other than chunked (``gzip, chunked``): it would be read as plain."""
    codings = [c.strip().lower() for c in request.environ.get("HTTP_TRANSFER_ENCODING", "").split(",") if c.strip()]
    if any(coding not in ("chunked", "identity") for coding in codings):
        raise ApiError(501, "request bodies are taken plain or chunked, in no other transfer coding",
                       code="transfer_coding_not_supported")


def _check_auth() -> None:
    kronk = state()
    settings, protocols = kronk.settings, kronk.protocols
    path = api_path()
    # A browser's CORS preflight never carries a key: it asks whether the real request may be sent.
    if path in protocols.open_paths or not protocols.for_path(path).needs_key or request.method == "OPTIONS":
        return
    if path.startswith(protocols.admin_paths):
        if not settings.admin_keys and settings.api_keys:
            raise ApiError(403, "the admin API is closed: this server has API keys but no admin keys (admin_keys)",
                           code="admin_closed")
        keys, what = settings.admin_keys, "admin key"
    else:
        keys, what = settings.api_keys, "API key"
    if not keys:
        g.kronk_record.admin = not settings.api_keys
        return
    header = request.headers.get("Authorization", "")
    given = header[7:] if header[:7].lower() == "bearer " else request.headers.get("x-api-key", "")
    if not _one_of(given, keys):
        raise ApiError(401, f"invalid or missing {what}", code="invalid_api_key")
    g.kronk_record.owner = owner_of(given)
    g.kronk_record.admin = _one_of(given, settings.admin_keys)


def _one_of(given: str, keys: list[str]) -> bool:
    """Whether ``given`` is one of ``keys``, compared with every one: the time taken does not tell which one
    nearly matched."""
    matched = False
    for key in keys:
        matched |= hmac.compare_digest(given.encode(), key.encode())
    return matched


def _start() -> None:
    state().start()
    structlog.contextvars.clear_contextvars()
    request_id = request.headers.get("X-Request-ID", "")[:128] or uuid.uuid4().hex
    rule = request.url_rule.rule if request.url_rule else "unmatched"  # a bounded label: never the raw path
    g.kronk_record = RequestRecord(request_id=request_id, route=rule)
    state().open_requests.add(g.kronk_record)
    structlog.contextvars.bind_contextvars(request_id=request_id)
    log.info("request started", method=request.method, path=request.path, client=request.remote_addr)
    request.max_content_length = state().settings.max_body_bytes
    _check_host()
    _check_origin()
    _check_coding()
    _check_auth()


def _finish(response: Response) -> Response:
    rec = g.get("kronk_record")
    if rec is None:
        return response
    rec.status = response.status_code
    response.headers["X-Request-ID"] = rec.request_id
    if rec.not_offered:
        response.headers["Kronk-Tools-Not-Offered"] = ", ".join(rec.not_offered)
    protocol = state().protocols.for_path(api_path())
    if protocol.headers is not None:
        protocol.headers(response, rec)
    kronk = state()
    response.call_on_close(lambda: _log_completed(rec, kronk))
    if response.status_code == 408:
        # The rest of the body may never come: hang up, or the server would wait to read past it.
        sock = request.environ.get("gunicorn.socket")
        if sock is not None:
            response.call_on_close(lambda: _hang_up(sock))
    return response


def _close_session(_exc) -> None:
    """A session that no response took over (the view failed after starting it) gives back its place and slot."""
    rec = g.get("kronk_record")
    if rec is not None and rec.session is not None:
        rec.session.close()
        rec.session = None


def _hang_up(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # already gone


def _log_completed(rec: RequestRecord, kronk: KronkState) -> None:
    """Runs when the WSGI server closes the response: a stream's real end."""
    if rec not in kronk.open_requests:
        return  # logged already: cut by a dying worker
    kronk.open_requests.discard(rec)
    metrics = kronk.metrics
    duration = time.monotonic() - rec.started
    stats = rec.stats
    outcome = rec.outcome or (stats.outcome if stats and stats.outcome else None)
    outcome = outcome or ("ok" if rec.status < 400 else "error")
    fields = dict(
        route=rec.route, model=rec.model, status=rec.status, outcome=outcome, duration=round(duration, 4),
        response_id=rec.response_id,
    )
    if rec.not_offered:
        fields["tools_not_offered"] = list(rec.not_offered)
    if rec.error:
        fields["error"] = rec.error
    if stats is not None:
        fields.update(
            prompt_tokens=stats.prompt_tokens, completion_tokens=stats.completion_tokens,
            cached_tokens=stats.cached_tokens,
            time_to_first_token=None if stats.time_to_first_token is None else round(stats.time_to_first_token, 4),
            queue_wait=None if stats.queue_wait is None else round(stats.queue_wait, 4),
        )
        if stats.drafted:
            fields.update(drafted_tokens=stats.drafted, accepted_tokens=stats.accepted)
    log.info("request completed", request_id=rec.request_id, **fields)
    metrics.requests.labels(rec.route, rec.model or "", str(rec.status), outcome).inc()
    metrics.request_duration.labels(rec.route).observe(duration)


def log_cut(kronk: KronkState, outcome: str) -> None:
    """Log every open request of a worker about to die as ended by ``outcome``: its response is cut."""
    for rec in list(kronk.open_requests):
        rec.outcome = outcome
        _log_completed(rec, kronk)


def _api_error(error: ApiError):
    rec = g.get("kronk_record")
    if rec is not None:  # one log line says what went wrong: the request's own, at its end
        rec.error = f"{error.param}: {error.message[:300]}" if error.param else error.message[:300]
    return state().protocols.for_path(api_path()).error_response(error)


def _http_error(exc: HTTPException):
    return _api_error(ApiError.from_http(exc))


def _unexpected(exc: Exception):
    log.exception("unexpected error")
    return _api_error(ApiError(500, "internal server error", code="server_error"))


_METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE"]


def _unknown_route(rest: str):
    """Any other path below a protocol's ``unknown_below``: 405 if a route takes it with another method, else 404,
    in the protocol's error shape."""
    adapter = current_app.url_map.bind_to_environ(request.environ)
    allowed = []
    for method in _METHODS:
        try:
            endpoint, _ = adapter.match(request.path, method=method)
        except HTTPException:
            continue
        if endpoint != request.endpoint:
            allowed.append(method)
    if allowed:
        raise MethodNotAllowed(valid_methods=allowed)
    raise NotFound()


def install(bp: Blueprint, protocols: Protocols) -> None:
    """Wire the onion into kronk_wsgi's blueprint: its requests, its errors, the protocols' unknown paths."""
    bp.before_request(_start)
    bp.after_request(_finish)
    bp.teardown_request(_close_session)
    bp.register_error_handler(ApiError, _api_error)
    # By status code too: Flask prefers an app's handler for a code (a host's 404 page) to a
    # blueprint's handler for a class, but a blueprint's handler for a code to the app's.
    for code in default_exceptions:
        bp.register_error_handler(code, _http_error)
    bp.register_error_handler(HTTPException, _http_error)
    bp.register_error_handler(Exception, _unexpected)
    for below in dict.fromkeys(protocols.unknown_below):
        bp.add_url_rule(f"{below}<path:rest>", f"unknown_route{below.replace('/', '_')}", _unknown_route,
                        methods=_METHODS)
