"""Which GGUF files the ctransformers engine can run, and the compatible copy some of them need.

ctransformers carries a llama.cpp of August 2023 (docs/ENGINES.rst says what
it requires of a file, and what it does with a file it cannot run: often a
failed load, sometimes a crash of the whole process). Every file is checked
here before the engine sees it. Today's llama files usually differ from what
it expects in three ways that a copy can mend: a byte-level BPE vocabulary
(the loader looks up the raw text "\\n", which such a vocabulary spells "Ċ"),
no ``tokenizer.ggml.scores``, and tied embeddings (no ``output.weight``). The
copy is written once into kronk_wsgi's cache directory, named after the
source file's path, size and modification time; the source is never changed.
"""

import dataclasses
import hashlib
import os
import tempfile
from pathlib import Path
from typing import Optional

import numpy as np
import structlog

from .gguf_file import ARRAY, STRING, BadModelFile, Field, GGUFFile, write_gguf_copy
from .tokenizer import CONTROL, NORMAL, byte_level_bytes

log = structlog.get_logger("kronk_wsgi.engine")

ARCHITECTURES = ("llama", "falcon")
# F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K
TENSOR_TYPES = frozenset({0, 1, 2, 3, 6, 7, 8, 10, 11, 12, 13, 14})
VOCABULARIES = ("llama", "gpt2")
LLAMA_LAYER_TENSORS = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up",
                       "ffn_down")
LLAMA_HPARAMS = ("context_length", "embedding_length", "feed_forward_length", "attention.head_count", "block_count",
                 "attention.layer_norm_rms_epsilon")
SPECIAL_IDS = ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id", "tokenizer.ggml.unknown_token_id",
               "tokenizer.ggml.seperator_token_id", "tokenizer.ggml.padding_token_id")
BPE_DEFAULT_ID = 11  # the BOS and EOS a BPE vocabulary gets when the file names none
# Bumped whenever the copy changes, so older copies are not reused.
COPY_FORMAT = "2"


class UnsupportedModel(BadModelFile):
    """A file this engine cannot run; the message says why."""


@dataclasses.dataclass(frozen=True)
class Compatibility:
    """What the engine makes of a file: why it cannot run it, or what a copy must change."""

    problems: tuple[str, ...]
    fixes: tuple[str, ...]

    @property
    def runs(self) -> bool:
        return not self.problems


def check(model: GGUFFile) -> Compatibility:
    """Everything this engine needs of ``model``, without loading it."""
    problems: list[str] = []
    fixes: list[str] = []
    arch = model.architecture
    if arch not in ARCHITECTURES:
        problems.append(f"architecture {arch!r}: this engine runs only {' and '.join(ARCHITECTURES)}")
    bad_types = sorted({t.type_name for t in model.tensors if t.type not in TENSOR_TYPES})
    if bad_types:
        problems.append(f"tensor type {', '.join(bad_types)}: this engine runs F32, F16, Q4_0-Q8_0 and Q2_K-Q6_K")
    vocabulary = model.get("tokenizer.ggml.model")
    if vocabulary not in VOCABULARIES:
        problems.append(f"vocabulary kind {vocabulary!r}: this engine reads only {' and '.join(VOCABULARIES)}")
    elif vocabulary == "llama":
        if "<0x0A>" not in model.get("tokenizer.ggml.tokens", []):
            problems.append("the SentencePiece vocabulary has no byte token <0x0A>")
        if model.get("tokenizer.ggml.scores") is None:
            problems.append("the SentencePiece vocabulary has no scores")
    else:
        if model.get("tokenizer.ggml.merges") is None:
            problems.append("the BPE vocabulary has no merges")
        if not {"\n", "Ċ"} & set(model.get("tokenizer.ggml.tokens", [])):
            problems.append("the BPE vocabulary has no newline token")
        if _byte_level(model):
            fixes.append("byte-level vocabulary spelled as raw bytes")
        if model.get("tokenizer.ggml.scores") is None:
            fixes.append("token scores added")
    if model.get("tokenizer.ggml.token_type") is None:
        fixes.append("token types added")
    n_vocab = len(model.get("tokenizer.ggml.tokens", []))
    for key in SPECIAL_IDS:
        token = model.get(key)
        if token is not None and not 0 <= token < n_vocab:
            problems.append(f"{key} {token} lies outside the vocabulary of {n_vocab}")
    if _unset_special_ids(model):
        fixes.append("special token ids set (the engine's defaults lie outside the vocabulary)")
    if arch == "llama":
        _check_llama(model, problems, fixes)
    return Compatibility(tuple(problems), tuple(fixes))


