"""The llama.cpp engine: today's llama.cpp through llama-cpp-python's low-level API.

It runs every model family llama.cpp runs. All slots of a model are
sequences of one llama.cpp context; their decode calls are batched: one thread
makes every call, each for all the slots waiting (a new prompt's chunk with the
running streams' next tokens), so N streams cost about one call per step
instead of N. Tokenizing, sampling and stopping stay kronk_wsgi's: the engine
takes token ids and gives logits. With a multimodal projector (``mmproj``),
llama.cpp's mtmd library decodes images and sounds into its chunks, and
encodes and decodes each into the context in the decode thread, between two
decode calls, as llama-server does.

Needs the optional extra ``kronk_wsgi[llamacpp]`` (llama-cpp-python, built
from source when installed).
"""

import collections
import ctypes
import functools
import hashlib
import socket
import weakref
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np
import pydantic
from gevent import monkey

from .base import (DEFAULT_CONTEXT_LENGTH, Cancelled, Engine, EngineError, EngineKind, EngineOptions, Fit, Media,
                   MediaError, Pick, Slot, media_ids)
from .gguf_file import is_gguf, read_gguf
from .speculation import DraftCosts
from .tokenizer import GGUFTokenizer

try:
    import llama_cpp
except ImportError:  # the extra is not installed
    llama_cpp = None
try:
    from llama_cpp import mtmd_cpp
except (ImportError, OSError):  # a wheel built without its multimodal library
    mtmd_cpp = None

# Engine calls run in real OS threads; under gevent's monkey-patching the threading
# module makes greenlets and greenlet locks, so these are taken from before it.
_allocate_lock = monkey.get_original("_thread", "allocate_lock")
_monotonic = monkey.get_original("time", "monotonic")
_start_thread = monkey.get_original("_thread", "start_new_thread")
_get_ident = monkey.get_original("_thread", "get_ident")

BATCH = 512  # tokens in one decode call: prompt chunks plus the other slots' next tokens
SHARED_CHUNK = 64  # prompt tokens per call beside running streams, which wait for each call
RPC_CONNECT_SECONDS = 5.0  # an rpc-server has to accept a connection before a load gives up on it
CANCEL_POLL_SECONDS = 0.05  # how often a slot waiting for its prompt's call asks whether it was cancelled
# How long a call waits for the slots of the last call to come back with their next tokens
# (they detokenize and check stops in between): long enough for that, short against a decode step.
GATHER_SECONDS = 0.01
# Images kept decoded beyond those a prompt holds, by their hash (a request tokenizes its prompt more than once; a
# conversation sends them again): each holds the image as its projector reads it, up to tens of megabytes
MEDIA_KEPT = 8


def available() -> bool:
    return llama_cpp is not None


_log_callback = None  # keeps llama.cpp's messages from stderr (it logs every load there otherwise)
# Its latest error messages, per calling thread (two models may load at once), for our own errors.
_errors: collections.defaultdict = collections.defaultdict(lambda: collections.deque(maxlen=4))
LOG_ERROR = 4  # ggml's log level of errors
_backend_lock = _allocate_lock()  # the backend starts once, and a dead decode thread is replaced once


def _keep_errors(level: int, text: bytes, user_data) -> None:
    if level == LOG_ERROR and text.strip():
        _errors[_get_ident()].append(text.decode("utf-8", "replace").strip())


def _start_backend() -> None:
    global _log_callback
    with _backend_lock:
        if _log_callback is None:
            _log_callback = llama_cpp.llama_log_callback(_keep_errors)
            llama_cpp.llama_log_set(_log_callback, ctypes.c_void_p())
            if mtmd_cpp is not None:  # the multimodal library logs apart
                mtmd_cpp.mtmd_helper_log_set(_log_callback, ctypes.c_void_p())
            llama_cpp.llama_backend_init()


def _rpc_devices(servers: Sequence[str]) -> ctypes.Array:
    """llama.cpp's devices for ``servers`` (rpc-server processes, HOST:PORT), as a NULL-terminated array; each is
    reached first, since llama.cpp aborts the process on one it cannot reach. EngineError if one does not answer."""
    if not llama_cpp.llama_supports_rpc():
        raise EngineError("rpc_servers: this llama-cpp-python was built without RPC (CMAKE_ARGS=-DGGML_RPC=ON)")
    for server in servers:
        host, _, port = server.rpartition(":")
        try:
            socket.create_connection((host, int(port)), timeout=RPC_CONNECT_SECONDS).close()
        except OSError as exc:
            raise EngineError(f"rpc_servers: the rpc-server {server} does not answer ({exc})") from None
    devices = []
    with _backend_lock:
        rpc, base = _rpc_libraries()
        for server in servers:
            registry = rpc.ggml_backend_rpc_add_server(server.encode())
            count = base.ggml_backend_reg_dev_count(registry)
            devices += [base.ggml_backend_reg_dev_get(registry, i) for i in range(count)]
    return (ctypes.c_void_p * (len(devices) + 1))(*devices, None)


