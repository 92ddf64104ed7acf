"""llama-server's router endpoints: the models with their status, loading and unloading one, and their status
changes as server-sent events.

A model here is a configured one or a file pulled into the hub's cache. Loading one is what any request for it
does; unloading one waits for its requests to end (llama-server's router aborts them), up to the admission
timeout.
"""

import time
from pathlib import Path
from typing import Callable, Iterator, Optional

import gevent
from flask import jsonify, request

from ....catalog import input_modalities
from ....config import ModelSpec
from ....serving import offload
from ....serving.pool import ModelPool
from ...body import parse_body
from ...client import client_watch
from ...errors import ApiError, invalid
from ...schemas import Strict
from ...sessions import known_model, use_model
from ...sse import sse
from ...state import KronkState, state
from .protocol import PROTOCOL, bp

STATUS_POLL_SECONDS = 0.5  # how often /models/sse looks for changes


class ModelName(Strict):
    model: str


def status(pool: ModelPool, model_id: str) -> dict:
    """A model's status in llama-server's words: loaded, loading (with its download's progress), or unloaded (and
    whether its last load failed)."""
    loading = pool.loads.get(model_id)
    if loading is not None:
        if loading.total and loading.done < loading.total:
            return {"value": "downloading", "progress": {model_id: {"done": loading.done, "total": loading.total}}}
        return {"value": "loading"}
    if pool.loaded_model(model_id) is not None:
        return {"value": "loaded"}
    failed = model_id in pool.load_errors
    return {"value": "unloaded", **({"failed": True} if failed else {})}


def _card(model_id: str) -> dict:
    kronk = state()
    spec = kronk.models.models().get(model_id)
    loaded = kronk.pool.loaded_model(model_id)
    return {"id": model_id, "object": "model", "owned_by": "kronk_wsgi", "created": loaded.created if loaded else 0,
            "aliases": [model_id], "tags": [], "path": _shown_path(spec) if spec is not None else model_id,
            "architecture": {"input_modalities": offload.call(gevent.get_hub().threadpool, input_modalities, spec,
                                                              loaded.engine if loaded else None),
                             "output_modalities": ["text"]},
            "status": status(kronk.pool, model_id)}


def _shown_path(spec: ModelSpec) -> str:
    """Where a model comes from, as /props shows it: a local file by its name alone (never the server's folders)."""
    return Path(spec.path).name if spec.path is not None else spec.describe()


def _all_models() -> list[str]:
    models = state().models
    pulled = offload.call(gevent.get_hub().threadpool, models.pulled)
    return list(dict.fromkeys([*models.configured, *pulled]))


@bp.get("/models")
def list_models():
    """Every model, with its status."""
    return jsonify({"object": "list", "data": [_card(m) for m in _all_models()]})


@bp.post("/models/load")
def load():
    """Load a model (as a request for it would), waiting until it is loaded."""
    body = parse_body(ModelName, json_type=False)
    with use_model(body.model):
        pass
    return jsonify({"success": True})


@bp.post("/models/unload")
def unload():
    """Unload a model once its requests have ended (waiting for them up to the admission timeout)."""
    body = parse_body(ModelName, json_type=False)
    model_id = known_model(body.model)
    kronk = state()
    if kronk.pool.loaded_model(model_id) is None:
        raise invalid(f"the model {model_id!r} is not loaded", param="model")
    deadline = time.monotonic() + kronk.settings.admission_timeout
    gone = client_watch(request.environ)
    while not kronk.pool.unload(model_id, "admin"):
        if kronk.pool.loaded_model(model_id) is None:  # unloaded meanwhile, for room or idleness
            break
        if time.monotonic() > deadline or gone():
            raise ApiError(503, f"the model {model_id!r} stayed in use; it was not unloaded", code="model_busy",
                           headers={"Retry-After": "5"})
        gevent.sleep(STATUS_POLL_SECONDS)
    return jsonify({"success": True})


@bp.get("/models/sse")
def model_events():
    """Each model's status as it changes (the first event of each its status now), as server-sent events."""
    return PROTOCOL.stream(_status_events(state(), client_watch(request.environ)))


def _status_events(kronk: KronkState, gone: Callable[[], bool]) -> Iterator[str]:
    """Runs outside the request's app context: it is given what it reads."""
    known: dict[str, Optional[dict]] = {}
    quiet_since = time.monotonic()
    while not gone() and not kronk.pool.drain.started:
        for model_id in kronk.models.models():
            now = status(kronk.pool, model_id)
            if known.get(model_id) != now:
                known[model_id] = now
                quiet_since = time.monotonic()
                if now["value"] == "downloading":
                    yield sse({"model": model_id, "event": "download_progress", "data": now["progress"]})
                else:
                    yield sse({"model": model_id, "event": "model_status", "data": {"status": now["value"]}})
        if time.monotonic() - quiet_since >= kronk.settings.keepalive_interval:
            quiet_since = time.monotonic()
            yield PROTOCOL.framing.keepalive
        gevent.sleep(STATUS_POLL_SECONDS)