def _check_llama(model: GGUFFile, problems: list[str], fixes: list[str]) -> None:
    missing = [key for key in LLAMA_HPARAMS if model.arch_value(key) is None]
    if missing:
        problems.append(f"missing llama.{', llama.'.join(missing)}")
        return
    width, heads = model.arch_value("embedding_length"), model.arch_value("attention.head_count")
    rope = model.arch_value("rope.dimension_count", width // heads)
    if rope != width // heads:
        problems.append(f"rope dimension {rope} is not the head size {width // heads}")
    q = model.tensor("blk.0.attn_q.weight")
    if q is not None and q.shape[:2] != (width, width):
        problems.append(f"attention width {q.shape[1]} differs from the model width {width} (heads of their own size)")
    scaling = model.arch_value("rope.scaling.type", "none")
    if scaling == "linear":
        fixes.append("linear rope scaling in the engine's key")
    elif scaling != "none":
        problems.append(f"rope scaling {scaling!r}: this engine knows only linear scaling")
    layers = model.arch_value("block_count")
    expected = {"token_embd.weight", "output_norm.weight", "output.weight"}
    expected |= {f"blk.{i}.{name}.weight" for i in range(layers) for name in LLAMA_LAYER_TENSORS}
    names = {t.name for t in model.tensors}
    unknown = sorted(names - expected)
    if unknown:
        shown = ", ".join(unknown[:4]) + (f" and {len(unknown) - 4} more" if len(unknown) > 4 else "")
        hint = " (Llama 3.1 rope scaling)" if "rope_freqs.weight" in unknown else ""
        problems.append(f"tensors this engine does not know: {shown}{hint}")
    missing_tensors = sorted(expected - names - {"output.weight"})
    if missing_tensors:
        problems.append(f"missing tensors: {', '.join(missing_tensors[:4])}")
    if "output.weight" not in names:
        if "token_embd.weight" in names:
            fixes.append("tied embeddings: output.weight copied from token_embd.weight")
        else:
            problems.append("missing tensors: output.weight")


def _unset_special_ids(model: GGUFFile) -> list[str]:
    """BOS/EOS keys a BPE file lacks, where the engine's default for them (11) is not a token."""
    if model.get("tokenizer.ggml.model") != "gpt2" or len(model.get("tokenizer.ggml.tokens", [])) > BPE_DEFAULT_ID:
        return []
    return [key for key in SPECIAL_IDS[:2] if model.get(key) is None]


def _byte_level(model: GGUFFile) -> bool:
    """Whether a BPE vocabulary spells its tokens in GPT-2's byte-level alphabet ("Ġthe", "Ċ")."""
    tokens = model.get("tokenizer.ggml.tokens") or []
    return "\n" not in tokens and "Ċ" in tokens


def compatible_file(model: GGUFFile, cache: Path) -> Path:
    """The file to give the engine: the model itself, or its prepared copy; UnsupportedModel if it cannot run."""
    result = check(model)
    if not result.runs:
        raise UnsupportedModel(f"{model.path.name} cannot run on the ctransformers engine: {'; '.join(result.problems)}")
    if not result.fixes:
        return model.path
    source = model.path.resolve()
    stat = source.stat()
    key = hashlib.sha256(f"{source}|{stat.st_size}|{stat.st_mtime_ns}|{COPY_FORMAT}".encode()).hexdigest()[:16]
    target = cache / "prepared" / f"{source.stem}-{key}.gguf"
    if target.is_file():
        log.info("using the prepared copy of a model file", source=str(source), copy=str(target))
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".partial")
    os.close(fd)
    try:
        _write_copy(model, Path(tmp))
        os.replace(tmp, target)  # concurrent workers each write their own, the last rename wins
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    log.info("prepared a copy of a model file for the ctransformers engine", source=str(source), copy=str(target),
             changes=list(result.fixes))
    return target


def _write_copy(model: GGUFFile, path: Path) -> None:
    fields = dict(model.fields)
    tokens = model.get("tokenizer.ggml.tokens")
    types = model.get("tokenizer.ggml.token_type")
    if types is None:
        types = np.full(len(tokens), NORMAL, dtype=np.int32)
        fields["tokenizer.ggml.token_type"] = Field(ARRAY, types, 5)
    if model.get("tokenizer.ggml.scores") is None:
        fields["tokenizer.ggml.scores"] = Field(ARRAY, np.zeros(len(tokens), dtype=np.float32), 6)
    if model.get("tokenizer.ggml.model") == "gpt2" and _byte_level(model):
        fields["tokenizer.ggml.tokens"] = Field(ARRAY, [_raw(text, kind) for text, kind in zip(tokens, types)], STRING)
    for key in _unset_special_ids(model):
        fields[key] = Field(4, 0)
    extra = {"output.weight": "token_embd.weight"} if model.tensor("output.weight") is None else {}
    if model.arch_value("rope.scaling.type") == "linear":
        fields[f"{model.architecture}.rope.scale_linear"] = Field(6, float(model.arch_value("rope.scaling.factor", 1.0)))
    write_gguf_copy(model, path, fields, extra)


def _raw(text: str, kind: int) -> str:
    """A byte-level token as the raw bytes it stands for (kept as surrogate escapes); control tokens as they are."""
    if kind == CONTROL:
        return text
    raw: Optional[bytes] = byte_level_bytes(text)
    return text if raw is None else raw.decode("utf-8", "surrogateescape")