@functools.cache
def _rpc_libraries() -> tuple[ctypes.CDLL, ctypes.CDLL]:
    """ggml's RPC backend and ggml's base (its registry of devices), beside llama-cpp-python's llama.cpp."""
    folder = Path(llama_cpp.__file__).parent / "lib"
    rpc = ctypes.CDLL(str(folder / "libggml-rpc.so"))
    rpc.ggml_backend_rpc_add_server.argtypes = [ctypes.c_char_p]
    rpc.ggml_backend_rpc_add_server.restype = ctypes.c_void_p
    base = ctypes.CDLL(str(folder / "libggml-base.so"))
    base.ggml_backend_reg_dev_count.argtypes = [ctypes.c_void_p]
    base.ggml_backend_reg_dev_count.restype = ctypes.c_size_t
    base.ggml_backend_reg_dev_get.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    base.ggml_backend_reg_dev_get.restype = ctypes.c_void_p
    return rpc, base


def _live_decode_thread() -> "_DecodeThread":
    """The decode thread; a new one if there is none yet or the last one died (its calls failed, none hang)."""
    global _decode_thread
    with _backend_lock:
        if _decode_thread is None or _decode_thread.dead is not None:
            _decode_thread = _DecodeThread()
        return _decode_thread


class _ThreadpoolParams(ctypes.Structure):
    """ggml's struct ggml_threadpool_params (llama-cpp-python does not bind the threadpool calls)."""

    _fields_ = [("cpumask", ctypes.c_bool * 512), ("n_threads", ctypes.c_int), ("prio", ctypes.c_int),
                ("poll", ctypes.c_uint32), ("strict_cpu", ctypes.c_bool), ("paused", ctypes.c_bool)]


def _ggml(name: str) -> ctypes.CDLL:
    return ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / name))


def _attach_threadpool(ctx, threads: int):
    """Give a context its own threadpool, kept between calls, as llama-server does.

    A ggml built without OpenMP would otherwise start and stop its threads in
    every decode call. With OpenMP (the default Linux build) the calling
    thread's team does the work, and it changes nothing measurable.
    """
    base, cpu = _ggml("libggml-base.so"), _ggml("libggml-cpu.so")
    base.ggml_threadpool_params_default.restype = _ThreadpoolParams
    base.ggml_threadpool_params_default.argtypes = [ctypes.c_int]
    cpu.ggml_threadpool_new.restype = ctypes.c_void_p
    cpu.ggml_threadpool_new.argtypes = [ctypes.POINTER(_ThreadpoolParams)]
    params = base.ggml_threadpool_params_default(threads)
    pool = cpu.ggml_threadpool_new(ctypes.byref(params))
    if not pool:
        raise EngineError(f"ggml could not start a threadpool of {threads} threads")
    attach = llama_cpp.llama_cpp._lib.llama_attach_threadpool
    attach.argtypes, attach.restype = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p], None
    attach(ctx, pool, pool)
    return pool


def _free_threadpool(pool) -> None:
    free = _ggml("libggml-cpu.so").ggml_threadpool_free
    free.argtypes, free.restype = [ctypes.c_void_p], None
    free(pool)


class _AbortFlag:
    """A flag that stops a context's running decode call between two steps of its graph.

    ggml asks the context's abort callback after each step, in a compute thread: a Python
    callback would need the GIL there, between every two steps. The callback is ggml's own
    ``ggml_get_no_alloc``, reading a field of a zeroed block that stands in for a ggml
    context, and ``ggml_set_no_alloc`` writes it: no Python runs while llama.cpp computes.
    """

    def __init__(self, ctx) -> None:
        base = _ggml("libggml-base.so")
        self._set = base.ggml_set_no_alloc
        self._set.argtypes, self._set.restype = [ctypes.c_void_p, ctypes.c_bool], None
        self._block = ctypes.create_string_buffer(256)  # more than a struct ggml_context takes
        self._callback = llama_cpp.ggml_abort_callback(ctypes.cast(base.ggml_get_no_alloc, ctypes.c_void_p).value)
        llama_cpp.llama_set_abort_callback(ctx, self._callback, ctypes.cast(self._block, ctypes.c_void_p))

    def set(self, value: bool) -> None:
        self._set(ctypes.cast(self._block, ctypes.c_void_p), value)


def _failure(what: str) -> EngineError:
    said = "; ".join(_errors.pop(_get_ident(), ()))
    return EngineError(what + (f" (llama.cpp: {said})" if said else ""))


class _Call:
    """One slot's tokens waiting for a decode call, and what the call gives back.

    With ``pick``, the decode thread picks the next token from the logits where llama.cpp left
    them, right after the call (``picked``, or ``pick_error``), instead of copying them out.
    """

    def __init__(self, seq: int, tokens: Sequence[int], n_past: int, embedding: bool = False,
                 pick: Optional[Pick] = None, action: Optional[Callable[[], object]] = None,
                 every: bool = False) -> None:
        self.seq, self.tokens, self.n_past = seq, tokens, n_past
        self.every = every  # logits after each of its tokens (one row each), not only after the last
        self.action = action  # instead of tokens: work on the context (a state's save or load), in a call alone
        self.result: object = None
        self.wants_embedding = embedding
        self.pick = pick
        self.picked: Optional[int] = None
        self.pick_error: Optional[Exception] = None
        self.logits: Optional[np.ndarray] = None
        self.embedding: Optional[np.ndarray] = None
        self.error: Optional[str] = None
        self.aborted = False  # stopped mid-call because its request was cancelled
        self.done = _allocate_lock()
        self.done.acquire()  # released when the call is over


