"""Loaded models, their slots and worker threads, admission to them, and unloading them to make room.

A model in use is never unloaded: one that requests have claimed (from the
moment the pool hands it out until the request is admitted or gives up) or
that holds admission leases (running or waiting generations). Unused models
go when they have been idle for their keep-alive (a client's, such as
Ollama's ``keep_alive``; else ``idle_unload_seconds``, which keeps the default
model), and, least recently used first, when another model needs room under
``max_loaded_models`` or ``max_memory_mb``.
"""

import contextlib
import dataclasses
import json
import os
import re
import time
from pathlib import Path
from typing import Callable, Iterator, Optional

import gevent
import gevent.event
import structlog
from gevent.threadpool import ThreadPool

from .. import hub
from ..catalog import Progress, check_engine_options, load_engine, local_file, local_projector, model_file
from ..config import ConfigError, ModelSampling, ModelSpec, Settings
from ..describe import footprint
from ..engine.base import DraftSlot, Engine, EngineError, Slot
from ..engine.chat_template import ChatTemplate
from ..engine.gguf_file import BadModelFile, is_gguf, read_gguf
from ..engine.prompt_cache import PromptCache
from ..engine.speculation import Speculation, shared_vocabulary
from ..metrics import Metrics
from ..model_registry import ModelRegistry
from . import offload
from .drain import Drain
from .formats import reply_end
from .runners import RunnerFiles, runner_dir, runner_engine
from .scheduler import CLIENT_POLL_SECONDS, ClientGone, Scheduler

log = structlog.get_logger("kronk_wsgi.pool")

# The directories of a path, in an error a client sees: /data/models/x.gguf reads x.gguf.
WITHOUT_DIRECTORIES = re.compile(r"(?:/[\w.@+-]+)+/")

# How long a prompt-cache disk write waits for the model's slots to be idle; and, with one worker (no other
# worker waits for the entry: see LoadedModel.shared_cache), how long it leaves a next turn to arrive first.
DISK_WRITE_DELAY = 2.0
NEXT_TURN_GRACE = 1.0

# How often idle models are looked at for unloading.
SWEEP_SECONDS = 1.0
WORKERS_POLL_SECONDS = 1.0  # how often a model on gRPC workers looks whether another process changed them



class UnknownModel(LookupError):
    """The model id is not configured."""


class ModelUnavailable(RuntimeError):
    """The model is configured but could not be loaded."""


class NoRoom(RuntimeError):
    """The model cannot be loaded now: the models that would have to go are in use."""

    retry_after = 5


class _InUse(Exception):
    """Room cannot be made yet: the models that must go are in use."""


class NeverFits(RuntimeError):
    """The model alone is larger than the memory budget."""


class Lease:
    """One admission place, released exactly once; while it is held, its model is in use."""

    def __init__(self, model: "LoadedModel") -> None:
        self._model = model
        model.claim()
        self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._model.scheduler.release_place()
            self._model.unclaim()


def _stamp(path: Optional[Path]) -> Optional[tuple[int, int]]:
    """A file's size and modification time; None if it is gone."""
    try:
        stat = path.stat() if path is not None else None
    except OSError:
        return None
    return None if stat is None else (stat.st_size, stat.st_mtime_ns)


@dataclasses.dataclass(frozen=True)
class ModelParts:
    """What loading a model made, in a worker thread: its engine, its chat template, its slots, its file, the
    draft model its slots draft with, if its setting names one, and its sampling defaults."""

    engine: Engine
    template: ChatTemplate
    slots: list[Slot]
    path: Optional[Path] = None
    draft_engine: Optional[Engine] = None
    sampling: ModelSampling = dataclasses.field(default_factory=ModelSampling)


