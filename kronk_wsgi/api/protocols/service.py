"""Models, health and metrics endpoints."""

import dataclasses
import os
import socket
import time
from typing import Optional

import flask
import gevent
from flask import Blueprint, Response, jsonify
from prometheus_client import CONTENT_TYPE_LATEST

from ... import __version__
from ...catalog import input_modalities
from ...describe import file_facts
from ...serving import offload
from ...serving.reasoning import reasons
from ..errors import invalid
from ..protocol import Protocol
from ..sessions import known_model
from ..state import state

bp = Blueprint("service", __name__)
DEFAULT_PAGE, MAX_PAGE = 20, 1000  # models on a page of Anthropic's listing
STARTED = time.time()  # when this process started serving
PROTOCOL = Protocol("service", bp, prefixes=("/v1/models", "/v1/liveness", "/v1/readiness", "/metrics"),
                    open_paths=("/v1/liveness", "/v1/readiness", "/metrics"), unknown_below=("/v1/",))


@dataclasses.dataclass(frozen=True)
class Listed:
    """What the model listings say of a model."""

    model_id: str
    created: int  # when it was loaded, 0 if it is not
    context: Optional[int]  # the context it is (or will be) served with; None if its file is not here yet
    thinks: bool  # its chat template has thinking
    modalities: tuple[str, ...] = ("text",)  # what its prompts may hold (catalog.input_modalities)

    @property
    def max_input_tokens(self) -> Optional[int]:
        return self.context - 1 if self.context else None  # a prompt leaves room for one token of the reply

    @property
    def max_tokens(self) -> Optional[int]:
        return self.context - 1 if self.context else None  # a longer max_tokens is clamped to the room left


def _listed(model_id: str) -> Listed:
    """The listing's facts of a model (its file read, off the event loop, if it is not loaded)."""
    kronk = state()
    loaded = kronk.pool.loaded_model(model_id)
    if loaded is not None:
        return Listed(model_id, loaded.created, loaded.engine.context_length, reasons(loaded.template.source),
                      tuple(input_modalities(None, loaded.engine)))
    spec = kronk.models.get(model_id)
    modalities = tuple(offload.call(gevent.get_hub().threadpool, input_modalities, spec, None))
    found = offload.call(gevent.get_hub().threadpool, file_facts, spec) if spec is not None else None
    if found is None:
        return Listed(model_id, 0, spec.context_length if spec is not None else None, False, modalities)
    facts = found[1]
    return Listed(model_id, 0, spec.context_length or facts.context_length,
                  reasons(facts.template_source(spec.chat_template)), modalities)


def _openai_card(listed: Listed) -> dict:
    card = {"id": listed.model_id, "object": "model", "owned_by": "kronk_wsgi", "created": listed.created,
            "architecture": {"input_modalities": list(listed.modalities), "output_modalities": ["text"]}}
    if listed.context:
        card.update(context_length=listed.context, max_input_tokens=listed.max_input_tokens,
                    max_tokens=listed.max_tokens)
    return card


def _anthropic_info(listed: Listed) -> dict:
    """A model as Anthropic's Models API describes one, with what it takes here."""
    yes, no = {"supported": True}, {"supported": False}
    thinking = yes if listed.thinks else no
    created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(listed.created))
    return {
        "type": "model", "id": listed.model_id, "display_name": listed.model_id, "created_at": created,
        "max_input_tokens": listed.max_input_tokens, "max_tokens": listed.max_tokens, "lifecycle": "active",
        "deprecated_at": None, "retires_at": None, "line": None,
        "capabilities": {
            "batch": no, "citations": no, "code_execution": no,
            "image_input": yes if "image" in listed.modalities else no, "pdf_input": no,
            "structured_outputs": yes,
            "context_management": {"supported": True, "clear_tool_uses_20250919": yes,
                                   "clear_thinking_20251015": yes, "compact_20260112": yes},
            "effort": {"supported": True, "low": yes, "medium": yes, "high": yes, "max": yes, "xhigh": no},
            "server_tools": {"supported": False, "code_execution": no, "web_search": no},
            "thinking": {"supported": listed.thinks, "types": {"adaptive": thinking, "enabled": thinking,
                                                               "disabled": yes, "between_tools": no}},
        },
    }


def _anthropic_style() -> bool:
    """Whether the listing is asked for by an Anthropic client (its SDKs send their API version)."""
    return "anthropic-version" in flask.request.headers


def _page(ids: list[str]) -> tuple[list[str], bool]:
    """Anthropic's page of ``ids``: ``limit`` of them (20 unless asked; 1 to 1000) after ``after_id`` or before
    ``before_id``; and whether more follow."""
    args = flask.request.args
    try:
        limit = int(args.get("limit", DEFAULT_PAGE))
    except ValueError:
        limit = 0
    if not 1 <= limit <= MAX_PAGE:
        raise invalid(f"limit must be an integer from 1 to {MAX_PAGE}", param="limit")
    after, before = args.get("after_id"), args.get("before_id")
    if after is not None and before is not None:
        raise invalid("give after_id or before_id, not both", param="before_id")
    for name, cursor in (("after_id", after), ("before_id", before)):
        if cursor is not None and cursor not in ids:
            raise invalid(f"{name}: no model {cursor[:100]!r} is listed here", param=name)
    if before is not None:
        end = ids.index(before)
        return ids[max(0, end - limit):end], end - limit > 0
    start = ids.index(after) + 1 if after is not None else 0
    return ids[start:start + limit], start + limit < len(ids)


@bp.get("/v1/models")
def list_models():
    """The configured models, then the files pulled into the hub's cache (by any worker): OpenAI's list, or
    Anthropic's page when an Anthropic client asks."""
    models = state().models
    ids = [*models.configured, *offload.call(gevent.get_hub().threadpool, models.pulled)]
    if _anthropic_style():
        ids, more = _page(ids)
        data = [_anthropic_info(_listed(m)) for m in ids]
        return jsonify({"data": data, "has_more": more, "first_id": ids[0] if ids else None,
                        "last_id": ids[-1] if ids else None})
    return jsonify({"object": "list", "data": [_openai_card(_listed(m)) for m in ids]})


@bp.get("/v1/models/<path:model_id>")
def get_model(model_id: str):
    """One model, configured or pulled."""
    known_model(model_id)
    listed = _listed(model_id)
    return jsonify(_anthropic_info(listed) if _anthropic_style() else _openai_card(listed))


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
