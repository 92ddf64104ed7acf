"""Reading and writing GGUF files: the header (metadata and tensor index), checked against the file.

The header is parsed here rather than with gguf.GGUFReader, which builds a
numpy view per array element: on a real vocabulary (49k tokens, 49k merges)
that takes seconds, this takes tens of milliseconds. A truncated file
memory-maps fine and then reads garbage, so every tensor's data must lie
inside the file before an engine sees it.
"""

import dataclasses
import functools
import mmap
import os
import struct
from pathlib import Path
from typing import Any, BinaryIO, Optional

import gguf
import numpy as np


class BadModelFile(ValueError):
    """The file is not a usable model file."""


# GGUF value types: (id, struct format) for scalars, numpy dtypes for arrays.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_DTYPES = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8", 12: "<f8"}
STRING, ARRAY = 8, 9


@dataclasses.dataclass
class Field:
    """One metadata value with its GGUF type (for arrays, the element type too)."""

    type: int
    value: Any  # str, a number, a list of str, or a numpy array
    item_type: Optional[int] = None


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """One tensor in the index: ``offset`` counts from the start of the data section."""

    name: str
    shape: tuple[int, ...]  # GGUF order: the fastest-varying dimension first
    type: int  # a ggml type id
    offset: int
    n_bytes: int

    @property
    def type_name(self) -> str:
        try:
            return gguf.GGMLQuantizationType(self.type).name
        except ValueError:
            return f"type {self.type}"

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


@dataclasses.dataclass(frozen=True)
class GGUFFile:
    """A GGUF file's header: its metadata, its tensors, and where their data starts (shared: never changed)."""

    path: Path
    version: int
    fields: dict[str, Field]
    tensors: list[TensorInfo]
    data_start: int
    alignment: int

    def get(self, key: str, default: Any = None) -> Any:
        field = self.fields.get(key)
        return default if field is None else field.value

    @property
    def architecture(self) -> str:
        return self.get("general.architecture") or "unknown"

    def arch_value(self, key: str, default: Any = None) -> Any:
        """An architecture's own key, such as ``llama.context_length``."""
        return self.get(f"{self.architecture}.{key}", default)

    @property
    def context_length(self) -> Optional[int]:
        return self.arch_value("context_length")

    @property
    def chat_template(self) -> Optional[str]:
        return self.get("tokenizer.chat_template")

    @property
    def sampling(self) -> dict[str, Any]:
        """The sampling its author recommends (``general.sampling.*``), by the keys' last part: ``temp``, ``top_k``..."""
        prefix = "general.sampling."
        return {key[len(prefix):]: field.value for key, field in self.fields.items() if key.startswith(prefix)}

    def tensor(self, name: str) -> Optional[TensorInfo]:
        return next((t for t in self.tensors if t.name == name), None)


def is_gguf(path: Path) -> bool:
    """Whether the file starts with the GGUF magic."""
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


class _Cursor:
    """Reads little-endian GGUF values from a buffer."""

    def __init__(self, buffer: memoryview) -> None:
        self.buffer = buffer
        self.at = 0

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buffer, self.at)
        self.at += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.scalar("<Q")
        end = self.at + n
        if end > len(self.buffer):
            raise BadModelFile("a string runs past the end of the file")
        text = bytes(self.buffer[self.at:end]).decode("utf-8", "surrogateescape")
        self.at = end
        return text

    def value(self, kind: int) -> Field:
        if kind == STRING:
            return Field(kind, self.string())
        if kind in _SCALARS:
            return Field(kind, self.scalar(_SCALARS[kind]))
        if kind != ARRAY:
            raise BadModelFile(f"unknown metadata value type {kind}")
        item_type, count = self.scalar("<I"), self.scalar("<Q")
        if item_type == STRING:
            return Field(kind, [self.string() for _ in range(count)], item_type)
        if item_type not in _DTYPES:
            raise BadModelFile(f"unsupported metadata array of type {item_type}")
        dtype = np.dtype(_DTYPES[item_type])
        end = self.at + count * dtype.itemsize
        if end > len(self.buffer):
            raise BadModelFile("an array runs past the end of the file")
        array = np.frombuffer(self.buffer[self.at:end], dtype=dtype).copy()
        self.at = end
        return Field(kind, array, item_type)


def _tensor_bytes(type_id: int, shape: tuple[int, ...]) -> int:
    try:
        block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(type_id)]
    except (ValueError, KeyError):
        raise BadModelFile(f"unknown tensor type {type_id}") from None
    return int(np.prod(shape, dtype=np.int64)) // block * size