class LoadedModel:
    """A model with PARALLEL slots, a worker thread per slot, and admission places.

    Every engine call runs in one of this model's OS threads, never in a
    greenlet: slot work in ``slot_threads`` (one per slot); tokenizing,
    templates and grammars in ``prep`` (one thread, so a tokenizer is never shared). Generation
    ends at ``end_ids``: the tokenizer's end tokens and the control token the
    chat template closes a turn with.
    """

    def __init__(self, model_id: str, spec: ModelSpec, parts: ModelParts, memory: int, settings: Settings,
                 metrics: Metrics, unused: Callable[[], None]) -> None:
        self.id = model_id
        self.path = parts.path  # its file, whose size and modification time must stay what they were at the load
        self._stamp = _stamp(parts.path)
        self.engine = engine = parts.engine
        self.draft_engine = parts.draft_engine
        self.template = parts.template
        self.memory = memory  # bytes, estimated: the file and the slots' KV caches
        self.queue_depth = settings.queue_depth
        places = len(parts.slots) * settings.queue_depth
        self.users = 0  # requests that hold the model: claimed, or holding an admission lease
        self._unused = unused  # called when the last of them lets go
        self.last_used = time.monotonic()
        self.keep_alive: Optional[float] = None  # seconds it stays loaded unused, as a client asked; < 0: for good
        # The turn's closing marker ends a reply as the vocabulary's end tokens do: as a control token, or as text
        # where the vocabulary has it only as text; so do the model's configured stops.
        closing = reply_end(parts.template)
        token = engine.tokenizer.control.get(closing or "")
        self.end_ids = engine.tokenizer.end_ids | ({token} if token is not None else set())
        self.end_texts: tuple[str, ...] = ((closing,) if closing and token is None else ()) + tuple(spec.stop)
        self.max_tokens = spec.max_tokens  # a reply's length where its request sets none: the model's setting
        self.sampling = parts.sampling  # how its tokens are drawn where a request is silent
        # How replies are drafted, unless a request says otherwise: the model's setting
        speculative = spec.speculative
        self.speculation = (Speculation(speculative.n_max, speculative.n_min, speculative.p_min)
                            if speculative is not None else None)
        self.created = int(time.time())
        slots = parts.slots
        self.prompt_cache: Optional[PromptCache] = slots[0].state_cache if slots else None
        self.slot_threads = ThreadPool(len(slots))
        self.prep = ThreadPool(1)
        self._disk_writer = ThreadPool(1)  # prompt-cache disk writes, after the slot that saved is given back
        self.scheduler = Scheduler(model_id, slots, places, settings.max_waiting, metrics)
        engine.watch_slots(self._add_slots)
        # A model on gRPC workers: the workers added and removed at run time, in a file every worker process follows
        remote = engine.kind.name == "grpc"
        self._workers_file = RunnerFiles(runner_dir(settings), model_id).path("workers") if remote else None
        self._workers_seen: Optional[int] = None  # the file's modification time last followed or written here
        self._workers_watch = gevent.spawn(self._follow_workers) if remote else None
        # Whether other workers read the prompt cache's disk tier. Then an answer's state is saved as it ends, so
        # that its next turn finds it from any worker. Otherwise it stays in its slot until a prompt overwrites it
        # (Slot.reuse saves it first), the model goes or the worker stops: a next turn sent at once, which takes
        # the same slot, does not wait for a save it does not need; and a disk write leaves it time to arrive.
        self.shared_cache = settings.workers > 1
        self.disk_write_grace = 0.0 if self.shared_cache else NEXT_TURN_GRACE  # seconds left to a next turn
        self._write_due: Optional[gevent.Greenlet] = None  # a disk write waiting for its time

    def add_worker(self, url: str, shared: bool = True) -> list[Slot]:
        """A gRPC worker added to the model at run time: its slots and their places join the model's (EngineError
        if the engine refuses it); ``shared``: the other worker processes follow."""
        slots = self.engine.add_worker(url)
        self._add_slots(slots)
        if shared:
            self._share_workers()
        return slots

    def _add_slots(self, slots: list[Slot]) -> None:
        """Slots the engine made after the load join the model's, with their threads and admission places."""
        self.slot_threads.maxsize += len(slots)
        self.scheduler.add_slots(slots, len(slots) * self.queue_depth)

    def remove_worker(self, url: str, shared: bool = True) -> list[Slot]:
        """A gRPC worker taken out at run time: its slots retire (a busy one once its request ends); ``shared``: the
        other worker processes follow."""
        slots = self.engine.remove_worker(url, self.scheduler.slots)
        self.scheduler.retire(slots, len(slots) * self.queue_depth)
        if shared:
            self._share_workers()
        return slots

    def _share_workers(self) -> None:
        """Write the model's workers for the other worker processes (whole, then renamed into place)."""
        urls = [row["url"] for row in self.engine.worker_rows()]
        written = self._workers_file.with_suffix(f".{os.getpid()}")
        written.write_text(json.dumps(urls))
        os.replace(written, self._workers_file)
        self._workers_seen = self._workers_file.stat().st_mtime_ns

    def _follow_workers(self) -> None:
        """Runs on the event loop while the model is loaded: the workers another process added or removed, here
        too (a worker this process cannot reach is logged and left out)."""
        while True:
            try:
                seen = self._workers_file.stat().st_mtime_ns
                wanted = json.loads(self._workers_file.read_text()) if seen != self._workers_seen else None
            except (OSError, ValueError):
                wanted = None
            if wanted is not None:
                self._workers_seen = seen
                mine = [row["url"] for row in self.engine.worker_rows()]
                for url in [u for u in wanted if u not in mine]:
                    try:
                        self.add_worker(url, shared=False)
                    except EngineError as exc:
                        log.warning("grpc worker not added here", model=self.id, worker=url, reason=str(exc)[:200])
                for url in [u for u in mine if u not in wanted]:
                    if len(self.engine.worker_rows()) > 1:  # one stays, whatever could not be added here
                        self.remove_worker(url, shared=False)
            gevent.sleep(WORKERS_POLL_SECONDS)

    def file_changed(self) -> bool:
        """Whether the model's file was replaced or rewritten since the load: its memory map may read garbage or
        kill the process (SIGBUS) once the file shrinks."""
        return self.path is not None and _stamp(self.path) != self._stamp

    def give_back(self, slot: Slot) -> None:
        """Free the slot for the next request in line; then write to disk the states its work saved in RAM."""
        self.scheduler.give_back(slot)
        if self.prompt_cache is not None and self._write_due is None:
            self._write_due = gevent.spawn(self._write_when_idle)

    def _write_when_idle(self) -> None:
        """Write the saved states to disk once no slot is busy (after ``disk_write_grace``, in which a next turn
        sent at once arrives and takes its slot), or after DISK_WRITE_DELAY seconds: hashing and writing tens of
        megabytes beside a next turn slowed its first token (0.22-0.29 s, 0.10-0.14 with the write later)."""
        gevent.sleep(self.disk_write_grace)
        self.scheduler.idle.wait(DISK_WRITE_DELAY)
        self._write_due = None
        self._disk_writer.spawn(self.prompt_cache.write_deferred)

    def write_now(self) -> None:
        """Save what the idle slots hold, and write every saved state that waits for its disk write, now (the model
        goes, or the worker stops)."""
        if self.prompt_cache is None:
            return
        for slot in self.scheduler.slots:
            if self.scheduler.states[slot] == "idle":
                offload.call(self.slot_threads, slot.keep_state, True)
        if self._write_due is not None:
            self._write_due.kill()
            self._write_due = None
        offload.call(self._disk_writer, self.prompt_cache.write_deferred)

    def claim(self) -> None:
        self.users += 1

    def unclaim(self) -> None:
        self.users -= 1
        self.last_used = time.monotonic()
        if not self.users:
            self._unused()

    @property
    def in_use(self) -> bool:
        return self.users > 0

    def report_cache(self, metrics: Metrics) -> None:
        """Add what the prompt cache did since the last report to the metrics (from the event loop: prometheus'
        locks are gevent's there)."""
        if self.prompt_cache is None:
            return
        counts = self.prompt_cache.take_counts()
        for problem in counts.problems:
            log.warning("prompt cache file skipped", model=self.id, problem=problem)
        for event in ("hits", "misses", "saved", "evicted_ram", "evicted_disk", "corrupt"):
            if getattr(counts, event):
                metrics.prompt_cache_events.labels(self.id, event).inc(getattr(counts, event))
        if counts.restored_tokens:
            metrics.prompt_cache_restored_tokens.labels(self.id).inc(counts.restored_tokens)
        metrics.prompt_cache_ram_bytes.labels(self.id).set(counts.ram_bytes)
        metrics.prompt_cache_disk_bytes.labels(self.id).set(counts.disk_bytes)

    def close(self) -> None:
        """Write what waits to be written; stop the model's threads and free its engine."""
        if self._workers_watch is not None:
            self._workers_watch.kill(block=False)
        self.write_now()
        self.scheduler.close()
        self.slot_threads.kill()
        self.prep.kill()
        self._disk_writer.kill()
        self.engine.close()
        if self.draft_engine is not None:
            self.draft_engine.close()

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = True,
                 inert: Optional[str] = None) -> list[int]:
        """Token ids of ``text``: a whole prompt (BOS and EOS as the model asks) unless not ``add_special``."""
        tokenizer = self.engine.tokenizer
        encode = tokenizer.prompt if add_special else tokenizer.encode
        return offload.call(self.prep, encode, text, parse_special, inert)

    def detokenize(self, tokens: list[int]) -> bytes:
        return offload.call(self.prep, self.engine.tokenizer.decode, tokens)

    def admit(self, timeout: float, client_gone: Callable[[], bool], drain: Drain) -> Lease:
        """Wait in line up to ``timeout`` seconds for a place (see Scheduler.admit)."""
        self.scheduler.admit(timeout, client_gone, drain)
        return Lease(self)


