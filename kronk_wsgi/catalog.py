"""Model management: from a configured model spec to a loaded engine."""

import importlib
from pathlib import Path

from .config import ModelSpec
from .engine.base import Engine, EngineError
from .engine.ctransformers_engine import CTransformersEngine
from .engine.demo_model import ensure_demo_model

ENGINES: dict[str, type] = {"ctransformers": CTransformersEngine}


def model_file(spec: ModelSpec) -> Path:
    """The local file of a model: as configured, from the hub cache, or generated."""
    if spec.demo is not None:
        return ensure_demo_model(spec.demo)
    if spec.repo_id is not None:
        import huggingface_hub

        try:
            # Honours HF_HUB_OFFLINE and HF_HOME: offline, only the local cache is read.
            return Path(huggingface_hub.hf_hub_download(spec.repo_id, spec.filename, revision=spec.revision))
        except Exception as exc:  # the hub raises many types: offline, missing, auth
            raise EngineError(f"cannot get {spec.filename} from {spec.repo_id}: {exc}") from None
    path = Path(spec.path).expanduser()
    if not path.is_file():
        raise EngineError(f"model file not found: {path}")
    return path


def engine_class(name: str) -> type:
    """A built-in engine by name, or any Engine subclass as 'package.module:Class'."""
    if name in ENGINES:
        return ENGINES[name]
    module, _, attr = name.partition(":")
    try:
        cls = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError, ValueError) as exc:
        raise EngineError(f"unknown engine {name!r}: {exc}") from None
    if not (isinstance(cls, type) and issubclass(cls, Engine)):
        raise EngineError(f"engine {name!r} is not an Engine class")
    return cls


def load_engine(model_id: str, spec: ModelSpec) -> Engine:
    """Load a configured model (blocking; call it from a worker thread)."""
    cls = engine_class(spec.engine)
    try:
        return cls(model_id, model_file(spec), context_length=spec.context_length, model_type=spec.model_type)
    except ValueError as exc:  # a bad file (BadModelFile) or a bad template
        raise EngineError(str(exc)) from None
