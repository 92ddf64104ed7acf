"""The ctransformers engine: GGUF (llama, falcon) and legacy GGML models.

Only the C functions of ctransformers' library are used, never its Python
generation loop, because of the traps listed in docs/ENGINES.rst: the shared
library is resolved once (no CPU probe per load), the context length is always
passed, and positions are tracked here so a slot's cache prefix survives
between requests. GGUF files are tokenized by kronk_wsgi's own tokenizer.
"""

import ctypes
import functools
import sys
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import pydantic
from ctransformers.lib import find_library
from ctransformers.llm import LLM, Config

from ..config import cache_dir
from .base import DEFAULT_CONTEXT_LENGTH, Engine, EngineError, EngineKind, EngineOptions, Fit, Slot
from .ctransformers_files import check, compatible_file
from .gguf_file import is_gguf, read_gguf
from .tokenizer import GGUFTokenizer, Tokenizer


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


class CTransformersOptions(EngineOptions):
    """What a model may set for this engine."""

    model_type: Optional[str] = None  # for legacy GGML files (gpt2, mpt, ...)
    # Prompt tokens per call: its speed against how soon a cancel is seen (docs/ENGINES.rst has the measurements).
    prefill_chunk: int = pydantic.Field(32, ge=1)


class CTransformersSlot(Slot):
    """One LLM instance: its own KV cache, used by one thread at a time."""

    def __init__(self, llm: LLM, threads: int, prefill_chunk: int) -> None:
        super().__init__()
        self._llm = llm
        self._threads = threads
        self.prefill_chunk = prefill_chunk
        self._n_vocab = llm.ctransformers_llm_vocab_size()

    def _eval(self, tokens: Sequence[int], n_past: int, pick=None) -> None:  # decode picks, on logits()
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


class CTokenizer(Tokenizer):
    """A legacy GGML file's tokenizer, in the C library: such files carry no metadata to build one from.

    They have no control tokens, so ``specials`` changes nothing.
    """

    def __init__(self, llm: LLM) -> None:
        self._llm = llm  # used by one thread at a time: the model's tokenizer thread
        self.vocab_size = llm.ctransformers_llm_vocab_size()
        self.bos_id, self.eos_id = llm.bos_token_id, llm.eos_token_id
        self.add_bos = llm.model_type == "llama"
        self.add_eos = False
        self.end_ids = frozenset({self.eos_id})
        self.control = {}
        self._pieces = [llm.ctransformers_llm_detokenize(t) or b"" for t in range(self.vocab_size)]
        self.longest_piece = max(4, max(map(len, self._pieces), default=0))

    def encode(self, text: str, specials: bool = True, inert: Optional[str] = None) -> list[int]:
        data = (text.replace(inert, "") if inert else text).encode("utf-8")
        # One token per byte at most, plus SentencePiece's leading space.
        buffer = (ctypes.c_int * (len(data) + 4))()
        return buffer[: self._llm.ctransformers_llm_tokenize(data, False, buffer)]

    def piece(self, token: int) -> bytes:
        return self._pieces[token]

    def decode(self, tokens: Sequence[int]) -> bytes:
        data = b"".join(self._pieces[t] for t in tokens)
        return data[1:] if self.add_bos and data.startswith(b" ") else data

    def token_text(self, token: Optional[int]) -> str:
        return "" if token is None else self._pieces[token].decode("utf-8", "replace")


class CTransformersEngine(Engine):
    """A model file loaded through ctransformers.

    A GGUF file is checked first (an unsupported one raises UnsupportedModel
    before the engine sees it), tokenized by kronk_wsgi from its metadata, and
    given to the engine as it is or as its prepared copy.
    """

    slot_class = CTransformersSlot

    def __init__(self, name: str, path: Path, context_length: Optional[int] = None,
                 options: CTransformersOptions = CTransformersOptions()) -> None:
        self.name = name
        self._model_type = options.model_type
        self._prefill_chunk = options.prefill_chunk
        if is_gguf(path):
            model = read_gguf(path)
            self._path = compatible_file(model, cache_dir())
            self.tokenizer = GGUFTokenizer(model)
            self.chat_template = model.chat_template
            file_context = model.context_length
        else:
            self._path = path
            # This instance only tokenizes: it never evaluates, so it needs no real cache.
            self.tokenizer = CTokenizer(_load(path, options.model_type, 8))
            self.chat_template = None
            file_context = None
        self.context_length = int(context_length or file_context or DEFAULT_CONTEXT_LENGTH)

    def new_slots(self, count: int, threads: int) -> list[CTransformersSlot]:
        """Each slot is its own engine instance: the file is memory-mapped once, each has its own KV cache."""
        slots = []
        for _ in range(count):
            llm = _load(self._path, self._model_type, self.context_length)
            if llm.ctransformers_llm_vocab_size() != self.tokenizer.vocab_size:
                raise EngineError(f"{self._path.name}: the engine's vocabulary differs from the file's tokenizer")
            slots.append(self.slot_class(llm, threads, self._prefill_chunk))
        return slots


def fit(path: Path) -> Fit:
    """Whether this engine runs a file (a legacy GGML file: only this engine reads those), and from a copy or not."""
    if not is_gguf(path):
        return Fit()
    result = check(read_gguf(path))
    if not result.runs:
        return Fit("; ".join(result.problems))
    return Fit(note=f"from a prepared copy ({'; '.join(result.fixes)})" if result.fixes else "")


KIND = EngineKind("ctransformers", CTransformersEngine, fit, options=CTransformersOptions)
