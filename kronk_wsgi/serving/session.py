"""One admitted job (a generation or embeddings) as a stream of neutral events.

The job runs in the model's worker thread and hands its events over without
waiting; the greenlet waits on that hand-over, the keep-alive timer, the
deadline and the client's socket, whichever comes first.
"""

import dataclasses
import inspect
import time
from typing import Callable, Generator, Iterator, Optional

import structlog

from ..engine.base import Cancelled, EngineBusy, EngineError, Slot
from ..engine.grammar import GrammarError
from ..metrics import GapCounter, Metrics
from .channel import ThreadChannel
from .drain import Drain
from .events import (
    KEEPALIVE, ArgumentsDelta, ChoiceEnd, Embedding, Event, Failed, Finished, Logprobs, PromptCached, ReasoningDelta,
    TextDelta, TokenIds, ToolCall, ToolCallStart, Usage, coalesce,
)
from .jobs import Job
from .pool import Lease, LoadedModel
from .scheduler import CLIENT_POLL_SECONDS

log = structlog.get_logger("kronk_wsgi.session")

# What a job produces before its end (Finished, or an exception).
OUTPUT = (PromptCached, TextDelta, ReasoningDelta, Logprobs, TokenIds, ToolCallStart, ArgumentsDelta, ToolCall,
          ChoiceEnd, Embedding)


@dataclasses.dataclass
class GenerationStats:
    """How a generation went: read by request logging and metrics."""

    outcome: str = ""  # ok, error, timeout, client_gone, shutdown, write_timeout
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    queue_wait: Optional[float] = None
    time_to_first_token: Optional[float] = None
    slot: Optional[int] = None  # the number of the slot it ran on
    drafted: int = 0  # speculative decoding: tokens drafted, and those the model took
    accepted: int = 0

    def first_token(self, elapsed: float) -> float:
        """Seconds from the request's start to its first token; ``elapsed`` (seconds so far) if none came."""
        return self.time_to_first_token if self.time_to_first_token is not None else elapsed

    def prompt_seconds(self, elapsed: float) -> float:
        """The prompt's time, as llama-server and Ollama count it: from the slot to the first token."""
        return max(0.0, self.first_token(elapsed) - (self.queue_wait or 0.0))


class _Cancel:
    """A flag set by the greenlet and read by the worker thread (a plain attribute: no locks)."""

    def __init__(self) -> None:
        self.requested = False

    def __call__(self) -> bool:
        return self.requested


def _drive(job: Job, slot: Slot, model: LoadedModel, cancel: _Cancel, channel: ThreadChannel) -> None:
    """Worker thread: run the job, handing each event to the channel."""
    try:
        for event in job.run(slot, model.engine.context_length, cancel):
            if isinstance(event, Finished) and model.shared_cache:  # before the client can send its next turn
                slot.announce_state()
            channel.put((time.monotonic(), event))
    except Cancelled:
        pass
    except Exception as exc:  # the engine's failure becomes an in-band event
        channel.put((time.monotonic(), exc))
    else:
        if model.shared_cache:
            # The answer is out, and its next turn may come to another worker: saved now, written to disk once
            # the slot is given back.
            slot.keep_state(waited_for=True)


class _Passed:
    """The lease of a session that handed its admission place on: nothing left to release."""

    def release(self) -> None:
        pass


_PASSED = _Passed()