class _DecodeThread:
    """The one OS thread that makes every llama.cpp decode call of this process, as llama-server does.

    llama.cpp runs a call's threads as an OpenMP team of the calling thread. Each thread that
    ever calls gets a team of its own, and once teams outnumber the cores, the barriers between
    a graph's steps stop spinning and sleep: a stream decoded from a second calling thread ran
    less than half as fast (docs/ENGINES.rst). So slot threads hand their tokens to this
    thread and wait. Each call it makes takes every waiting slot of one model; before a call it
    gives the slots of that model's previous call up to GATHER_SECONDS after it to come back with their
    next tokens (they detokenize and check stops in between), so a model's streams advance together,
    one call per step. After a call it picks each slot's next token (the slot's own sampler, given with
    its tokens) on the logits where llama.cpp left them, before the next call overwrites them.
    """

    def __init__(self) -> None:
        self._lock = _allocate_lock()  # guards every batcher's waiting calls, _ready and _sleeping
        self._wake = _allocate_lock()
        self._wake.acquire()  # released by submit() while the thread sleeps
        self._sleeping = False
        self._ready: collections.deque = collections.deque()  # batchers with waiting calls, in turn
        self.dead: Optional[str] = None  # why the thread died, if it did
        self._current: Optional["_Batcher"] = None  # the batcher being served
        _start_thread(self._serve, ())

    def submit(self, batcher: "_Batcher", call: _Call, cancelled: Optional[Callable[[], bool]]) -> None:
        """Queue a call and wait until it is done; once ``cancelled()``, abort it if it runs alone."""
        with self._lock:
            if self.dead is not None:
                call.error = self.dead
                return
            batcher.waiting.append(call)
            if batcher not in self._ready:
                self._ready.append(batcher)
            if self._sleeping:
                self._sleeping = False
                self._wake.release()
        if cancelled is None:
            call.done.acquire()
            return
        aborted = False
        while not call.done.acquire(timeout=CANCEL_POLL_SECONDS):
            if not aborted and cancelled():
                with self._lock:
                    if batcher.running == [call]:  # a call with other slots' tokens runs to its end
                        batcher.abort.set(True)
                        aborted = True

    def _sleep(self, timeout: float) -> None:
        """Wait for submit() (after setting _sleeping), or ``timeout`` seconds (-1: no limit)."""
        woken = self._wake.acquire(timeout=timeout)
        with self._lock:
            if not woken and not self._sleeping:  # submit() released the lock just after the timeout
                self._wake.acquire()
            self._sleeping = False

    def _serve(self) -> None:
        try:
            self._serve_calls()
        except BaseException as exc:  # a bug here must not leave every slot waiting for ever
            self._die(f"the llama.cpp decode thread stopped: {exc!r}")

    def _die(self, reason: str) -> None:
        """Fail every call waiting or running; later calls go to a new thread (_live_decode_thread)."""
        with self._lock:
            self.dead = reason
            batchers = set(self._ready) | ({self._current} if self._current is not None else set())
            calls = [c for batcher in batchers for c in batcher.waiting + batcher.running]
            for batcher in batchers:
                batcher.waiting, batcher.running = [], []
            self._ready.clear()
        for call in calls:
            call.error = reason
            if call.done.locked():
                call.done.release()

    def _serve_calls(self) -> None:
        while True:
            with self._lock:
                while self._ready and not self._ready[0].waiting:  # its calls went in an earlier round
                    self._ready.popleft()
                batcher = self._current = self._ready.popleft() if self._ready else None
                self._sleeping = batcher is None
            if batcher is None:
                self._sleep(-1)
                continue
            self._gather(batcher)
            with self._lock:
                calls = batcher.running = batcher.take()
                if batcher.waiting and batcher not in self._ready:
                    self._ready.append(batcher)
            batcher.run(calls)
            with self._lock:  # no abort can reach the next call
                batcher.running = []
                batcher.abort.set(False)
            for call in calls:
                call.done.release()

    def _gather(self, batcher: "_Batcher") -> None:
        """Wait (briefly) until the slots of the batcher's previous call are back, or its batch is full."""
        deadline = batcher.gather_deadline()
        while True:
            with self._lock:
                left = deadline - _monotonic()
                if left <= 0 or batcher.gathered():
                    return
                self._sleeping = True
            self._sleep(left)


_decode_thread: Optional[_DecodeThread] = None


