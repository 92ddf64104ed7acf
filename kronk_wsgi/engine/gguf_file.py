"""Reading a GGUF file's header: metadata, and a check that it is whole.

A truncated file memory-maps fine and then reads garbage (ENGINE-FACTS trap
6), so every tensor's data must lie inside the file before the engine sees it.
"""

import dataclasses
import os
from pathlib import Path
from typing import Any, Optional

import gguf


class BadModelFile(ValueError):
    """The file is not a usable model file."""


@dataclasses.dataclass(frozen=True)
class GGUFInfo:
    """What kronk_wsgi needs from a GGUF header."""

    architecture: str
    context_length: Optional[int]
    chat_template: Optional[str]
    bos_token: str
    eos_token: str


def is_gguf(path: Path) -> bool:
    """Whether the file starts with the GGUF magic."""
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def _value(field: gguf.ReaderField) -> Any:
    if not field.types:
        return None
    if field.types[0] == gguf.GGUFValueType.ARRAY:
        if field.types[-1] == gguf.GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8", "replace") for i in field.data]
        return [field.parts[i].tolist()[0] for i in field.data]
    part = field.parts[field.data[0]]
    if field.types[0] == gguf.GGUFValueType.STRING:
        return bytes(part).decode("utf-8", "replace")
    return part.tolist()[0]


def read_gguf(path: Path) -> GGUFInfo:
    """Read and check a GGUF file's header; raise BadModelFile if unusable."""
    try:
        reader = gguf.GGUFReader(path)
    except Exception as exc:  # the reader raises many types for bad files
        raise BadModelFile(f"{path.name}: not a readable GGUF file ({exc})") from None
    size = os.path.getsize(path)
    for tensor in reader.tensors:
        end = int(tensor.data_offset) + int(tensor.n_bytes)
        if end > size:
            raise BadModelFile(f"{path.name}: truncated (tensor {tensor.name} ends past the file)")
    fields = {name: _value(field) for name, field in reader.fields.items()}
    arch = fields.get("general.architecture") or "unknown"
    tokens = fields.get("tokenizer.ggml.tokens") or []

    def token(key: str, default: str) -> str:
        index = fields.get(key)
        return tokens[index] if isinstance(index, int) and index < len(tokens) else default

    return GGUFInfo(
        architecture=arch,
        context_length=fields.get(f"{arch}.context_length"),
        chat_template=fields.get("tokenizer.chat_template"),
        bos_token=token("tokenizer.ggml.bos_token_id", "<s>"),
        eos_token=token("tokenizer.ggml.eos_token_id", "</s>"),
    )
