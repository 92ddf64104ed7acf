"""What the SGLang model gateway asks of a worker: what it serves and how loaded it is.

The gateway registers a worker once GET /health answers 200 (llama-server's probe, which the llama_server
protocol answers), reads /server_info (or /get_server_info) and
/model_info (or /get_model_info), and balances on /get_load. Here a worker is this server: its default model,
its slots and places, and the requests it is holding.
"""

from typing import Optional

from flask import Blueprint, jsonify

from ...catalog import local_file
from ...config import ModelSpec
from ...describe import summary
from ...serving import offload
from ..protocol import Protocol
from ..state import state

bp = Blueprint("sglang", __name__)
PROTOCOL = Protocol("sglang", bp, prefixes=("/server_info", "/get_server_info", "/model_info", "/get_model_info",
                                            "/get_load"))


def _model_path() -> str:
    settings = state().settings
    return settings.models[settings.default_model].describe()


@bp.get("/server_info")
@bp.get("/get_server_info")
def server_info():
    """What this worker serves, in the gateway's terms (one data-parallel rank)."""
    settings = state().settings
    return jsonify({
        "served_model_name": settings.default_model, "model_path": _model_path(), "tokenizer_path": _model_path(),
        "max_running_requests": settings.parallel, "max_queued_requests": settings.parallel * settings.queue_depth,
        "dp_size": 1, "tp_size": 1, "is_embedding": False,
    })


def _architecture(spec: ModelSpec) -> Optional[str]:
    """The architecture a model's GGUF file names (read in a thread: a first read parses its header)."""
    path = local_file(spec)
    return None if path is None or not path.is_file() else summary(path)["architecture"]


@bp.get("/model_info")
@bp.get("/get_model_info")
def model_info():
    """The default model, as the gateway names it."""
    kronk = state()
    architecture = offload.call(kronk.body_thread, _architecture, kronk.settings.models[kronk.settings.default_model])
    return jsonify({"model_path": _model_path(), "tokenizer_path": _model_path(), "is_generation": True,
                    "model_type": architecture, "architectures": [architecture] if architecture else None,
                    "served_model_name": kronk.settings.default_model})


@bp.get("/get_load")
def get_load():
    """Requests running and waiting for each loaded model's slots, summed: the gateway's load of rank 0."""
    kronk = state()
    running = waiting = 0
    for model in kronk.pool.loaded():
        states = list(model.scheduler.states.values())
        running += len(states) - states.count("idle")
        waiting += model.scheduler.waiting_for_slot + model.scheduler.waiting
    return jsonify([{"dp_rank": 0, "num_reqs": running, "num_waiting_reqs": waiting, "num_tokens": 0}])