def read_gguf(path: Path) -> GGUFFile:
    """Read and check a GGUF file's header; raise BadModelFile if unusable.

    A load asks for it several times (memory estimate, engine choice, the engine itself), and
    parsing a large vocabulary takes a noticeable part of a load (docs/ENGINES.rst): the last few
    files read are kept, each for as long as its size and modification time stay the same.
    """
    stat = os.stat(path)
    return _read_gguf(Path(path), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _read_gguf(path: Path, size: int, mtime_ns: int) -> GGUFFile:
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            with memoryview(mapped) as view:
                return _parse(path, view, size)
    except (struct.error, UnicodeError, OverflowError, MemoryError, ValueError) as exc:
        if isinstance(exc, BadModelFile):
            raise BadModelFile(f"{path.name}: {exc}") from None
        raise BadModelFile(f"{path.name}: not a readable GGUF file ({exc})") from None


def _parse(path: Path, view: memoryview, size: int) -> GGUFFile:
    cursor = _Cursor(view)
    if bytes(view[:4]) != b"GGUF":
        raise BadModelFile("not a GGUF file")
    cursor.at = 4
    version = cursor.scalar("<I")
    if version not in (2, 3):
        raise BadModelFile(f"GGUF version {version} is not supported (2 and 3 are)")
    n_tensors, n_fields = cursor.scalar("<Q"), cursor.scalar("<Q")
    fields = {}
    for _ in range(n_fields):
        key = cursor.string()
        fields[key] = cursor.value(cursor.scalar("<I"))
    tensors = []
    for _ in range(n_tensors):
        name = cursor.string()
        n_dims = cursor.scalar("<I")
        shape = tuple(cursor.scalar("<Q") for _ in range(n_dims))
        type_id, offset = cursor.scalar("<I"), cursor.scalar("<Q")
        tensors.append(TensorInfo(name, shape, type_id, offset, _tensor_bytes(type_id, shape)))
    alignment_field = fields.get("general.alignment")
    alignment = int(alignment_field.value) if alignment_field else 32
    data_start = -(-cursor.at // alignment) * alignment
    for tensor in tensors:
        if data_start + tensor.offset + tensor.n_bytes > size:
            raise BadModelFile(f"truncated (tensor {tensor.name} ends past the file)")
    return GGUFFile(path, version, fields, tensors, data_start, alignment)


class _Writer:
    """Writes GGUF values, the mirror image of _Cursor."""

    def __init__(self, out: BinaryIO) -> None:
        self.out = out

    def string(self, text: str) -> None:
        data = text.encode("utf-8", "surrogateescape")
        self.out.write(struct.pack("<Q", len(data)) + data)

    def field(self, key: str, field: Field) -> None:
        self.string(key)
        self.out.write(struct.pack("<I", field.type))
        if field.type == STRING:
            self.string(field.value)
        elif field.type in _SCALARS:
            self.out.write(struct.pack(_SCALARS[field.type], field.value))
        elif field.item_type == STRING:
            self.out.write(struct.pack("<IQ", STRING, len(field.value)))
            for item in field.value:
                self.string(item)
        else:
            array = np.asarray(field.value, dtype=_DTYPES[field.item_type])
            self.out.write(struct.pack("<IQ", field.item_type, len(array)) + array.tobytes())

    def pad(self, alignment: int) -> None:
        self.out.write(b"\0" * (-self.out.tell() % alignment))


def write_gguf_copy(source: GGUFFile, destination: Path, fields: dict[str, Field], extra: dict[str, str]) -> None:
    """Write ``source`` with other metadata, plus tensors copied from its own (new name -> source name)."""
    tensors = list(source.tensors)
    data_size = end = max((t.offset + t.n_bytes for t in tensors), default=0)
    copies = []
    for name, of in extra.items():
        original = source.tensor(of)
        offset = -(-end // source.alignment) * source.alignment
        tensors.append(dataclasses.replace(original, name=name, offset=offset))
        copies.append((offset, original))
        end = offset + original.n_bytes
    with open(source.path, "rb") as src, open(destination, "wb") as out:
        writer = _Writer(out)
        out.write(b"GGUF" + struct.pack("<IQQ", source.version, len(tensors), len(fields)))
        for key, field in fields.items():
            writer.field(key, field)
        for tensor in tensors:
            writer.string(tensor.name)
            out.write(struct.pack("<I", len(tensor.shape)) + struct.pack(f"<{len(tensor.shape)}Q", *tensor.shape))
            out.write(struct.pack("<IQ", tensor.type, tensor.offset))
        writer.pad(source.alignment)
        data_start = out.tell()
        src.seek(source.data_start)
        _copy(src, out, data_size)
        for offset, original in copies:
            out.write(b"\0" * (data_start + offset - out.tell()))
            src.seek(source.data_start + original.offset)
            _copy(src, out, original.n_bytes)


def _copy(src: BinaryIO, out: BinaryIO, n_bytes: int, chunk: int = 16 << 20) -> None:
    while n_bytes > 0:
        data = src.read(min(chunk, n_bytes))
        if not data:
            raise BadModelFile(f"{src.name}: ended early")
        out.write(data)
        n_bytes -= len(data)
