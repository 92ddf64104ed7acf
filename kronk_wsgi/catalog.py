"""Model management: from a configured model spec to a loaded engine, and what a model file holds."""

import importlib
from collections import Counter
from pathlib import Path
from typing import Optional

import gguf

from .config import ModelSpec
from .engine.base import DEFAULT_CONTEXT_LENGTH, Engine, EngineError
from .engine.ctransformers_engine import CTransformersEngine
from .engine.ctransformers_files import Compatibility, check
from .engine.demo_model import demo_model_path, ensure_demo_model
from .engine.llamacpp_engine import LlamaCppEngine
from .engine.llamacpp_engine import available as llamacpp_available
from .engine.gguf_file import BadModelFile, is_gguf, read_gguf
from .engine.tokenizer import GGUFTokenizer

ENGINES: dict[str, type] = {"ctransformers": CTransformersEngine, "llama.cpp": LlamaCppEngine}
EXTRA = "pip install 'kronk_wsgi[llamacpp]'"


def model_file(spec: ModelSpec) -> Path:
    """The local file of a model: as configured, from the hub cache, or generated."""
    if spec.demo is not None:
        return ensure_demo_model(spec.demo)
    if spec.repo_id is not None:
        from . import hub

        try:
            # Honours HF_HUB_OFFLINE and HF_HOME: offline, only the local cache is read.
            return hub.pull(spec.repo_id, spec.filename or spec.quant, spec.revision, progress=lambda done, total: None)
        except hub.HubError as exc:
            raise EngineError(str(exc)) from None
    path = Path(spec.path).expanduser()
    if not path.is_file():
        raise EngineError(f"model file not found: {path}")
    return path


def local_file(spec: ModelSpec) -> Optional[Path]:
    """The model's file if it is on this machine already (nothing is downloaded or generated); None if not."""
    if spec.repo_id is not None:
        from . import hub

        return hub.cached_path(spec.repo_id, spec.filename or spec.quant)
    if spec.demo is not None:
        path = demo_model_path(spec.demo)
        return path if path.is_file() else None
    return Path(spec.path).expanduser()


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


def _auto_engine(result: Compatibility) -> Optional[str]:
    """The engine "auto" gives a GGUF file: ctransformers if it runs it, else llama.cpp if installed; None if neither."""
    if result.runs:
        return "ctransformers"
    return "llama.cpp" if llamacpp_available() else None


def choose_engine(path: Path, wanted: str = "auto", gpu_layers: int = 0) -> str:
    """The engine that runs a file: ``wanted``, or for "auto" ctransformers if it runs the file, else llama.cpp.

    Asking for GPU layers asks for llama.cpp. EngineError if no installed engine can run the file.
    """
    if wanted != "auto":
        return wanted
    if gpu_layers:
        name, why = ("llama.cpp" if llamacpp_available() else None), "GPU layers asked for"
    elif not is_gguf(path):
        return "ctransformers"  # a legacy GGML file: only ctransformers reads those
    else:
        result = check(read_gguf(path))
        name, why = _auto_engine(result), "; ".join(result.problems)
    if name is None:
        raise EngineError(f"{path.name} needs the llama.cpp engine ({why}), which is not installed: {EXTRA}")
    return name


def load_engine(model_id: str, spec: ModelSpec) -> Engine:
    """Load a configured model (blocking; call it from a worker thread)."""
    path = model_file(spec)
    try:
        name = choose_engine(path, spec.engine, spec.gpu_layers)
        cls = engine_class(name)
        options = {"gpu_layers": spec.gpu_layers} if name == "llama.cpp" else {}
        return cls(model_id, path, context_length=spec.context_length, model_type=spec.model_type, **options)
    except ValueError as exc:  # a bad file (BadModelFile) or a bad template
        raise EngineError(str(exc)) from None


