"""The ctransformers engine: GGUF (llama, falcon) and legacy GGML models.

Only the C functions of ctransformers' library are used, never its Python
generation loop, because of the traps listed in ENGINE-FACTS.md: the shared
library is resolved once (no CPU probe per load), the context length is always
passed, tokenizing gets a buffer sized from the UTF-8 length, and positions are
tracked here so a slot's cache prefix survives between requests.
"""

import ctypes
import functools
import sys
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
from ctransformers.llm import LLM, Config
from ctransformers.lib import find_library

from .base import Engine, EngineError, Slot
from .gguf_file import is_gguf, read_gguf


@functools.lru_cache(maxsize=None)
def shared_library() -> str:
    """Path of the best prebuilt library for this CPU, chosen once per process.

    On Linux the CPU flags are read from /proc/cpuinfo: ctransformers' own
    probe starts a subprocess, which cannot run in a worker thread under gevent.
    """
    cpuinfo = Path("/proc/cpuinfo")
    if sys.platform != "linux" or not cpuinfo.is_file():
        return find_library(None)
    flags = set()
    for line in cpuinfo.read_text().splitlines():
        if line.startswith("flags"):
            flags = set(line.partition(":")[2].split())
            break
    variant = "avx2" if "avx2" in flags else "avx" if {"avx", "f16c"} <= flags else "basic"
    return find_library(variant)


def _load(path: Path, model_type: Optional[str], context_length: int) -> LLM:
    config = Config(context_length=context_length, gpu_layers=0)
    try:
        return LLM(str(path), model_type, config=config, lib=shared_library())
    except (RuntimeError, ValueError, OSError) as exc:
        raise EngineError(f"ctransformers could not load {path.name}: {exc}") from None


class CTransformersSlot(Slot):
    """One LLM instance: its own KV cache, used by one thread at a time."""

    def __init__(self, llm: LLM, threads: int) -> None:
        super().__init__()
        self._llm = llm
        self._threads = threads
        self._n_vocab = llm.ctransformers_llm_vocab_size()

    def _eval(self, tokens: Sequence[int], n_past: int) -> None:
        array = (ctypes.c_int * len(tokens))(*tokens)
        ok = self._llm.ctransformers_llm_batch_eval(array, len(tokens), n_past, len(tokens), self._threads)
        if not ok:
            raise EngineError("ctransformers failed to evaluate tokens")

    def logits(self) -> np.ndarray:
        data = self._llm.ctransformers_llm_logits_data()
        return np.ctypeslib.as_array(data, shape=(self._n_vocab,)).copy()

    def embedding(self) -> np.ndarray:
        size = self._llm.ctransformers_llm_embeddings_size()
        if size <= 0:
            raise EngineError("this model does not give embeddings")
        return np.ctypeslib.as_array(self._llm.ctransformers_llm_embeddings_data(), shape=(size,)).copy()

    def token_bytes(self, token: int) -> bytes:
        return self._llm.ctransformers_llm_detokenize(token) or b""

    def is_eos(self, token: int) -> bool:
        return bool(self._llm.ctransformers_llm_is_eos_token(token))


class CTransformersEngine(Engine):
    """A model file loaded through ctransformers."""

    slot_class = CTransformersSlot

    def __init__(self, name: str, path: Path, context_length: Optional[int] = None, model_type: Optional[str] = None):
        self.name = name
        self._path = path
        self._model_type = model_type
        info = read_gguf(path) if is_gguf(path) else None
        self.chat_template = info.chat_template if info else None
        self.bos_token = info.bos_token if info else "<s>"
        self.eos_token = info.eos_token if info else "</s>"
        file_context = info.context_length if info else None
        self.context_length = int(context_length or file_context or 2048)
        # This instance only tokenizes: it never evaluates, so it needs no real cache.
        self._tokenizer = _load(path, model_type, 8)
        self.vocab_size = self._tokenizer.ctransformers_llm_vocab_size()
        self._add_bos = self._tokenizer.model_type == "llama"

    def tokenize(self, text: str, add_bos: bool = True) -> list[int]:
        data = text.encode("utf-8")
        # One token per byte at most, plus BOS and SentencePiece's leading space.
        buffer = (ctypes.c_int * (len(data) + 4))()
        n = self._tokenizer.ctransformers_llm_tokenize(data, add_bos and self._add_bos, buffer)
        return buffer[:n]

    def detokenize(self, tokens: Sequence[int]) -> bytes:
        data = b"".join(self._tokenizer.ctransformers_llm_detokenize(t) or b"" for t in tokens)
        # SentencePiece (llama) puts a space before the text it tokenizes; its decode leaves it out.
        return data[1:] if self._add_bos and data.startswith(b" ") else data

    def new_slot(self, threads: int) -> CTransformersSlot:
        return self.slot_class(_load(self._path, self._model_type, self.context_length), threads)
