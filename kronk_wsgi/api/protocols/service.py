"""Models, health and metrics endpoints."""

import os
import socket
import time

import gevent
from flask import Blueprint, Response, jsonify
from prometheus_client import CONTENT_TYPE_LATEST

from ... import __version__
from ...serving import offload
from ..protocol import Protocol
from ..sessions import known_model
from ..state import state

bp = Blueprint("service", __name__)
STARTED = time.time()  # when this process started serving
PROTOCOL = Protocol("service", bp, prefixes=("/v1/models", "/v1/liveness", "/v1/readiness", "/metrics"),
                    open_paths=("/v1/liveness", "/v1/readiness", "/metrics"), unknown_below=("/v1/",))


def _model_card(model_id: str) -> dict:
    pool = state().pool
    card = {"id": model_id, "object": "model", "owned_by": "kronk_wsgi", "created": 0}
    loaded = pool.loaded_model(model_id)
    if loaded is not None:
        card["created"] = loaded.created
        card["context_length"] = loaded.engine.context_length
    return card


@bp.get("/v1/models")
def list_models():
    """The configured models, then the files pulled into the hub's cache (by any worker)."""
    models = state().models
    pulled = offload.call(gevent.get_hub().threadpool, models.pulled)
    return jsonify({"object": "list", "data": [_model_card(m) for m in [*models.configured, *pulled]]})


@bp.get("/v1/models/<path:model_id>")
def get_model(model_id: str):
    """One model, configured or pulled."""
    known_model(model_id)
    return jsonify(_model_card(model_id))


@bp.get("/v1/liveness")
def liveness():
    """The worker answers."""
    return jsonify({"status": "ok", "version": __version__, "host": socket.gethostname(), "pid": os.getpid()})


def readiness_status() -> str:
    """"ready" once the default model has loaded; else "draining", "failed" or "loading"."""
    kronk = state()
    default = kronk.settings.default_model
    if kronk.pool.drain.started:
        return "draining"
    if default in kronk.pool.loaded_once:  # loaded at start; unloading it later to make room is no failure
        return "ready"
    return "failed" if default in kronk.pool.load_errors else "loading"


@bp.get("/v1/readiness")
def readiness():
    """503 until the default model is loaded, and from the moment the worker starts shutting down."""
    kronk = state()
    default = kronk.settings.default_model
    status = readiness_status()
    if status == "ready":
        return jsonify({"status": status, "default_model": default})
    if status == "draining":
        return jsonify({"status": status, "default_model": default}), 503
    return jsonify({"status": status, "default_model": default, "error": kronk.pool.load_errors.get(default)}), 503


@bp.get("/metrics")
def metrics():
    """Prometheus metrics of the server (of this app, when embedded)."""
    response = Response(state().metrics.exposition(), content_type=CONTENT_TYPE_LATEST)
    response.headers["Process-Start-Time-Unix"] = str(int(STARTED))  # as llama-server answers it
    return response