class _Batcher:
    """The decode calls of one context: its waiting calls, and one llama_decode for as many as fit."""

    def __init__(self, ctx, n_vocab: int, n_embd: int, seqs: int) -> None:
        self._ctx = ctx
        self._n_vocab = n_vocab
        pooling = llama_cpp.llama_pooling_type(ctx)
        # What an embedding call gives: the last token's hidden state; or, where the model pools by the last token,
        # the pooled output of its sequence (a reranker's: the scores of its classification head). A pooling over
        # every token (mean, CLS) needs the whole prompt in the call that pools: none is given.
        self._pooled = pooling in (llama_cpp.LLAMA_POOLING_TYPE_LAST, llama_cpp.LLAMA_POOLING_TYPE_RANK)
        self._n_embd = (llama_cpp.llama_model_n_cls_out(llama_cpp.llama_get_model(ctx))
                        if pooling == llama_cpp.LLAMA_POOLING_TYPE_RANK else n_embd)
        self._embeds = self._pooled or pooling == llama_cpp.LLAMA_POOLING_TYPE_NONE
        self.waiting: list[_Call] = []  # guarded by the decode thread's lock, as is running
        self.running: list[_Call] = []  # the calls of the llama_decode under way
        self.abort = _AbortFlag(ctx)
        self._batch = llama_cpp.llama_batch_init(BATCH + seqs, 0, 1)
        self._last_round: set[int] = set()  # the sequences of the previous call, and when it ended
        self._last_end = 0.0
        self._embeddings = False
        self.calls = 0  # decode calls made, the sequences they carried, and the calls aborted
        self.sequences = 0
        self.aborted = 0

    def decode(self, call: _Call, cancelled: Optional[Callable[[], bool]] = None) -> None:
        """Evaluate a call's tokens, in one decode call with the other slots' waiting tokens."""
        _live_decode_thread().submit(self, call, cancelled)

    def gather_deadline(self) -> float:
        """GATHER_SECONDS after the last call ended: slots of that call not back by then have ended their streams."""
        return self._last_end + GATHER_SECONDS

    def alone(self, seq: int) -> bool:
        """Whether sequence ``seq`` is the only one decoding: no other is waiting or in the call under way, and
        the others of the last call, if any, did not come back by the gather deadline."""
        if any(call.seq != seq for call in self.waiting + self.running):
            return False
        return self._last_round <= {seq} or _monotonic() > self.gather_deadline()

    def gathered(self) -> bool:
        """Whether every sequence of the previous call is waiting again, or the waiting tokens fill a batch."""
        return (self._last_round <= {call.seq for call in self.waiting}
                or sum(len(call.tokens) for call in self.waiting) >= BATCH)

    def take(self) -> list[_Call]:
        """The calls the next llama_decode takes: the first waiting ones that fit in BATCH tokens (at least one);
        or an action, alone."""
        if self.waiting and self.waiting[0].action is not None:
            return [self.waiting.pop(0)]
        taken, size = [], 0
        while (self.waiting and self.waiting[0].action is None
               and (not taken or size + len(self.waiting[0].tokens) <= BATCH)):
            size += len(self.waiting[0].tokens)
            taken.append(self.waiting.pop(0))
        return taken

    def run(self, calls: list[_Call]) -> None:
        """One llama_decode for ``calls``: each gets its logits (and embedding), or an error."""
        try:
            if calls[0].action is not None:
                calls[0].result = calls[0].action()
            else:
                self._decode(calls)
        except Exception as exc:  # every waiting thread hears of it: none may sleep for ever
            for call in calls:
                call.error = f"llama_decode raised {exc!r}"

    def _decode(self, calls: list[_Call]) -> None:
        # With a cache per sequence, llama.cpp computes a run of consecutive sequence ids in one pass, and
        # any other sequence in passes of its own: the batch goes in sequence order.
        calls = sorted(calls, key=lambda call: call.seq)
        self._last_round = {call.seq for call in calls}
        embeddings = any(call.wants_embedding for call in calls)
        if embeddings != self._embeddings:  # embeddings cost a quarter of prefill speed: only when asked for
            llama_cpp.llama_set_embeddings(self._ctx, embeddings)
            self._embeddings = embeddings
        batch = self._batch
        n = 0
        last = []
        for call in calls:
            for i, token in enumerate(call.tokens):
                batch.token[n] = token
                batch.pos[n] = call.n_past + i
                batch.n_seq_id[n] = 1
                batch.seq_id[n][0] = call.seq
                batch.logits[n] = call.every or i == len(call.tokens) - 1
                n += 1
            last.append(n - 1)
        batch.n_tokens = n
        self.calls += 1
        self.sequences += len(calls)
        status = llama_cpp.llama_decode(self._ctx, batch)
        self._last_end = _monotonic()
        self.aborted += status == 2
        for call, index in zip(calls, last):
            if status != 0:
                call.error = f"llama_decode failed with status {status}"
                call.aborted = status == 2
                continue
            if call.wants_embedding:
                call.embedding = self._embedding(call.seq, index)
                continue
            if call.every:
                first = index - len(call.tokens) + 1
                call.logits = np.stack([self._logits(i) for i in range(first, index + 1)])
                call.logits.flags.writeable = False
                continue
            logits = self._logits(index)
            if call.pick is None:
                call.logits = logits.copy()
                call.logits.flags.writeable = False  # handed to the slot's caller as is
            else:
                logits.flags.writeable = False
                try:
                    call.picked = call.pick(logits)
                except Exception as exc:  # the slot's thread raises it
                    call.pick_error = exc

    def _logits(self, index: int) -> np.ndarray:
        """The logits after the batch's ``index``-th token, where llama.cpp keeps them (until its next call)."""
        return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self._ctx, index), shape=(self._n_vocab,))

    def _embedding(self, seq: int, index: int) -> Optional[np.ndarray]:
        if not self._embeds:
            return None
        found = (llama_cpp.llama_get_embeddings_seq(self._ctx, seq) if self._pooled
                 else llama_cpp.llama_get_embeddings_ith(self._ctx, index))
        return np.ctypeslib.as_array(found, shape=(self._n_embd,)).copy() if found else None


