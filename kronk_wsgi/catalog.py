"""Model management: from a configured model spec to its file and its loaded engine."""

from pathlib import Path
from typing import Callable, Optional

from .config import ModelSpec
from .engine.base import Engine, EngineError
from .engine.demo_model import demo_model_path, ensure_demo_model
from .engine.registry import ENGINES


# progress(done, total) of a download; it may raise to stop the download.
Progress = Callable[[int, Optional[int]], None]


def model_file(spec: ModelSpec, progress: Progress = lambda done, total: None) -> Optional[Path]:
    """The local file of a model: as configured, from the hub cache (downloaded first if it is not there yet,
    reporting to ``progress``), or generated; a model on gRPC workers may name a folder, or nothing (None)."""
    if spec.demo is not None:
        return ensure_demo_model(spec.demo)
    if spec.repo_id is not None:
        from . import hub

        cached = None if spec.revision else hub.cached_path(spec.repo_id, spec.filename or spec.quant)
        if cached is not None:
            return cached  # as Ollama does: a cached model loads without the hub; `kronk-wsgi pull` updates it
        try:
            # Honours HF_HUB_OFFLINE and HF_HOME: offline, only the local cache is read.
            return hub.pull(spec.repo_id, spec.filename or spec.quant, spec.revision, progress=progress)
        except hub.HubError as exc:
            raise EngineError(str(exc)) from None
    if spec.path is None:
        return None
    path = Path(spec.path).expanduser()
    if path.is_dir() and spec.engine == "grpc":
        return path
    if not path.is_file():
        raise EngineError(f"model file not found: {path}")
    return path


def projector_file(spec: ModelSpec, progress: Progress = lambda done, total: None) -> Optional[Path]:
    """The model's multimodal projector file: as configured, or its repository's own (from the hub cache, else
    downloaded first); None if it has none."""
    if not spec.takes_projector:
        return None
    if spec.repo_id is None:
        path = local_projector(spec)
        if not path.is_file():
            raise EngineError(f"mmproj file not found: {path}")
        return path
    cached = None if spec.revision else local_projector(spec)
    if cached is not None:
        return cached
    from . import hub

    try:
        return hub.pull_projector(spec.repo_id, spec.mmproj, spec.revision, progress=progress)
    except hub.HubError as exc:
        raise EngineError(str(exc)) from None


def local_projector(spec: ModelSpec) -> Optional[Path]:
    """The model's projector file if it is on this machine already (nothing is downloaded); None if not."""
    if not spec.takes_projector:
        return None
    if spec.repo_id is not None:
        from . import hub

        return hub.cached_projector(spec.repo_id, spec.mmproj)
    return Path(spec.mmproj).expanduser()


def input_modalities(spec: Optional[ModelSpec], engine: Optional[Engine]) -> list[str]:
    """What a model's prompts may hold: text, and what its loaded projector reads ("image", "audio"); a model not
    loaded with a projector to load is taken to read images (what it reads besides is known once it loads)."""
    if engine is not None:
        return ["text", *sorted(engine.modalities)]
    return ["text", "image"] if spec is not None and local_projector(spec) is not None else ["text"]


def local_file(spec: ModelSpec) -> Optional[Path]:
    """The model's file if it is on this machine already (nothing is downloaded or generated); None if not."""
    if spec.repo_id is not None:
        from . import hub

        return hub.cached_path(spec.repo_id, spec.filename or spec.quant)
    if spec.demo is not None:
        path = demo_model_path(spec.demo)
        return path if path.is_file() else None
    return Path(spec.path).expanduser() if spec.path is not None else None


def check_engine_options(spec: ModelSpec) -> None:
    """ValueError unless the model's engine (or, for "auto", some engine) takes its engine_options."""
    if "mmproj" in spec.engine_options:  # the engine's option, set from the model's own setting
        raise ValueError("engine_options: give a projector as the model's mmproj setting")
    kinds = ENGINES.automatic if spec.engine == "auto" else (ENGINES.get(spec.engine),)
    problems = []
    for kind in kinds:
        try:
            kind.check_options(spec.engine_options)
            return
        except ValueError as exc:
            problems.append(str(exc))
    raise ValueError("; ".join(problems))


def load_engine(model_id: str, spec: ModelSpec, progress: Progress = lambda done, total: None) -> Engine:
    """Load a configured model (blocking; call it from a worker thread); ``progress`` hears of its download."""
    path = model_file(spec, progress)
    projector = projector_file(spec, progress)
    options = spec.engine_options if projector is None else {**spec.engine_options, "mmproj": str(projector)}
    try:
        kind = ENGINES.choose(path, spec.engine, options)
        return kind.load(model_id, path, spec.context_length, options)
    except ValueError as exc:  # a bad file (BadModelFile), a bad template, options the engine does not take
        raise EngineError(str(exc)) from None
