"""Loaded models, their slots and worker threads, and admission to them."""

import time
from typing import Callable, Optional

import gevent
import gevent.event
import gevent.lock
import gevent.queue
import structlog
from gevent.threadpool import ThreadPool

from ..catalog import load_engine
from ..config import ModelSpec, Settings
from ..engine.base import Engine, EngineError, Slot
from ..engine.chat_template import ChatTemplate
from ..metrics import Metrics
from .drain import Drain, ShuttingDown

log = structlog.get_logger("kronk_wsgi.pool")

# How often a waiting request looks at its client's socket.
CLIENT_POLL_SECONDS = 0.5


class UnknownModel(LookupError):
    """The model id is not configured."""


class ModelUnavailable(RuntimeError):
    """The model is configured but could not be loaded."""


class Overloaded(RuntimeError):
    """No admission place came free within the admission timeout."""

    def __init__(self, model_id: str, waited: float) -> None:
        super().__init__(f"model {model_id!r} is busy: no place came free in {waited:.0f} s; retry later")
        self.retry_after = max(1, int(waited))


class ClientGone(Exception):
    """The client closed its connection."""


class Lease:
    """One admission place, released exactly once."""

    def __init__(self, places: gevent.lock.BoundedSemaphore) -> None:
        self._places = places
        self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._places.release()


class LoadedModel:
    """A model with PARALLEL slots, a worker thread per slot, and admission places.

    Every engine call runs in one of this model's OS threads, never in a
    greenlet: slot work in ``threads`` (one per slot), tokenizing in
    ``tokenizer`` (one thread, so a tokenizer is never shared). Generation
    ends at ``end_ids``: the tokenizer's end tokens and the control token the
    chat template closes a turn with.
    """

    def __init__(self, model_id: str, engine: Engine, template: ChatTemplate, slots: list[Slot], places: int) -> None:
        self.id = model_id
        self.engine = engine
        self.template = template
        closing = engine.tokenizer.control.get(template.closing_token() or "")
        self.end_ids = engine.tokenizer.end_ids | ({closing} if closing is not None else set())
        self.created = int(time.time())
        self.threads = ThreadPool(len(slots))
        self.tokenizer = ThreadPool(1)
        self.free_slots: gevent.queue.Queue = gevent.queue.Queue()
        for slot in slots:
            self.free_slots.put(slot)
        self._places = gevent.lock.BoundedSemaphore(places)

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = True,
                 inert: Optional[str] = None) -> list[int]:
        """Token ids of ``text``: a whole prompt (BOS and EOS as the model asks) unless not ``add_special``."""
        tokenizer = self.engine.tokenizer
        encode = tokenizer.prompt if add_special else tokenizer.encode
        return self.tokenizer.apply(encode, (text, parse_special, inert))

    def detokenize(self, tokens: list[int]) -> bytes:
        return self.tokenizer.apply(self.engine.tokenizer.decode, (tokens,))

    def admit(self, timeout: float, client_gone: Callable[[], bool], drain: Drain) -> Lease:
        """Wait up to ``timeout`` seconds for a place; Overloaded, ClientGone or ShuttingDown otherwise."""
        start = time.monotonic()
        while True:
            if drain.started:
                raise ShuttingDown()
            remaining = timeout - (time.monotonic() - start)
            if remaining <= 0:
                raise Overloaded(self.id, timeout)
            if self._places.acquire(timeout=min(CLIENT_POLL_SECONDS, remaining)):
                return Lease(self._places)
            if client_gone():
                raise ClientGone()


class ModelPool:
    """The configured models of one app; each loads once, on first use."""

    def __init__(self, settings: Settings, metrics: Metrics) -> None:
        self.settings = settings
        self.metrics = metrics
        self.drain = Drain()
        self._loaded: dict[str, LoadedModel] = {}
        self._loading: dict[str, gevent.event.AsyncResult] = {}
        self.load_errors: dict[str, str] = {}

    def is_loaded(self, model_id: str) -> bool:
        return model_id in self._loaded

    def get(self, model_id: str) -> LoadedModel:
        """The loaded model; concurrent first requests share one load."""
        if model_id not in self.settings.models:
            raise UnknownModel(model_id)
        model = self._loaded.get(model_id)
        if model is not None:
            return model
        pending = self._loading.get(model_id)
        if pending is not None:
            return pending.get()
        pending = self._loading[model_id] = gevent.event.AsyncResult()
        started = time.monotonic()
        try:
            parts = gevent.get_hub().threadpool.apply(self._load, (model_id, self.settings.models[model_id]))
        except (EngineError, ValueError) as exc:
            self.load_errors[model_id] = str(exc)
            log.error("model load failed", model=model_id, error=str(exc))
            failure = ModelUnavailable(f"model {model_id!r} could not be loaded: {exc}")
            pending.set_exception(failure)
            raise failure from None
        finally:
            del self._loading[model_id]
        # gevent objects belong to the hub's thread: build the model here, not in _load.
        model = LoadedModel(model_id, *parts, places=self.settings.parallel * self.settings.queue_depth)
        self.load_errors.pop(model_id, None)
        self._loaded[model_id] = model
        pending.set(model)
        log.info(
            "model loaded", model=model_id, seconds=round(time.monotonic() - started, 3),
            context_length=model.engine.context_length, slots=self.settings.parallel,
            threads=self.settings.effective_threads,
        )
        return model

    def _load(self, model_id: str, spec: ModelSpec) -> tuple[Engine, ChatTemplate, list[Slot]]:
        """Runs in a worker thread: the engine, its chat template and its slots."""
        engine = load_engine(model_id, spec)
        tokenizer = engine.tokenizer
        template = ChatTemplate.for_model(
            spec.chat_template, engine.chat_template, tokenizer.token_text(tokenizer.bos_id),
            tokenizer.token_text(tokenizer.eos_id), tokenizer.control,
        )
        return engine, template, [engine.new_slot(self.settings.effective_threads) for _ in range(self.settings.parallel)]