class LlamaCppSlot(Slot):
    """One sequence of the model's shared context."""

    def __init__(self, engine: "LlamaCppEngine", seq: int) -> None:
        super().__init__()
        self._engine = engine
        self._seq = seq
        self._kv_end = 0  # positions held in the KV cache for this sequence
        self._logits: Optional[np.ndarray] = None
        self._embedding: Optional[np.ndarray] = None
        self._cancelled: Optional[Callable[[], bool]] = None  # the prefill's, while one runs
        self.sliding_window = bool(engine._n_swa)
        self.draft_costs = DraftCosts()  # what its calls cost, by rows: how long its drafts should be

    @property
    def prefill_chunk(self) -> int:
        """A prompt alone goes in calls of BATCH tokens, which a cancel aborts mid-call; beside running
        streams, in calls of SHARED_CHUNK, as the streams wait for each call."""
        return BATCH if self._engine._batcher.alone(self._seq) else SHARED_CHUNK

    def evaluate(self, tokens: Sequence[int], cancelled: Callable[[], bool] = lambda: False,
                 chunk: Optional[int] = None) -> None:
        self._cancelled = cancelled
        try:
            super().evaluate(tokens, cancelled, chunk)
        finally:
            self._cancelled = None

    def _submit(self, call: _Call) -> _Call:
        """Run a decode call of this sequence, from ``call.n_past`` on; raise its error."""
        if call.n_past < self._kv_end:  # a shorter prefix is reused: drop the rest of the old sequence
            llama_cpp.llama_memory_seq_rm(self._engine._memory, self._seq, call.n_past, -1)
        self._kv_end = call.n_past
        self._engine._batcher.decode(call, self._cancelled)
        if call.error:
            llama_cpp.llama_memory_seq_rm(self._engine._memory, self._seq, call.n_past, -1)
            if call.aborted:
                raise Cancelled()
            raise EngineError(call.error)
        self._kv_end = call.n_past + len(call.tokens)
        return call

    def _eval(self, tokens: Sequence[int], n_past: int, pick: Optional[Pick] = None,
              embedding: bool = False) -> Optional[int]:
        call = self._submit(_Call(self._seq, tokens, n_past, embedding, pick))
        self._logits, self._embedding = call.logits, call.embedding
        if call.pick_error is not None:
            raise call.pick_error
        return call.picked

    def _eval_each(self, tokens: Sequence[int], n_past: int) -> np.ndarray:
        self._logits = None
        return self._submit(_Call(self._seq, tokens, n_past, every=True)).logits

    def rank(self, tokens: Sequence[int], cancelled: Callable[[], bool] = lambda: False) -> np.ndarray:
        """The prompt evaluated whole, from its first token, in calls of BATCH tokens (the last with embeddings on), as
        llama-server evaluates it: a pair scores the same whatever the slot held before, which a reused prefix would
        change in the last digits. The slot holds nothing after."""
        self._cancelled = cancelled
        self._embedding = None
        try:
            for start in range(0, len(tokens), BATCH):
                if cancelled():
                    raise Cancelled()
                self._eval(tokens[start:start + BATCH], start, embedding=start + BATCH >= len(tokens))
        finally:
            self._cancelled = None
            self.cached = []
        if self._embedding is None:
            raise EngineError("this model gives no scores")
        return self._embedding.copy()

    def decode_media(self, tokens: Sequence[int], start: int) -> int:
        """The image's chunk encoded by the projector and its embeddings decoded at ``start``, in one action of the
        decode thread (an image is not cut: a cancel waits for its end)."""
        chunk = self._engine._chunks.get(tokens[start])
        if chunk is None:
            raise EngineError("an image of this prompt is no longer held by its model")
        engine, seq, count = self._engine, self._seq, chunk.count
        if start < self._kv_end:
            llama_cpp.llama_memory_seq_rm(engine._memory, seq, start, -1)
        self._kv_end = start

        def evaluate() -> int:
            end = llama_cpp.llama_pos(0)
            return mtmd_cpp.mtmd_helper_eval_chunk_single(engine._mtmd, engine._ctx, chunk.pointer, start, seq, BATCH,
                                                          False, ctypes.byref(end))

        try:
            status = self._alone(evaluate)
        except EngineError:
            status = -1
        if status != 0:
            llama_cpp.llama_memory_seq_rm(engine._memory, seq, start, -1)
            del self.cached[start:]
            raise _failure(f"llama.cpp could not evaluate an image (status {status})")
        self._kv_end = start + count
        self.cached[start:] = tokens[start:start + count]
        self._logits = self._embedding = None
        return count

    def reusable(self, keep: int) -> int:
        window = self._engine._n_swa
        if not window or keep == 0 or keep >= len(self.cached):  # a full cache, or nothing to cut
            return keep
        first = llama_cpp.llama_memory_seq_pos_min(self._engine._memory, self._seq)
        return keep if first <= max(0, keep - window) else 0  # as llama-server decides

    def _alone(self, action: Callable[[], object]) -> object:
        """Run ``action`` in the decode thread, between two decode calls: the context is never used by two."""
        call = _Call(self._seq, (), 0, action=action)
        self._engine._batcher.decode(call)
        if call.error:
            raise EngineError(call.error)
        return call.result

    def save_state(self) -> bytes:
        ctx, memory, seq, held = self._engine._ctx, self._engine._memory, self._seq, len(self.cached)

        def save() -> bytes:
            if held < self._kv_end:  # a restored longer sequence, cut to the prefix kept: the rest is not saved
                llama_cpp.llama_memory_seq_rm(memory, seq, held, -1)
                self._kv_end = held
            size = llama_cpp.llama_state_seq_get_size(ctx, seq)
            state = bytearray(size)  # written in place: a state of a long prompt is tens of megabytes
            view = (ctypes.c_uint8 * size).from_buffer(state)
            written = llama_cpp.llama_state_seq_get_data(ctx, view, size, seq)
            del view
            del state[written:]
            return state

        return self._alone(save)

    def load_state(self, state: bytes, tokens: Sequence[int]) -> None:
        ctx, memory, seq = self._engine._ctx, self._engine._memory, self._seq

        def load() -> int:
            llama_cpp.llama_memory_seq_rm(memory, seq, -1, -1)
            kind = ctypes.c_uint8 * len(state)
            buffer = kind.from_buffer(state) if isinstance(state, bytearray) else kind.from_buffer_copy(state)
            return llama_cpp.llama_state_seq_set_data(ctx, buffer, len(state), seq)

        self._kv_end = 0
        self.cached = []
        if not self._alone(load):
            llama_cpp.llama_memory_seq_rm(memory, seq, -1, -1)
            raise _failure("llama.cpp could not load a saved state")
        self._kv_end = len(tokens)
        self.cached = list(tokens)
        self._logits = self._embedding = None

    def logits(self) -> np.ndarray:
        if self._logits is None:
            raise EngineError("the last decode's logits went to its pick, not kept")
        return self._logits

    def embedding(self) -> np.ndarray:
        """The last token evaluated once more, with embeddings on (they slow every other call down)."""
        if self._embedding is None:
            last = len(self.cached) - 1
            self._eval(self.cached[last:], last, embedding=True)
        if self._embedding is None:
            raise EngineError("this model gives no embeddings")
        return self._embedding.copy()


