"""Starting a session: everything before the commit that every generating and embedding endpoint shares.

Model lookup and load, admission, and the request's plan (prompt
preparation, the context check) all happen here, so their failures are
real HTTP errors.
"""

import contextlib
import dataclasses
import time
from typing import Callable, Iterator, Optional, Sequence

import flask
import gevent

from ..model_registry import hub_source
from ..serving import offload
from ..serving.drain import ShuttingDown
from ..serving.jobs import Job
from ..serving.pool import LoadedModel, ModelUnavailable, NeverFits, NoRoom
from ..serving.scheduler import ClientGone, Overloaded, QueueFull
from ..serving.session import Session
from .client import client_watch
from .errors import ApiError, invalid, model_not_found
from .planning import GenerationRequest, Prompt, check, plan, plan_embedding, plan_rerank
from .state import record, state


@contextlib.contextmanager
def use_model(model_id: str) -> Iterator[LoadedModel]:
    """The loaded model (see ``claim_model``), kept loaded until the block ends."""
    model = claim_model(model_id)
    try:
        yield model
    finally:
        model.unclaim()


def claim_model(model_id: str) -> LoadedModel:
    """The loaded model, claimed: it stays loaded until the caller unclaims it.

    404 if it is neither configured nor pulled (see ``known_model``); 503 if it cannot load, or if the models
    that must be unloaded to make room for it stay in use for the admission
    timeout (with Retry-After: it waits for them meanwhile); 400 if it is
    larger than the memory budget. Only a configured
    id is recorded: logs and metric labels never carry what a client made up.
    """
    model_id = known_model(model_id)
    rec = record()
    rec.model = model_id
    asked = time.monotonic()
    kronk = state()
    try:
        model = kronk.pool.claim(model_id, kronk.settings.admission_timeout, client_watch(flask.request.environ))
    except ClientGone:
        rec.outcome = "client_gone"
        raise ApiError(499, "client closed the connection while waiting for the model") from None
    except ModelUnavailable as exc:
        raise ApiError(503, str(exc), code="model_unavailable") from None
    except NoRoom as exc:
        raise ApiError(503, str(exc), code="model_busy", headers={"Retry-After": str(exc.retry_after)}) from None
    except NeverFits as exc:
        raise invalid(str(exc), param="model", code="model_too_large") from None
    rec.load_seconds = time.monotonic() - asked
    return model


def known_model(model_id: str) -> str:
    """The id of the model that serves ``model_id``: itself if it is configured or a file pulled into the hub's
    cache (named ``hf.co/{owner}/{repo}:{tag}``; the hub's cache is looked at off the event loop). Any other name
    is a 404, or the default model's with the unknown_model setting "default"."""
    kronk = state()
    models = kronk.models
    if model_id in models:
        return model_id
    if hub_source(model_id) is None or offload.call(gevent.get_hub().threadpool, models.find, model_id) != model_id:
        if kronk.settings.unknown_model == "default":
            return kronk.settings.default_model
        raise model_not_found(model_id)
    return model_id


def start_generation(request: GenerationRequest) -> Session:
    """Check, admit and plan one generation; return its not yet started session."""
    record().not_offered = request.not_offered
    offload.call(state().body_thread, check, request)  # schemas may take time to check: off the event loop
    request = dataclasses.replace(request, cache_scope=cache_scope())
    return _start(request.model, lambda model: plan(model, request))


def count_prompt_tokens(request: GenerationRequest) -> int:
    """The prompt tokens a generation request would take on its model, planned as it would be (with no hint to
    the prompt cache: counting saves nothing); nothing is generated."""
    return measure_prompt(request)[0]


def measure_prompt(request: GenerationRequest) -> tuple[int, int]:
    """The prompt tokens a generation request would take (see count_prompt_tokens), and its model's context."""
    offload.call(state().body_thread, check, request)
    request = dataclasses.replace(request, cache_key=None, cache_breaks=(), cache_scope=cache_scope())
    with use_model(request.model) as model:
        return plan(model, request).prompt_tokens, model.engine.context_length


def start_later(request: GenerationRequest) -> Callable[[Callable[[], bool]], Session]:
    """Check and plan one generation now, so that its failures are HTTP errors, and admit it later, outside the
    request (a background response): return what waits for its admission place (as a request would, until
    ``cancelled()`` turns true) and gives its not yet started session. It holds the model until then."""
    record().not_offered = request.not_offered
    kronk = state()
    offload.call(kronk.body_thread, check, request)
    request = dataclasses.replace(request, cache_scope=cache_scope())
    if kronk.pool.drain.started:
        raise shutting_down()
    model = claim_model(request.model)
    try:
        job = plan(model, request)
    except BaseException:
        model.unclaim()
        raise
    settings = kronk.settings

    def admit(cancelled: Callable[[], bool]) -> Session:
        started = time.monotonic()
        try:
            lease = model.admit(settings.admission_timeout, cancelled, kronk.pool.drain)
        finally:
            model.unclaim()
        return Session(model, lease, job, started=started, deadline=started + settings.request_timeout,
                       drain=kronk.pool.drain, keepalive=settings.keepalive_interval, client_gone=cancelled,
                       metrics=kronk.metrics)

    return admit


