"""The admin API: loaded models with their slots, queue and memory; unloading; a remote model's gRPC workers, added
and removed; pulling from the hub as SSE.

Behind admin keys (``admin_keys``), never the inference keys: with inference
keys and no admin keys it is closed; with no keys at all it is open, like
the rest of a server without authentication.
"""

import time
from typing import Iterator, Optional

import pydantic
from flask import Blueprint, jsonify, request

from ... import hub
from ...engine.base import EngineError
from ...engine.grpc_engine import worker_address
from ...serving.formats import tool_rendering
from ...serving.pool import LoadedModel
from .. import pulling
from ..body import parse_body
from ..client import client_watch
from ..errors import ApiError
from ..protocol import Protocol
from ..schemas import Strict
from ..sse import sse
from ..state import state

bp = Blueprint("admin", __name__)
PROTOCOL = Protocol("admin", bp, prefixes=("/admin/",), admin_paths=("/admin/",), unknown_below=("/admin/",))


def _model_row(model_id: str) -> dict:
    kronk = state()
    spec = kronk.models.get(model_id)
    row = {"id": model_id, "source": spec.describe(), "loaded": False, "default": model_id == kronk.settings.default_model,
           "runner": spec.runner, "load_error": kronk.pool.load_errors.get(model_id)}
    loading = kronk.pool.loads.get(model_id)
    if loading is not None:  # what its download has fetched so far (bytes)
        row["loading"] = {"done": loading.done, "total": loading.total}
    loaded = kronk.pool.loaded_model(model_id)
    if loaded is not None:
        scheduler = loaded.scheduler
        states = list(scheduler.states.values())
        row.update({
            "loaded": True, "context_length": loaded.engine.context_length, "memory_mb": round(loaded.memory / 1e6),
            "slots": scheduler.slot_count, "busy_slots": scheduler.slot_count - states.count("idle"),
            "slot_states": states, "queued": scheduler.waiting_for_slot, "waiting": scheduler.waiting,
            "places": loaded.scheduler.places,
            "idle_seconds": None if loaded.in_use else round(time.monotonic() - loaded.last_used, 1),
            "tools": tool_rendering(loaded.template), "prompt_cache": _cache_row(loaded.prompt_cache),
        })
        if loaded.engine.kind.name == "grpc":
            row["workers"] = loaded.engine.worker_rows()
        if loaded.engine.kind.name == "runner":
            row["runner_pid"] = loaded.engine.lease.pid
    return row


def _cache_row(cache) -> Optional[dict]:
    """What a model's prompt cache holds (None: its engine saves no states, or the cache is off)."""
    if cache is None:
        return None
    ram, disk = cache.held()
    return {"ram_mb": round(ram / 1e6, 1), "ram_budget_mb": round(cache.ram_bytes / 1e6),
            "disk_mb": round(disk / 1e6, 1), "disk_budget_mb": round(cache.disk_bytes / 1e6),
            "dir": str(cache.disk_dir) if cache.disk_dir else None}


@bp.get("/admin/models")
def models():
    """Every configured model: loaded or not, and for loaded ones their slots, queue and memory."""
    settings = state().settings
    budget = {"max_loaded_models": settings.max_loaded_models, "max_memory_mb": settings.max_memory_mb,
              "idle_unload_seconds": settings.idle_unload_seconds}
    return jsonify({"object": "list", "data": [_model_row(m) for m in state().models.models()], "budget": budget})


@bp.post("/admin/models/<path:model_id>/unload")
def unload(model_id: str):
    """Unload a model that no request is using."""
    kronk = state()
    _loaded(model_id)
    if not kronk.pool.unload(model_id, "admin"):
        kronk.pool.set_keep_alive(model_id, 0)  # as the answer says
        raise ApiError(409, f"model {model_id!r} is in use: it is unloaded once its requests are done",
                       code="model_in_use")
    return jsonify({"id": model_id, "unloaded": True})


class WorkerRequest(Strict):
    url: str  # grpc://HOST:PORT


def _loaded(model_id: str) -> LoadedModel:
    """The loaded model ``model_id``: 404 if there is no such model, 409 if it is not loaded."""
    kronk = state()
    if model_id not in kronk.models:
        raise ApiError(404, f"the model {model_id[:100]!r} does not exist", code="model_not_found", param="model")
    loaded = kronk.pool.loaded_model(model_id)
    if loaded is None:
        raise ApiError(409, f"model {model_id!r} is not loaded", code="not_loaded")
    return loaded