def kv_cache_bytes(model, context: int) -> int:
    """One slot's KV cache at ``context`` tokens (keys and values in f16); 0 if the file does not say its shape."""
    width, heads = model.arch_value("embedding_length"), model.arch_value("attention.head_count")
    kv_heads = model.arch_value("attention.head_count_kv", heads)
    layers = model.arch_value("block_count")
    if not (width and heads and layers):
        return 0
    return 2 * layers * context * (width * kv_heads // heads) * 2


def footprint(path: Path, context_length: Optional[int], slots: int) -> int:
    """The memory a model takes loaded, estimated: its file, and each slot's KV cache at the context served."""
    size = path.stat().st_size
    if not is_gguf(path):
        return size
    model = read_gguf(path)
    context = int(context_length or model.context_length or DEFAULT_CONTEXT_LENGTH)
    return size + slots * kv_cache_bytes(model, context)


def describe(path: Path, context_length: Optional[int] = None) -> list[tuple[str, str]]:
    """What a user needs to know before serving a model file, as (label, text) rows."""
    model = read_gguf(path)
    get = model.get
    arch = model.architecture
    size = path.stat().st_size
    context = int(context_length or model.context_length or DEFAULT_CONTEXT_LENGTH)
    types = Counter(t.type_name for t in model.tensors)
    file_type = get("general.file_type")
    width, heads = model.arch_value("embedding_length"), model.arch_value("attention.head_count")
    kv_heads = model.arch_value("attention.head_count_kv", heads)
    layers = model.arch_value("block_count")
    rows = [
        ("file", f"{path.name} ({size / 1e6:.1f} MB, GGUF v{model.version})"),
        ("name", get("general.name") or "-"),
        ("architecture", arch),
        ("parameters", f"{sum(t.n_elements for t in model.tensors) / 1e6:.1f} M"),
        ("quantization", f"{_file_type_name(file_type)}; tensors: "
                         + ", ".join(f"{name} x{n}" for name, n in types.most_common())),
        ("context length", f"{model.context_length or '-'} trained; {context} served"),
        ("shape", f"layers {layers}, width {width}, heads {heads} ({kv_heads} for keys and values)"),
    ]
    try:
        tokenizer = GGUFTokenizer(model)
    except BadModelFile as exc:
        rows.append(("vocabulary", f"cannot be read: {exc}"))
    else:
        pre = f", pre-tokenizer {tokenizer.pre}" if tokenizer.pre else ""
        rows.append(("vocabulary", f"{tokenizer.kind}{pre}: {tokenizer.vocab_size} tokens, "
                                   f"{len(tokenizer.control)} control"))
        ends = ", ".join(f"{tokenizer.token_text(t)} ({t})" for t in sorted(tokenizer.end_ids))
        rows.append(("special tokens", f"BOS {_token(tokenizer, tokenizer.bos_id)}, EOS {_token(tokenizer, tokenizer.eos_id)}"
                                       f"; prompts start with BOS: {'yes' if tokenizer.add_bos else 'no'}"
                                       f"; generation ends at: {ends or '-'}"))
    template = model.chat_template
    lines = template.strip().splitlines() if template else []
    shown = "\n".join(lines[:6]) + (f"\n... ({len(lines)} lines)" if len(lines) > 6 else "")
    rows.append(("chat template", shown or "none in the file (the built-in chatml is used)"))
    if width and heads and layers:
        kv_cache = kv_cache_bytes(model, context)
        rows.append(("memory", f"{size / 1e6:.0f} MB of weights (memory-mapped, shared by all slots) "
                               f"+ {kv_cache / 1e6:.0f} MB of KV cache per slot at context {context}"))
    rows.append(("engine", _engine_verdict(model)))
    return rows


def _engine_verdict(model) -> str:
    """Which engine "auto" runs a file on, and why."""
    result = check(model)
    name = _auto_engine(result)
    if name == "ctransformers":
        return "ctransformers" + (f", from a prepared copy ({'; '.join(result.fixes)})" if result.fixes else "")
    why = "; ".join(result.problems)
    if name == "llama.cpp":
        return f"llama.cpp (ctransformers cannot: {why})"
    return f"none installed: ctransformers cannot ({why}); llama.cpp would: {EXTRA}"


def summary(path: Path) -> dict[str, str]:
    """A model file in one line's worth: architecture, quantization, trained context, which engine runs it."""
    try:
        model = read_gguf(path)
    except (OSError, BadModelFile) as exc:
        return {"architecture": "-", "quantization": "-", "context": "-", "engine": f"unreadable: {exc}"}
    result = check(model)
    engine = _auto_engine(result) or f"none installed ({EXTRA})"
    if result.runs and result.fixes:
        engine += " (prepared copy)"
    return {"architecture": model.architecture, "quantization": _file_type_name(model.get("general.file_type")),
            "context": str(model.context_length or "-"), "engine": engine}


def _token(tokenizer: GGUFTokenizer, token: Optional[int]) -> str:
    return "-" if token is None else f"{tokenizer.token_text(token)} ({token})"


def _file_type_name(file_type: Optional[int]) -> str:
    try:
        return gguf.LlamaFileType(file_type).name.removeprefix("MOSTLY_")
    except (TypeError, ValueError):
        return "-" if file_type is None else f"file type {file_type}"