def start_embedding(model_id: str, inputs: Sequence[Prompt], param: str, truncate: bool = False) -> Session:
    """Admit and plan the embedding of ``inputs`` (with ``truncate``, cut to the context); return its session."""
    scope, budget = cache_scope(), state().settings.max_request_tokens
    return _start(model_id, lambda model: plan_embedding(model, inputs, param, budget, truncate, scope))


def start_rerank(model_id: str, query: str, documents: Sequence[str], param: str,
                 max_document_tokens: Optional[int] = None) -> Session:
    """Admit and plan the scoring of ``documents`` against ``query`` (see plan_rerank); return its session."""
    budget = state().settings.max_request_tokens
    return _start(model_id, lambda model: plan_rerank(model, query, documents, param, budget, max_document_tokens))


def cache_scope() -> str:
    """Whose cached prompt prefixes the request may reuse: its API key's own, unless prompt_cache_scope shares
    them (see Slot.enter)."""
    return record().owner if state().settings.prompt_cache_scope == "key" else ""


class SessionChain:
    """A request's generations one after another, as one session's events (``_steps``): each after the first is
    started by ``follow`` once the one before it ended, planned then on the same model, and takes over its
    admission place (no second wait in line) and the request's stats. Made before the commit (it keeps the
    request's cache scope); iterate it once, and close it in every case."""

    def __init__(self, first: Session) -> None:
        self.first = first
        self.stats = first.stats  # each later generation's take their place (see Session)
        self._scope = cache_scope()
        self._sessions = [first]
        self._events: Optional[Iterator] = None

    def __iter__(self) -> Iterator:
        self._events = self._run()
        return self._events

    def close(self) -> None:
        """Stop whichever generation runs and give everything back; safe to call more than once."""
        try:
            if self._events is not None:
                self._events.close()
        finally:
            for session in self._sessions:
                session.close()

    def _run(self) -> Iterator:
        try:
            yield from self._steps()
        except GeneratorExit:  # the client left between generations (within one, its session says so)
            if self.stats.outcome in ("", "ok"):
                self.stats.outcome = "client_gone"
            raise

    def _steps(self) -> Iterator:
        raise NotImplementedError

    def follow(self, request: GenerationRequest) -> Session:
        """The next generation, the last one having ended; an ApiError (after the commit: the caller's to send
        in-band) if ``request``, checked before the commit, cannot be planned."""
        previous = self._sessions[-1]
        job = plan(previous.model, dataclasses.replace(request, cache_scope=self._scope))
        session = Session(previous.model, previous.pass_lease(), job, started=previous.started,
                          deadline=previous.deadline, drain=previous.drain, keepalive=previous.keepalive,
                          client_gone=previous.client_gone, metrics=previous.metrics, stats=previous.stats)
        self._sessions.append(session)
        return session


def shutting_down() -> ApiError:
    """A 503 for work that arrives while the server shuts down; its outcome is logged as "shutdown"."""
    record().outcome = "shutdown"
    return ApiError(503, "the server is shutting down; retry on another instance", code="shutting_down",
                    headers={"Retry-After": "1"})


def _start(model_id: str, prepare: Callable[[LoadedModel], Job]) -> Session:
    """Look up the model, take an admission place, prepare the job: the shared path before the commit."""
    kronk = state()
    settings = kronk.settings
    rec = record()
    deadline = rec.started + settings.request_timeout
    if kronk.pool.drain.started:
        raise shutting_down()
    gone = client_watch(flask.request.environ)
    with use_model(model_id) as model:  # the lease keeps it loaded from admission on
        try:
            lease = model.admit(min(settings.admission_timeout, deadline - time.monotonic()), gone, kronk.pool.drain)
        except ShuttingDown:
            raise shutting_down() from None
        except (Overloaded, QueueFull) as exc:
            kronk.metrics.rejected.labels(model_id).inc()
            raise ApiError(429, str(exc), code="model_busy", headers={"Retry-After": str(exc.retry_after)}) from None
        except ClientGone:
            rec.outcome = "client_gone"
            raise ApiError(499, "client closed the connection while waiting for admission") from None
    try:
        job = prepare(model)
    except BaseException:
        lease.release()
        raise
    session = Session(
        model, lease, job, started=rec.started, deadline=deadline, drain=kronk.pool.drain,
        keepalive=settings.keepalive_interval, client_gone=gone, metrics=kronk.metrics,
    )
    rec.stats = session.stats
    rec.session = session  # closed when the request ends, unless a response takes it over
    return session