def _remote_model(model_id: str) -> LoadedModel:
    """The loaded model ``model_id``, served by gRPC workers: as ``_loaded``, and 400 for a local engine's."""
    loaded = _loaded(model_id)
    if loaded.engine.kind.name != "grpc":
        raise ApiError(400, f"model {model_id!r} runs on the {loaded.engine.kind.name} engine, not on gRPC workers",
                       code="not_remote", param="model")
    return loaded


def _address(url: str) -> str:
    """A worker's HOST:PORT; 400 if ``url`` is not grpc://HOST:PORT."""
    try:
        return worker_address(url)
    except ValueError as exc:
        raise ApiError(400, str(exc)[:300], param="url") from None


@bp.get("/admin/models/<path:model_id>/workers")
def workers(model_id: str):
    """The gRPC workers of a loaded model: their slots, this worker's requests at them, their health."""
    return jsonify({"object": "list", "data": _remote_model(model_id).engine.worker_rows()})


@bp.post("/admin/models/<path:model_id>/workers")
def add_worker(model_id: str):
    """Add a gRPC worker to a loaded model: asked its model first; its slots serve the line at once."""
    loaded = _remote_model(model_id)
    url = parse_body(WorkerRequest).url
    if f"grpc://{_address(url)}" in [row["url"] for row in loaded.engine.worker_rows()]:
        raise ApiError(409, f"{url[:200]} is a worker of the model already", code="worker_exists", param="url")
    try:
        slots = loaded.add_worker(url)
    except EngineError as exc:
        raise ApiError(502, str(exc), code="worker_refused", param="url") from None
    return jsonify({"id": model_id, "url": url, "added": True, "slots": len(slots)})


@bp.delete("/admin/models/<path:model_id>/workers")
def remove_worker(model_id: str):
    """Take the gRPC worker ``?url=`` out of a loaded model (its running requests end there); the model keeps one
    at least."""
    loaded = _remote_model(model_id)
    url = request.args.get("url")
    if not url:
        raise ApiError(400, "url: the worker to remove, as ?url=grpc://HOST:PORT", param="url")
    urls = [row["url"] for row in loaded.engine.worker_rows()]
    if f"grpc://{_address(url)}" not in urls:
        raise ApiError(404, f"{url[:200]} is not a worker of the model", code="worker_not_found", param="url")
    if len(urls) == 1:
        raise ApiError(409, f"model {model_id!r} keeps one worker at least: add another first", code="last_worker",
                       param="url")
    slots = loaded.remove_worker(url)
    return jsonify({"id": model_id, "url": url, "removed": True, "slots": len(slots)})


class PullRequest(Strict):
    repo_id: str
    file: Optional[str] = None  # a file name or a quantization; may be left out if the repository has one GGUF file
    revision: Optional[str] = None

    @pydantic.field_validator("revision", "file")
    @classmethod
    def _inside_the_cache(cls, value: Optional[str], info: pydantic.ValidationInfo) -> Optional[str]:
        """A revision must be a git name and a file a repository path: both become paths in the hub's cache."""
        check = hub.check_revision if info.field_name == "revision" else hub.check_filename
        try:
            check(value)
        except hub.HubError as exc:
            raise ValueError(str(exc)) from None
        return value


@bp.post("/admin/pull")
def pull():
    """Download a GGUF file into the hub's cache, its progress streamed as SSE.

    Before the commit the file is looked up (a 400 naming what is wrong).
    Then: ``start``, ``progress`` events (bytes done and total), and ``done``
    with the file's path, or ``error``. A client that leaves stops the
    download (see pulling.py).
    """
    body = parse_body(PullRequest)
    try:
        filename = pulling.resolve(body.repo_id, body.file, body.revision)
    except hub.HubError as exc:
        raise ApiError(400, str(exc), code="pull_failed", param="file") from None
    settings = state().settings
    news = pulling.pull(body.repo_id, filename, body.revision, settings.keepalive_interval, settings.load_timeout,
                        client_watch(request.environ))
    return PROTOCOL.stream(_pull_frames(news, body.repo_id, filename))


def _pull_frames(news: Iterator[pulling.News], repo_id: str, filename: str) -> Iterator[str]:
    yield sse({"repo_id": repo_id, "file": filename}, "start")
    for item in news:
        if isinstance(item, pulling.Progress):
            yield sse({"done": item.done, "total": item.total}, "progress")
        elif isinstance(item, pulling.Pulled):
            yield sse({"path": item.path, "size": item.size}, "done")
        elif isinstance(item, pulling.PullFailed):
            yield sse({"error": {"message": item.message, "type": "pull_failed"}}, "error")
        else:
            yield PROTOCOL.framing.keepalive