class Session:
    """Run one job on a model, as neutral events (KeepAlive included).

    Holds the admission ``lease``; the lease and the slot are given back when
    the worker thread is done with the slot, however the stream ends. Iterate
    it once; ``close()`` it in every case (a session never iterated still
    holds its lease).
    """

    def __init__(
        self,
        model: LoadedModel,
        lease: Lease,
        job: Job,
        *,
        started: float,
        deadline: float,
        drain: Drain,
        keepalive: float,
        client_gone: Callable[[], bool],
        metrics: Metrics,
        stats: Optional[GenerationStats] = None,
    ) -> None:
        """``stats``: those of the request's earlier generation, which this one's then take the place of."""
        self.model = model
        self.lease = lease
        self.job = job
        self.started = started
        self.deadline = deadline
        self.drain = drain
        self.keepalive = keepalive
        self.client_gone = client_gone
        self.metrics = metrics
        self.stats = stats or GenerationStats()
        self.stats.outcome, self.stats.time_to_first_token = "", None
        self.stats.prompt_tokens = job.prompt_tokens
        self._gaps = GapCounter(metrics.inter_token_latency.labels(model.id))
        self._events: Optional[Generator[Event, None, None]] = None

    def __iter__(self) -> Iterator[Event]:
        self._events = self._run()
        return self._events

    def close(self) -> None:
        """Stop generating and give everything back; safe to call more than once."""
        if self._events is None or inspect.getgeneratorstate(self._events) == inspect.GEN_CREATED:
            # Never started (closing it would skip its finally): only the lease is held.
            self.stats.outcome = self.stats.outcome or "client_gone"
            self.lease.release()
        else:
            self._events.close()

    def pass_lease(self) -> Lease:
        """The admission place, handed to the generation that follows this ended one in the same request: this
        session then gives back only its slot."""
        lease, self.lease = self.lease, _PASSED
        return lease

    def _run(self) -> Iterator[Event]:
        cancel = _Cancel()
        slot: Optional[Slot] = None
        worker = None
        try:
            slot = yield from self._wait_for_slot()
            if slot is None:
                return
            self.stats.queue_wait = time.monotonic() - self.started
            self.stats.slot = self.model.scheduler.slots.index(slot)
            self.metrics.queue_wait.labels(self.model.id).observe(self.stats.queue_wait)
            channel = ThreadChannel()
            worker = self.model.slot_threads.spawn(_drive, self.job, slot, self.model, cancel, channel)
            self.metrics.active_streams.labels(self.model.id).inc()
            worker.rawlink(lambda _: self._worker_done(slot, channel))
            yield from self._relay(slot, channel, cancel)
        finally:
            cancel.requested = True
            self._gaps.flush()
            self.stats.completion_tokens = self.job.completion_tokens
            self.stats.cached_tokens = self.job.cached_tokens  # a stream the client left reused them too
            if not self.stats.outcome:
                self.stats.outcome = "client_gone"
            if worker is None:
                self._release(slot)

    def _worker_done(self, slot: Slot, channel: ThreadChannel) -> None:
        """The worker thread let go of the slot: only now may the channel close and the slot be reused."""
        channel.close()
        self.metrics.active_streams.labels(self.model.id).dec()
        self._release(slot)

    def _release(self, slot: Optional[Slot]) -> None:
        if slot is not None:
            self.model.give_back(slot)
            self.model.report_cache(self.metrics)
        self.lease.release()

    def _wait_for_slot(self) -> Iterator[Event]:
        """Wait in the model's slot line, keeping the stream alive; the slot, or None if the wait ended."""
        scheduler = self.model.scheduler
        ticket = scheduler.wait_for_slot(self.job.prefix, self.job.scope, self.job.slot)
        quiet_since = time.monotonic()
        taken = False
        try:
            while True:
                now = time.monotonic()
                wait = min(CLIENT_POLL_SECONDS, self.deadline - now, self.keepalive - (now - quiet_since))
                if self.drain.deadline is not None:
                    wait = min(wait, self.drain.deadline - now)
                if ticket.granted.wait(max(wait, 0)):
                    taken = True
                    return ticket.slot
                now = time.monotonic()
                cut = self._cut(now)
                if cut is not None:
                    yield cut
                    return None
                if self.client_gone():
                    self.stats.outcome = "client_gone"
                    return None
                if now - quiet_since >= self.keepalive:
                    yield KEEPALIVE
                    quiet_since = now
        finally:
            if not taken:  # a slot handed over as the wait ended goes back to the line
                scheduler.leave(ticket)

    def _relay(self, slot: Slot, channel: ThreadChannel, cancel: _Cancel) -> Iterator[Event]:
        """Pass the worker's events on, with keep-alives, deadline and disconnect checks; the slot's state follows
        them (its first token out, it is generating; its answer out, finishing)."""
        labels = self.model.id
        scheduler = self.model.scheduler
        quiet_since = checked = time.monotonic()
        last_token: Optional[float] = None
        while True:
            now = time.monotonic()
            wait = min(checked + CLIENT_POLL_SECONDS, quiet_since + self.keepalive, self.deadline,
                       self.drain.deadline or self.deadline) - now
            items = channel.take_all(max(wait, 0))
            now = time.monotonic()
            batch: list[Event] = []
            for produced, item in items:
                if not isinstance(item, OUTPUT):
                    scheduler.finishing(slot)
                    yield from coalesce(batch)
                    yield self._finish(item)
                    return
                if self.stats.time_to_first_token is None and not isinstance(item, PromptCached):
                    scheduler.generating(slot)
                    self.stats.time_to_first_token = produced - self.started
                    self.metrics.time_to_first_token.labels(labels).observe(self.stats.time_to_first_token)
                if isinstance(item, (TextDelta, ReasoningDelta, ArgumentsDelta)):
                    if last_token is not None:
                        self._gaps.observe(produced - last_token)
                    last_token = produced
                batch.append(item)
            yield from coalesce(batch)
            if items:
                quiet_since = now
            cut = self._cut(now)
            if cut is not None:
                cancel.requested = True
                yield cut
                return
            if now - checked >= CLIENT_POLL_SECONDS:
                checked = now
                if self.client_gone():
                    self.stats.outcome = "client_gone"
                    return
            if now - quiet_since >= self.keepalive:
                yield KEEPALIVE
                quiet_since = now

    def _cut(self, now: float) -> Optional[Failed]:
        """The failure that ends the request now: the request timeout, or the shutdown's drain deadline."""
        if now >= self.deadline:
            self.stats.outcome = "timeout"
            return Failed("timeout", "the request ran past the request timeout")
        if self.drain.expired(now):
            self.stats.outcome = "shutdown"
            return Failed("shutdown", "the server is shutting down; the response is incomplete")
        return None

    def _count_as_llama_server(self, usage: Usage) -> None:
        """llama-server's metrics of a finished generation: its prompt's time ran from the slot to the first token."""
        elapsed = time.monotonic() - self.started
        self.metrics.generation_done(
            self.model.id, usage.prompt_tokens - usage.cached_tokens, usage.cached_tokens,
            self.stats.prompt_seconds(elapsed), usage.completion_tokens,
            max(0.0, elapsed - self.stats.first_token(elapsed)),
            usage.prompt_tokens + usage.completion_tokens, self.model.engine.decode_counts())

    def _finish(self, item: object) -> Event:
        """The terminal event: Finished, or Failed for an engine exception (its metrics written before it goes out)."""
        self._gaps.flush()
        if isinstance(item, Finished):
            self.stats.outcome = "ok"
            self.stats.cached_tokens = item.usage.cached_tokens
            drafting = getattr(self.job, "drafting", None)
            if drafting is not None and drafting.drafts:
                self.stats.drafted, self.stats.accepted = drafting.drafted, drafting.accepted
                self.metrics.speculation_done(self.model.id, drafting)
            tokens = self.metrics.tokens
            tokens.labels(self.model.id, "prompt").inc(item.usage.prompt_tokens)
            tokens.labels(self.model.id, "completion").inc(item.usage.completion_tokens)
            self._count_as_llama_server(item.usage)
            return item
        self.stats.outcome = "error"
        if isinstance(item, GrammarError):  # a client's grammar past a step's limits: no traceback, no grammar text
            log.warning("grammar failed during generation", model=self.model.id, error=str(item)[:300])
            return Failed("grammar_error", "the reply's grammar went past the constraint engine's limits at a later "
                          "step; the response is incomplete")
        if isinstance(item, EngineBusy):
            log.warning("engine busy past its admission wait", model=self.model.id, error=str(item)[:500])
            return Failed("model_busy", "the model stayed busy past the admission wait; retry later")
        if isinstance(item, EngineError):  # a failure the engine names (a worker gone): its reason, no traceback
            log.error("engine failed during generation", model=self.model.id, error=str(item)[:500])
        else:
            log.error("engine failed during generation", model=self.model.id, exc_info=item)
        return Failed("engine_error", "the model failed while generating; the response is incomplete")
