"""What a model file holds and takes: its memory footprint, and a description a user reads before serving it."""

import dataclasses
import functools
from collections import Counter
from pathlib import Path
from typing import Any, Optional

import gguf

from .catalog import local_file
from .config import ModelSpec
from .engine.base import DEFAULT_CONTEXT_LENGTH
from .engine.chat_template import ChatTemplate, template_for_vocabulary, template_source
from .engine.gguf_file import BadModelFile, is_gguf, read_gguf
from .engine.registry import ENGINES
from .engine.tokenizer import GGUFTokenizer, control_tokens
from .serving.formats import tool_rendering


# Sliding-window architectures: of each run of this many layers, the last attends to the whole context and the
# others to the window (as llama.cpp builds them).
SWA_PATTERNS = {"gemma2": 2, "gemma3": 6, "cohere2": 4}
SWA_BATCH = 512  # a window layer keeps the window plus a batch of cells


def kv_cache_bytes(model, context: int) -> int:
    """One slot's KV cache at ``context`` tokens (keys and values in f16); 0 if the file does not say its shape.

    Window layers of a sliding-window model hold the window (plus a batch), not the context.
    """
    width, heads = model.arch_value("embedding_length"), model.arch_value("attention.head_count")
    kv_heads = model.arch_value("attention.head_count_kv", heads)
    layers = model.arch_value("block_count")
    if not (width and heads and layers):
        return 0
    key = model.arch_value("attention.key_length", width // heads) * kv_heads
    value = model.arch_value("attention.value_length", width // heads) * kv_heads
    window, pattern = model.arch_value("attention.sliding_window"), SWA_PATTERNS.get(model.architecture)
    full = layers // pattern if window and pattern else layers
    cells = full * context + (layers - full) * min(context, (window or 0) + SWA_BATCH)
    return cells * (key + value) * 2


def footprint(path: Path, context_length: Optional[int], slots: int, draft: Optional[Path] = None,
              projector: Optional[Path] = None) -> int:
    """The memory a model takes loaded, estimated: its file, and each slot's KV cache at the context served; with
    its ``draft`` model's (speculative decoding) and its ``projector`` file too, where they are on disk."""
    size = path.stat().st_size + (projector.stat().st_size if projector is not None and projector.is_file() else 0)
    if not is_gguf(path):
        return size
    model = read_gguf(path)
    context = int(context_length or model.context_length or DEFAULT_CONTEXT_LENGTH)
    size += slots * kv_cache_bytes(model, context)
    if draft is not None and draft.is_file() and is_gguf(draft):
        size += draft.stat().st_size + slots * kv_cache_bytes(read_gguf(draft), context)
    return size


@dataclasses.dataclass(frozen=True)
class ModelFacts:
    """What a model file says about itself, read without loading it."""

    architecture: str
    parameters: int
    quantization: str
    context_length: Optional[int]  # as trained
    control: frozenset[str]  # the vocabulary's control tokens
    chat_template: Optional[str]  # the file's own
    metadata: dict[str, Any]  # every metadata key with its value; an array as a list
    sampling: dict[str, Any]  # the sampling its author recommends, ``general.sampling.*`` by the keys' last part

    def template_source(self, configured: Optional[str]) -> str:
        """The chat template a model of this file is served with."""
        return template_source(configured, self.chat_template, self.control)


def file_facts(spec: ModelSpec) -> Optional[tuple[Path, ModelFacts]]:
    """Blocking: the model's file and what it says, if the file is on this machine and a GGUF file."""
    path = local_file(spec)
    if path is None or not path.is_file():
        return None
    try:
        return path, model_facts(path)
    except (OSError, BadModelFile):
        return None


def model_facts(path: Path) -> ModelFacts:
    """The facts of a GGUF file, read once while it stays the same (BadModelFile, OSError)."""
    stat = path.stat()
    return _facts(path, stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=64)
def _facts(path: Path, size: int, mtime_ns: int) -> ModelFacts:
    model = read_gguf(path)
    metadata = {key: field.value.tolist() if hasattr(field.value, "tolist") else field.value
                for key, field in model.fields.items()}
    return ModelFacts(
        model.architecture, sum(t.n_elements for t in model.tensors), _file_type_name(model.get("general.file_type")),
        model.context_length, frozenset(control_tokens(model)), model.chat_template, metadata, model.sampling,
    )


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
    control: dict[str, int] = {}
    try:
        tokenizer = GGUFTokenizer(model)
    except BadModelFile as exc:
        rows.append(("vocabulary", f"cannot be read: {exc}"))
    else:
        control = tokenizer.control
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
    chosen = template_for_vocabulary(control)
    rows.append(("chat template", shown or f"none in the file: the built-in {chosen}, as the vocabulary's turn "
                                           "markers say"))
    rendering = tool_rendering(ChatTemplate(template_source(None, template, control), control_tokens=control))
    rows.append(("tools", f"rendered by {rendering}"))
    if width and heads and layers:
        kv_cache = kv_cache_bytes(model, context)
        rows.append(("memory", f"{size / 1e6:.0f} MB of weights (memory-mapped, shared by all slots) "
                               f"+ {kv_cache / 1e6:.0f} MB of KV cache per slot at context {context}"))
    rows.append(("engine", engine_verdict(path)))
    return rows


def engine_verdict(path: Path, short: bool = False) -> str:
    """Which engine "auto" runs a file on, and why not the ones before it (``short``: its name only)."""
    verdicts = ENGINES.verdicts(path)
    refused = "; ".join(f"{kind.name} cannot ({fit.problem})" for kind, fit in verdicts if fit.problem)
    for kind, fit in verdicts:
        if fit.problem is None and kind.available():
            shown = kind.name + (f", {fit.note}" if fit.note and not short else "")
            return f"{shown} ({refused})" if refused and not short else shown
    if short:
        return "none installed"
    missing = ", ".join(f"{kind.name} would: {kind.missing}" for kind, fit in verdicts if fit.problem is None)
    return f"none installed: {refused}" + (f"; {missing}" if missing else "")


def summary(path: Path) -> dict[str, str]:
    """A model file in one line's worth: architecture, quantization, trained context, which engine runs it."""
    try:
        model = read_gguf(path)
    except (OSError, BadModelFile) as exc:
        return {"architecture": "-", "quantization": "-", "context": "-", "engine": f"unreadable: {exc}"}
    return {"architecture": model.architecture, "quantization": _file_type_name(model.get("general.file_type")),
            "context": str(model.context_length or "-"), "engine": engine_verdict(path, short=True)}


def _token(tokenizer: GGUFTokenizer, token: Optional[int]) -> str:
    return "-" if token is None else f"{tokenizer.token_text(token)} ({token})"


def _file_type_name(file_type: Optional[int]) -> str:
    try:
        return gguf.LlamaFileType(file_type).name.removeprefix("MOSTLY_")
    except (TypeError, ValueError):
        return "-" if file_type is None else f"file type {file_type}"