class _Chunk:
    """One image's (or sound's) chunk as the projector made it: what its run of placeholders stands for."""

    def __init__(self, pointer, count: int) -> None:
        self.pointer, self.count = pointer, count

    def __del__(self) -> None:
        if mtmd_cpp is not None and self.pointer:
            mtmd_cpp.mtmd_input_chunk_free(self.pointer)
            self.pointer = None


class LlamaCppOptions(EngineOptions):
    """What a model may set for this engine."""

    gpu_layers: int = pydantic.Field(0, ge=-1)  # layers put on a GPU (-1: all)
    mmproj: Optional[str] = None  # its multimodal projector's GGUF file: images (and sounds) in its prompts
    # llama.cpp's rpc-server processes (HOST:PORT) the model's layers are spread over, for a model bigger than one
    # host; then every layer goes to them unless gpu_layers says how many
    rpc_servers: list[str] = pydantic.Field(default_factory=list)

    @pydantic.field_validator("rpc_servers")
    @classmethod
    def _addresses(cls, servers: list[str]) -> list[str]:
        for server in servers:
            host, _, port = server.rpartition(":")
            if not host or not port.isdigit() or "/" in server:
                raise ValueError(f"{server!r} is not HOST:PORT")
        return servers


class LlamaCppEngine(Engine):
    """A GGUF file loaded by llama.cpp; its slots share one context, one sequence each."""

    speculates = True

    def __init__(self, name: str, path: Path, context_length: Optional[int] = None,
                 options: LlamaCppOptions = LlamaCppOptions()) -> None:
        if llama_cpp is None:
            raise EngineError("the llama.cpp engine needs llama-cpp-python: pip install 'kronk_wsgi[llamacpp]'")
        self.name = name
        model = read_gguf(path)
        self.tokenizer = GGUFTokenizer(model)
        self.chat_template = model.chat_template
        self.reranker = model.arch_value("pooling_type") == llama_cpp.LLAMA_POOLING_TYPE_RANK
        self.rerank_template = model.get("tokenizer.chat_template.rerank")
        self.context_length = int(context_length or model.context_length or DEFAULT_CONTEXT_LENGTH)
        _start_backend()
        params = llama_cpp.llama_model_default_params()
        params.n_gpu_layers = options.gpu_layers
        if options.rpc_servers:
            self._devices = _rpc_devices(options.rpc_servers)  # held as long as the model
            params.devices = ctypes.cast(self._devices, ctypes.c_void_p)
            params.n_gpu_layers = options.gpu_layers or -1
        _errors.pop(_get_ident(), None)
        self._model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
        if not self._model:
            raise _failure(f"llama.cpp could not load {path.name}")
        vocab = llama_cpp.llama_model_get_vocab(self._model)
        self._n_vocab = llama_cpp.llama_vocab_n_tokens(vocab)
        if self._n_vocab != self.tokenizer.vocab_size:
            raise EngineError(f"{path.name}: llama.cpp's vocabulary differs from the file's tokenizer")
        self._n_embd = llama_cpp.llama_model_n_embd(self._model)
        self._n_swa = llama_cpp.llama_model_n_swa(self._model)  # 0: no sliding-window attention
        self._file_identity = _file_identity(path)
        self._ctx = None
        self._mmproj = Path(options.mmproj).expanduser() if options.mmproj else None
        self._mtmd = None
        self._use_gpu = options.gpu_layers != 0
        # The chunks of the images prompts hold, by their first placeholder; each lives as long as a Media holds it.
        self._chunks: "weakref.WeakValueDictionary[int, _Chunk]" = weakref.WeakValueDictionary()
        self._media: collections.OrderedDict = collections.OrderedDict()  # the latest MEDIA_KEPT, by hash
        self._media_lock = _allocate_lock()
        if self._mmproj is not None:
            self._check_projector()

    def new_slots(self, count: int, threads: int) -> list[LlamaCppSlot]:
        """``count`` sequences of one context, whose decode calls (each for all its slots) run on ``threads`` threads."""
        if self._ctx is not None:
            raise EngineError("this engine's slots are made once")
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = self.context_length * count
        params.n_seq_max = count
        params.n_batch = params.n_ubatch = BATCH + count
        params.n_threads = params.n_threads_batch = threads
        params.embeddings = False
        # A sliding-window model's window layers keep the last window of tokens (plus a batch), as
        # llama-server sizes them, not the whole context (Gemma 3 at 32k: about 5x less KV memory).
        params.swa_full = False
        # A cache per sequence, of context_length cells (kronk_wsgi holds each sequence to that): in one cache
        # for all, each token's attention runs over every slot's cached tokens, masked.
        params.kv_unified = False
        self._ctx = llama_cpp.llama_init_from_model(self._model, params)
        if not self._ctx:
            raise _failure(f"llama.cpp could not make a context of {params.n_ctx} tokens")
        self._threadpool = _attach_threadpool(self._ctx, params.n_threads)
        self._memory = llama_cpp.llama_get_memory(self._ctx)
        self._batcher = _Batcher(self._ctx, self._n_vocab, self._n_embd, count)
        self._identity = (f"{self._file_identity} llama-cpp-python {llama_cpp.__version__} n_ctx {self.context_length} "
                          f"type_k {params.type_k} type_v {params.type_v} swa_full {params.swa_full}")
        if self._mmproj is not None:
            try:
                self._start_projector(threads)
            except EngineError:
                self.close()
                raise
            self._identity += f" mmproj {_file_identity(self._mmproj)}"  # an image's state is the projector's
        return [LlamaCppSlot(self, seq) for seq in range(count)]

    def _check_projector(self) -> None:
        """EngineError unless the projector's file is one llama.cpp's mtmd reads, of a kind served here."""
        if mtmd_cpp is None:
            raise EngineError("mmproj: this llama-cpp-python was built without its multimodal library (mtmd); "
                              "reinstall it with CMAKE_ARGS=-DLLAVA_BUILD=ON")
        if not self._mmproj.is_file():
            raise EngineError(f"mmproj: file not found: {self._mmproj}")

    def _start_projector(self, threads: int) -> None:
        params = mtmd_cpp.mtmd_context_params_default()
        params.use_gpu = self._use_gpu
        params.print_timings = False
        params.n_threads = threads
        params.warmup = False
        _errors.pop(_get_ident(), None)
        self._mtmd = mtmd_cpp.mtmd_init_from_file(str(self._mmproj).encode(), self._model, params)
        if not self._mtmd:
            raise _failure(f"llama.cpp could not load the projector {self._mmproj.name}")
        if mtmd_cpp.mtmd_decode_use_mrope(self._mtmd):
            raise EngineError(f"mmproj {self._mmproj.name}: its model places image tokens in 2D (M-RoPE, the Qwen-VL "
                              "families), which this server does not serve yet")
        supports = {"image": mtmd_cpp.mtmd_support_vision(self._mtmd), "audio": mtmd_cpp.mtmd_support_audio(self._mtmd)}
        self.modalities = frozenset(kind for kind, supported in supports.items() if supported)

    def media(self, data: bytes) -> Media:
        if self._mtmd is None:
            return super().media(data)
        key = hashlib.sha256(data).digest()
        with self._media_lock:
            found = self._media.get(key)
            if found is not None:
                self._media.move_to_end(key)
                return found
        if _sounds_like_audio(data) and "audio" not in self.modalities:
            raise MediaError("this model does not take sounds: its projector reads images only")
        buffer = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        _errors.pop(_get_ident(), None)
        bitmap = mtmd_cpp.mtmd_helper_bitmap_init_from_buf(self._mtmd, buffer, len(data), False)
        if not bitmap:
            raise MediaError("it does not decode as an image or a sound this server reads (PNG, JPEG, GIF, BMP; "
                             "WAV, MP3, FLAC)")
        kind = "audio" if mtmd_cpp.mtmd_bitmap_is_audio(bitmap) else "image"
        chunks = mtmd_cpp.mtmd_input_chunks_init()
        try:
            if kind not in self.modalities:
                raise MediaError(f"this model does not take {'sounds' if kind == 'audio' else 'images'}: its "
                                 f"projector reads {' and '.join(sorted(self.modalities))} only")
            part = mtmd_cpp.mtmd_input_part(None, bitmap)
            parts = (ctypes.POINTER(mtmd_cpp.mtmd_input_part) * 1)(ctypes.pointer(part))
            status = mtmd_cpp.mtmd_tokenize_from_parts(self._mtmd, chunks, parts, 1, False)
            if status != 0:
                raise MediaError(f"llama.cpp could not read it (status {status})")
            media = self._held(key, kind, chunks)
        finally:
            mtmd_cpp.mtmd_input_chunks_free(chunks)
            mtmd_cpp.mtmd_bitmap_free(bitmap)
        with self._media_lock:
            self._media[key] = media
            while len(self._media) > MEDIA_KEPT:
                self._media.popitem(last=False)
        return media

    def _held(self, key: bytes, kind: str, chunks) -> Media:
        """The Media of a tokenized image: its text chunks' tokens as they are, each media chunk a copy of it under
        its run of placeholders."""
        tokens: list[int] = []
        held = []
        for index in range(mtmd_cpp.mtmd_input_chunks_size(chunks)):
            chunk = mtmd_cpp.mtmd_input_chunks_get(chunks, index)
            if mtmd_cpp.mtmd_input_chunk_get_type(chunk) == mtmd_cpp.MTMD_INPUT_CHUNK_TYPE_TEXT:
                count = ctypes.c_size_t(0)
                text = mtmd_cpp.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(count))
                tokens.extend(text[:count.value])
                continue
            count = mtmd_cpp.mtmd_input_chunk_get_n_tokens(chunk)
            ids = media_ids(key + index.to_bytes(2, "little"), count)
            copy = _Chunk(mtmd_cpp.mtmd_input_chunk_copy(chunk), count)
            self._chunks[ids[0]] = copy
            held.append(copy)
            tokens.extend(ids)
        return Media(tuple(tokens), kind, tuple(held))

    def state_identity(self) -> Optional[str]:
        return getattr(self, "_identity", None)

    def decode_counts(self) -> tuple[int, int]:
        batcher = getattr(self, "_batcher", None)
        return (batcher.calls, batcher.sequences) if batcher is not None else (0, 0)

    def close(self) -> None:
        """Free the batch, context, threads and model, once; called on unload, and when the engine is collected."""
        if llama_cpp is None:
            return
        if getattr(self, "_batcher", None) is not None:
            llama_cpp.llama_batch_free(self._batcher._batch)
            self._batcher = None
        if getattr(self, "_mtmd", None):
            mtmd_cpp.mtmd_free(self._mtmd)
            self._mtmd = None
        if getattr(self, "_ctx", None):
            llama_cpp.llama_free(self._ctx)
            self._ctx = None
        if getattr(self, "_threadpool", None):
            _free_threadpool(self._threadpool)
            self._threadpool = None
        if getattr(self, "_model", None):
            llama_cpp.llama_model_free(self._model)
            self._model = None

    __del__ = close


def _sounds_like_audio(data: bytes) -> bool:
    """Whether a file's first bytes are those of a sound mtmd reads (WAV, MP3, FLAC)."""
    return (data[:4] == b"RIFF" and data[8:12] == b"WAVE") or data[:3] == b"ID3" or data[:4] == b"fLaC" \
        or data[:2] in (b"\xff\xfb", b"\xff\xf3", b"\xff\xf2")


def _file_identity(path: Path) -> str:
    stat = path.stat()
    return f"{path.resolve()} {stat.st_size} {stat.st_mtime_ns}"


def fit(path: Path) -> Fit:
    """Whether this engine runs a file: any GGUF file (of an architecture llama.cpp knows)."""
    return Fit() if is_gguf(path) else Fit("a legacy GGML file, which llama.cpp no longer reads")


KIND = EngineKind("llama.cpp", LlamaCppEngine, fit, options=LlamaCppOptions, batched=True, available=available,
                  missing="pip install 'kronk_wsgi[llamacpp]'")