class ModelPool:
    """The configured models of one app; each loads once, on first use, and may be unloaded when unused."""

    def __init__(self, settings: Settings, metrics: Metrics) -> None:
        """ConfigError if a model's engine does not take its engine_options."""
        self.models = ModelRegistry(settings.models)
        for model_id, spec in self.models.configured.items():
            try:
                check_engine_options(spec)
            except (ValueError, EngineError) as exc:
                raise ConfigError(f"models.{model_id}: {exc}") from None
        self.settings = settings
        self.metrics = metrics
        self.drain = Drain()
        self._loaded: dict[str, LoadedModel] = {}
        self._loading: dict[str, gevent.event.AsyncResult] = {}
        self.loads: dict[str, hub.Download] = {}  # the loads under way, with their downloads' progress
        self._waiting: dict[str, int] = {}  # requests waiting for a model's load, beside the one loading it
        self._loading_memory: dict[str, int] = {}  # what each model being loaded will take, once room is made
        self.load_errors: dict[str, str] = {}
        self.loaded_once: set[str] = set()
        self._sweeper: Optional[gevent.Greenlet] = None
        self._model_unused = gevent.event.Event()  # set when a loaded model's last request ends, then replaced

    def loaded_model(self, model_id: str) -> Optional[LoadedModel]:
        """The model if it is loaded (not claimed: for looking at it only); None if not."""
        return self._loaded.get(model_id)

    def loaded(self) -> list[LoadedModel]:
        return list(self._loaded.values())

    def write_now(self) -> None:
        """Write every loaded model's saved states that wait for a disk write (the worker stops)."""
        for model in self.loaded():
            model.write_now()

    @contextlib.contextmanager
    def use(self, model_id: str) -> Iterator[LoadedModel]:
        """The loaded model, kept loaded until the block ends."""
        model = self.claim(model_id)
        try:
            yield model
        finally:
            model.unclaim()

    def claim(self, model_id: str, wait: float = 0.0, client_gone: Callable[[], bool] = lambda: False) -> LoadedModel:
        """The loaded model, claimed for the caller (``unclaim()`` it, or hand the claim to a lease).

        Concurrent first requests share one load. A model that needs others
        unloaded that are in use waits up to ``wait`` seconds for them to end
        their requests (NoRoom after that, ClientGone if the client leaves).
        NeverFits if it is larger than the memory budget, ModelUnavailable if
        it fails to load.
        """
        spec = self.models.get(model_id)
        if spec is None:
            raise UnknownModel(model_id)
        model = self._loaded.get(model_id)
        if model is not None and model.file_changed():
            if model.in_use:
                raise ModelUnavailable(f"the file of model {model_id!r} changed on disk; it is loaded again once "
                                       "the requests using it end (replace model files, never rewrite them in place)")
            log.warning("model file changed on disk", model=model_id, path=str(model.path))
            self.unload(model_id, "file_changed")
            model = None
        if model is not None:
            model.claim()
            return model
        pending = self._loading.get(model_id)
        if pending is not None:
            return self._wait_for_load(model_id, pending, client_gone)
        pending = self._loading[model_id] = gevent.event.AsyncResult()
        self._waiting[model_id] = 0
        started = time.monotonic()
        # A load others wait for goes on when the client that started it leaves; it stops when all have gone.
        everyone_gone = lambda: client_gone() and not self._waiting[model_id]  # noqa: E731
        try:
            memory = offload.call(gevent.get_hub().threadpool, self._footprint, spec)
            self._wait_for_room(model_id, memory, started + wait, everyone_gone)
            self._loading_memory[model_id] = memory
            parts = self._run_load(model_id, spec, everyone_gone)
        except (NoRoom, NeverFits, ClientGone) as exc:
            pending.set_exception(exc)
            raise
        except Exception as exc:  # EngineError, a bad template, or anything else (an OSError writing a copy)
            reason = str(exc) if isinstance(exc, (EngineError, ValueError)) else f"{type(exc).__name__}: {exc}"
            self.load_errors[model_id] = reason
            log.error("model load failed", model=model_id, error=reason)
            self.metrics.model_events.labels(model_id, "load_failed").inc()
            # Inference clients hear why, without the server's directories (the log and the admin API have them).
            failure = ModelUnavailable(f"model {model_id!r} could not be loaded: {WITHOUT_DIRECTORIES.sub('', reason)}")
            pending.set_exception(failure)
            raise failure from None
        finally:
            if not pending.ready():  # every waiter hears how the load ended, whatever ended it
                pending.set_exception(ModelUnavailable(f"model {model_id!r} could not be loaded"))
            del self._loading[model_id]
            self._loading_memory.pop(model_id, None)
            waiting = self._waiting.pop(model_id)
        # gevent objects belong to the hub's thread: build the model here, not in _load.
        model = LoadedModel(model_id, spec, parts, memory, self.settings, self.metrics, self._unused)
        for _ in range(1 + waiting):
            model.claim()
        self.load_errors.pop(model_id, None)
        self._loaded[model_id] = model
        self.loaded_once.add(model_id)
        self.metrics.model_events.labels(model_id, "loaded").inc()
        pending.set(model)
        log.info(
            "model loaded", model=model_id, seconds=round(time.monotonic() - started, 3),
            context_length=model.engine.context_length, slots=model.scheduler.slot_count,
            threads=self.settings.threads_per_call(model.engine.kind.batched), memory_mb=round(memory / 1e6),
        )
        if self.settings.idle_unload_seconds is not None:
            self._start_sweeper()
        return model

    def _wait_for_load(self, model_id: str, pending: gevent.event.AsyncResult,
                       client_gone: Callable[[], bool]) -> LoadedModel:
        """Wait for the load another request started; the model, claimed for this caller by the loader.
        ClientGone if the client leaves first."""
        self._waiting[model_id] += 1
        while not pending.ready():
            pending.wait(CLIENT_POLL_SECONDS)
            if not pending.ready() and client_gone():
                self._waiting[model_id] -= 1
                raise ClientGone()
        return pending.get()

    def _run_load(self, model_id: str, spec: ModelSpec, everyone_gone: Callable[[], bool]) -> ModelParts:
        """Load in a worker thread; stop its download after ``load_timeout``, or once every request waiting for
        it has gone."""
        loading = self.loads[model_id] = hub.Download()
        timeout = self.settings.load_timeout
        deadline = time.monotonic() + timeout
        try:
            job = offload.Running(gevent.get_hub().threadpool, self._load, model_id, spec, loading.progress)
            while not job.ready():
                job.wait(CLIENT_POLL_SECONDS)
                if job.ready() or loading.stop is not None:
                    continue
                if time.monotonic() >= deadline:
                    loading.stop = f"the load took longer than load_timeout ({timeout:g} s)"
                elif everyone_gone():
                    loading.stop = "every request waiting for it has gone"
            return job.get()
        finally:
            del self.loads[model_id]

    def set_keep_alive(self, model_id: str, seconds: float) -> None:
        """Keep a loaded model for ``seconds`` once unused (negative: until the worker stops; 0: unload it now if
        it is unused, else as soon as its requests end)."""
        model = self._loaded.get(model_id)
        if model is None:
            return
        model.keep_alive = seconds
        if seconds == 0:
            self.unload(model_id, "keep_alive")
        self._start_sweeper()

    def expires(self, model: LoadedModel) -> Optional[float]:
        """When (time.time()) an unused model will be unloaded for idling; None if never."""
        ttl = self._ttl(model)
        return None if ttl is None else time.time() + ttl - (time.monotonic() - model.last_used)

    def _ttl(self, model: LoadedModel) -> Optional[float]:
        if model.keep_alive is not None:
            return None if model.keep_alive < 0 else model.keep_alive
        if model.id == self.settings.default_model:
            return None
        return self.settings.idle_unload_seconds

    def unload(self, model_id: str, reason: str) -> bool:
        """Unload a model that is not in use; whether it was unloaded."""
        model = self._loaded.get(model_id)
        if model is None or model.in_use:
            return False
        del self._loaded[model_id]
        model.close()
        self.metrics.model_events.labels(model_id, f"unloaded_{reason}").inc()
        log.info("model unloaded", model=model_id, reason=reason, idle_seconds=round(time.monotonic() - model.last_used, 1))
        return True

    def _footprint(self, spec: ModelSpec) -> int:
        """Runs in a worker thread: the memory a model will take, estimated from its file (0 if not on disk yet)."""
        path = local_file(spec)
        if path is None or not path.is_file():
            return 0
        return footprint(path, spec.context_length, self.settings.parallel, spec.draft_model, local_projector(spec))

    def _wait_for_room(self, model_id: str, memory: int, deadline: float, client_gone: Callable[[], bool]) -> None:
        """Make room for the model, waiting until ``deadline`` for the models that must go to end their requests
        (woken as each of them ends its last)."""
        while True:
            freed = self._model_unused
            try:
                return self._make_room(model_id, memory, refused=time.monotonic() >= deadline)
            except _InUse:
                pass
            freed.wait(min(CLIENT_POLL_SECONDS, max(deadline - time.monotonic(), 0)))
            if client_gone():
                raise ClientGone()

    def _unused(self) -> None:
        """A loaded model's last request ended: wake the loads waiting for room."""
        freed, self._model_unused = self._model_unused, gevent.event.Event()
        freed.set()

    def _make_room(self, model_id: str, memory: int, refused: bool = True) -> None:
        """Unload unused models, least recently used first, until the model fits the budget; if the models that
        must go are in use, NoRoom, or _InUse unless ``refused``."""
        budget = self.settings.max_memory_mb
        if budget is not None and memory > budget * 1e6:
            self.metrics.model_events.labels(model_id, "refused_never_fits").inc()
            log.warning("model refused", model=model_id, reason="never_fits", memory_mb=round(memory / 1e6))
            raise NeverFits(f"model {model_id!r} needs about {memory / 1e6:.0f} MB (its file and KV cache), "
                            f"more than max_memory_mb ({budget})")

        def over() -> bool:
            count = len(self._loaded) + len(self._loading_memory) + 1  # with the loads that made room already
            used = sum(m.memory for m in self._loaded.values()) + sum(self._loading_memory.values()) + memory
            return ((self.settings.max_loaded_models is not None and count > self.settings.max_loaded_models)
                    or (budget is not None and used > budget * 1e6))

        while over():
            idle = [m for m in self._loaded.values() if not m.in_use]
            if not idle:
                if not refused:
                    raise _InUse()
                self.metrics.model_events.labels(model_id, "refused_no_room").inc()
                busy = ", ".join(sorted(self._loaded))
                log.warning("model refused", model=model_id, reason="no_room", in_use=busy)
                raise NoRoom(f"model {model_id!r} cannot be loaded now: the loaded models ({busy}) are in use")
            self.unload(min(idle, key=lambda m: m.last_used).id, "room")

    def _start_sweeper(self) -> None:
        if self._sweeper is None:
            self._sweeper = gevent.spawn(self._sweep)

    def _sweep(self) -> None:
        """Unload models idle for longer than their keep-alive."""
        while True:
            gevent.sleep(SWEEP_SECONDS)
            now = time.monotonic()
            for model in self.loaded():
                ttl = self._ttl(model)
                if ttl is not None and not model.in_use and now - model.last_used >= ttl:
                    self.unload(model.id, "keep_alive" if model.keep_alive is not None else "idle")

    def _load(self, model_id: str, spec: ModelSpec, progress: Progress) -> ModelParts:
        """Runs in a worker thread: the model's parts (``progress`` hears of its download)."""
        inline = spec.runner == "inline"  # else its runner speculates, with its draft model, and keeps its cache
        engine = load_engine(model_id, spec, progress) if inline else \
            runner_engine(model_id, spec, model_file(spec, progress), self.settings)
        if inline and spec.speculative is not None and not engine.speculates:
            engine.close()
            raise EngineError(f"speculative decoding needs an engine that checks drafts in one call (llama.cpp); "
                              f"{engine.kind.name} does not")
        tokenizer = engine.tokenizer
        template = ChatTemplate.for_model(
            spec.chat_template, engine.chat_template, tokenizer.token_text(tokenizer.bos_id),
            tokenizer.token_text(tokenizer.eos_id), tokenizer.control,
        )
        batched = engine.kind.batched
        if inline:  # else the runner's one process makes the decode calls
            self.settings.check_cores(batched)
        slots = engine.new_slots(self.settings.parallel, self.settings.threads_per_call(batched))
        draft_engine = self._load_draft(model_id, spec.draft_model, engine, slots) if inline and spec.draft_model \
            else None
        identity = engine.state_identity()
        ram, disk = self.settings.prompt_cache_ram_bytes(), self.settings.prompt_cache_disk_mb * 1_000_000
        if identity is not None and (ram or disk):
            cache = PromptCache(identity, ram, self.settings.prompt_cache_path(), disk)
            for slot in slots:
                slot.state_cache = cache
        path = local_file(spec)
        return ModelParts(engine, template, slots, path, draft_engine, model_sampling(model_id, spec, path))

    def _load_draft(self, model_id: str, path: Path, engine: Engine, slots: list[Slot]) -> Engine:
        """The draft model at ``path``, loaded beside the model: a slot of its own for each of its slots, of the same
        context length. EngineError (the model closed) if it does not load or its vocabulary differs."""
        draft_spec = ModelSpec(path=str(path), engine="llama.cpp", context_length=engine.context_length)
        try:
            draft = load_engine(f"{model_id} draft", draft_spec)
        except EngineError as exc:
            engine.close()
            raise EngineError(f"its draft model: {exc}") from None
        try:
            vocabulary = shared_vocabulary(engine.tokenizer, draft.tokenizer)
            draft_slots = draft.new_slots(len(slots), self.settings.threads_per_call(True))
        except (ValueError, EngineError) as exc:
            draft.close()
            engine.close()
            raise EngineError(f"its draft model {path.name} cannot draft for it: {exc}") from None
        for slot, draft_slot in zip(slots, draft_slots):
            slot.draft = DraftSlot(draft_slot, vocabulary)
        return draft


def model_sampling(model_id: str, spec: ModelSpec, path: Optional[Path]) -> ModelSampling:
    """A model's sampling defaults: its setting over its GGUF file's own; the file's that do not apply are logged."""
    try:
        written = read_gguf(path).sampling if path is not None and path.is_file() and is_gguf(path) else {}
    except (OSError, BadModelFile):
        written = {}
    sampling, left = spec.sampling.over_file(written)
    if left:
        log.info("model file sampling not applied", model=model_id, keys=left)
    return sampling
