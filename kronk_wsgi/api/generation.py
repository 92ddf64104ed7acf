"""Everything before the commit that every generating endpoint shares.

Model lookup and load, admission, prompt preparation and the context check
all happen here, so their failures are real HTTP errors.
"""

import select
import socket
import time
from typing import Callable, Optional

from flask import request

from ..engine.chat_template import ChatTemplateError
from ..engine.sampling import SamplingParams
from ..serving.pool import ClientGone, LoadedModel, ModelUnavailable, Overloaded, UnknownModel
from ..serving.session import GenerationRequest, Session
from .errors import ApiError, invalid, model_not_found
from .state import record, state


def client_watch(environ: dict) -> Callable[[], bool]:
    """A check that the client closed its connection, where the server exposes the socket.

    gunicorn puts the socket in the environ; a readable socket whose peek
    returns no bytes has been closed by the peer.
    """
    sock = environ.get("gunicorn.socket")
    if sock is None:
        return lambda: False

    def gone() -> bool:
        try:
            readable, _, _ = select.select([sock], [], [], 0)
            return bool(readable) and sock.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True

    return gone


def get_model(model_id: str) -> LoadedModel:
    """The loaded model; 404 if it is not configured, 503 if it cannot load."""
    record().model = model_id
    try:
        return state().pool.get(model_id)
    except UnknownModel:
        raise model_not_found(model_id) from None
    except ModelUnavailable as exc:
        raise ApiError(503, str(exc), code="model_unavailable") from None


def start_session(
    model_id: str,
    render: Callable[[LoadedModel], str],
    *,
    max_tokens: Optional[int],
    max_tokens_param: str,
    sampling: Callable[[LoadedModel], SamplingParams],
    stop: tuple[str, ...],
) -> Session:
    """Look up, admit and prepare one generation; return its not yet started session."""
    kronk = state()
    settings = kronk.settings
    rec = record()
    deadline = rec.started + settings.request_timeout
    model = get_model(model_id)
    gone = client_watch(request.environ)
    try:
        lease = model.admit(min(settings.admission_timeout, deadline - time.monotonic()), gone)
    except Overloaded as exc:
        kronk.metrics.rejected.labels(model_id).inc()
        raise ApiError(429, str(exc), code="model_busy", headers={"Retry-After": str(exc.retry_after)}) from None
    except ClientGone:
        rec.outcome = "client_gone"
        raise ApiError(499, "client closed the connection while waiting for admission") from None
    try:
        params = sampling(model)
        try:
            text = render(model)
        except ChatTemplateError as exc:
            raise invalid(str(exc), param="messages") from None
        prompt = model.tokenize(text)
        context = model.engine.context_length
        if len(prompt) + (max_tokens or 1) > context:
            raise invalid(
                f"this model's context is {context} tokens; the prompt has {len(prompt)} tokens"
                + (f" and {max_tokens_param} asks for {max_tokens} more" if max_tokens else ""),
                param=max_tokens_param if max_tokens else "messages",
                code="context_length_exceeded",
            )
    except BaseException:
        lease.release()
        raise
    generation = GenerationRequest(
        prompt=prompt, max_tokens=max_tokens or context - len(prompt), sampling=params, stop=stop,
    )
    session = Session(
        model, lease, generation, started=rec.started, deadline=deadline,
        keepalive=settings.keepalive_interval, client_gone=gone, metrics=kronk.metrics,
    )
    rec.stats = session.stats
    return session
