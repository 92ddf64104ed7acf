"""One admitted job (a generation or embeddings) as a stream of neutral events.

The decode loop runs in the model's worker thread and hands text over without
waiting; the greenlet waits on that hand-over, the keep-alive timer, the
deadline and the client's socket, whichever comes first.
"""

import dataclasses
import inspect
import itertools
import time
from typing import Callable, Generator, Iterator, Optional, Protocol

import gevent.queue
import numpy as np
import structlog

from ..engine.base import Cancelled, Slot
from ..engine.generate import Generation
from ..engine.sampling import SamplingParams
from ..metrics import Metrics
from .channel import ThreadChannel
from .events import KEEPALIVE, Embedding, Event, Failed, Finished, TextDelta, ToolCall, Usage
from .pool import CLIENT_POLL_SECONDS, Lease, LoadedModel
from .tool_calls import ToolCallParser, ToolCallSyntax

log = structlog.get_logger("kronk_wsgi.session")


class Job(Protocol):
    """Work for one slot, run in the slot's worker thread as a stream of events ending in Finished."""

    prompt_tokens: int

    @property
    def completion_tokens(self) -> int: ...

    def run(self, slot: Slot, context_length: int, cancelled: Callable[[], bool]) -> Iterator[Event]: ...


class GenerationJob:
    """Generate text for one prompt; with a tool-call syntax, tool calls are parsed out of it.

    ``reply_start`` is text at the end of the prompt that belongs to the reply
    (the opening of a forced tool call): the parser reads it first. With
    ``one_tool_call`` generation ends at the first tool call.
    """

    def __init__(
        self,
        prompt: list[int],
        *,
        max_tokens: int,
        sampling: SamplingParams,
        stop: tuple[str, ...] = (),
        tool_syntax: Optional[ToolCallSyntax] = None,
        reply_start: str = "",
        one_tool_call: bool = False,
    ) -> None:
        self.prompt = prompt
        self.prompt_tokens = len(prompt)
        self.max_tokens = max_tokens
        self.sampling = sampling
        self.stop = stop
        self.tool_syntax = tool_syntax
        self.reply_start = reply_start
        self.one_tool_call = one_tool_call
        self._generation: Optional[Generation] = None

    @property
    def completion_tokens(self) -> int:
        # A plain int the worker thread writes: reading it needs no lock.
        return self._generation.completion_tokens if self._generation else 0

    def run(self, slot: Slot, context_length: int, cancelled: Callable[[], bool]) -> Iterator[Event]:
        generation = self._generation = Generation(
            slot, self.prompt, max_tokens=self.max_tokens, context_length=context_length,
            sampling=self.sampling, stop=self.stop, cancelled=cancelled,
        )
        if self.tool_syntax is None:
            yield from map(TextDelta, generation)
            yield Finished(generation.finish_reason, self._usage(), generation.stop_sequence)
            return
        parser = ToolCallParser(self.tool_syntax)
        for text in itertools.chain([self.reply_start], generation):
            for event in parser.feed(text):
                yield event
                if self.one_tool_call and isinstance(event, ToolCall):
                    yield Finished("tool_calls", self._usage())
                    return
        yield from parser.flush()
        reason = generation.finish_reason
        if parser.calls and reason == "stop" and generation.stop_sequence is None:
            reason = "tool_calls"
        yield Finished(reason, self._usage(), generation.stop_sequence)

    def _usage(self) -> Usage:
        generation = self._generation
        return Usage(self.prompt_tokens, generation.completion_tokens, generation.cached_tokens)


class EmbeddingJob:
    """Embed each input: the final hidden state of its last token, scaled to unit length."""

    completion_tokens = 0

    def __init__(self, inputs: list[list[int]]) -> None:
        self.inputs = inputs
        self.prompt_tokens = sum(len(tokens) for tokens in inputs)

    def run(self, slot: Slot, context_length: int, cancelled: Callable[[], bool]) -> Iterator[Event]:
        for index, tokens in enumerate(self.inputs):
            slot.prefill(tokens, cancelled)
            vector = slot.embedding()
            norm = float(np.linalg.norm(vector))
            yield Embedding(index, vector / norm if norm > 0 else vector)
        yield Finished("stop", Usage(self.prompt_tokens, 0))


@dataclasses.dataclass
class GenerationStats:
    """How a generation went: read by request logging and metrics."""

    outcome: str = ""  # ok, error, timeout, client_gone
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    queue_wait: Optional[float] = None
    time_to_first_token: Optional[float] = None


class _Cancel:
    """A flag set by the greenlet and read by the worker thread (a plain attribute: no locks)."""

    def __init__(self) -> None:
        self.set = False

    def __call__(self) -> bool:
        return self.set


def _drive(job: Job, slot: Slot, context_length: int, cancel: _Cancel, channel: ThreadChannel) -> None:
    """Worker thread: run the job, handing each event to the channel."""
    try:
        for event in job.run(slot, context_length, cancel):
            channel.put((time.monotonic(), event))
    except Cancelled:
        pass
    except Exception as exc:  # the engine's failure becomes an in-band event
        channel.put((time.monotonic(), exc))


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
        keepalive: float,
        client_gone: Callable[[], bool],
        metrics: Metrics,
    ) -> None:
        self.model = model
        self.lease = lease
        self.job = job
        self.started = started
        self.deadline = deadline
        self.keepalive = keepalive
        self.client_gone = client_gone
        self.metrics = metrics
        self.stats = GenerationStats(prompt_tokens=job.prompt_tokens)
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

    def _run(self) -> Iterator[Event]:
        cancel = _Cancel()
        slot: Optional[Slot] = None
        job = None
        try:
            slot = yield from self._wait_for_slot()
            if slot is None:
                return
            self.stats.queue_wait = time.monotonic() - self.started
            self.metrics.queue_wait.labels(self.model.id).observe(self.stats.queue_wait)
            channel = ThreadChannel()
            job = self.model.threads.spawn(_drive, self.job, slot, self.model.engine.context_length, cancel, channel)
            self.metrics.active_streams.labels(self.model.id).inc()
            job.rawlink(lambda _: self._job_done(slot, channel))
            yield from self._relay(channel, cancel)
        finally:
            cancel.set = True
            self.stats.completion_tokens = self.job.completion_tokens
            if not self.stats.outcome:
                self.stats.outcome = "client_gone"
            if job is None:
                self._release(slot)

    def _job_done(self, slot: Slot, channel: ThreadChannel) -> None:
        """The worker thread let go of the slot: only now may the channel close and the slot be reused."""
        channel.close()
        self.metrics.active_streams.labels(self.model.id).dec()
        self._release(slot)

    def _release(self, slot: Optional[Slot]) -> None:
        if slot is not None:
            self.model.free_slots.put(slot)
        self.lease.release()

    def _wait_for_slot(self) -> Iterator[Event]:
        """Wait for a free slot, keeping the stream alive; None if the wait ended."""
        quiet_since = time.monotonic()
        while True:
            now = time.monotonic()
            if self._expired(now):
                yield self._timeout()
                return None
            if self.client_gone():
                self.stats.outcome = "client_gone"
                return None
            if now - quiet_since >= self.keepalive:
                yield KEEPALIVE
                quiet_since = now
            wait = min(CLIENT_POLL_SECONDS, self.deadline - now, self.keepalive - (now - quiet_since))
            try:
                return self.model.free_slots.get(timeout=max(wait, 0))
            except gevent.queue.Empty:
                continue

    def _relay(self, channel: ThreadChannel, cancel: _Cancel) -> Iterator[Event]:
        """Pass the worker's events on, with keep-alives, deadline and disconnect checks."""
        labels = self.model.id
        itl = self.metrics.inter_token_latency.labels(labels)
        quiet_since = checked = time.monotonic()
        last_token: Optional[float] = None
        while True:
            now = time.monotonic()
            wait = min(checked + CLIENT_POLL_SECONDS, quiet_since + self.keepalive, self.deadline) - now
            items = channel.take_all(max(wait, 0))
            now = time.monotonic()
            text = []
            for produced, item in items:
                if not isinstance(item, (TextDelta, ToolCall, Embedding)):
                    if text:
                        yield TextDelta("".join(text))
                    yield self._finish(item)
                    return
                if self.stats.time_to_first_token is None:
                    self.stats.time_to_first_token = produced - self.started
                    self.metrics.time_to_first_token.labels(labels).observe(self.stats.time_to_first_token)
                if isinstance(item, TextDelta):
                    if last_token is not None:
                        itl.observe(produced - last_token)
                    last_token = produced
                    text.append(item.text)
                    continue
                if text:
                    yield TextDelta("".join(text))
                    text = []
                yield item
            if items:
                quiet_since = now
            if text:
                yield TextDelta("".join(text))
            if self._expired(now):
                cancel.set = True
                yield self._timeout()
                return
            if now - checked >= CLIENT_POLL_SECONDS:
                checked = now
                if self.client_gone():
                    self.stats.outcome = "client_gone"
                    return
            if now - quiet_since >= self.keepalive:
                yield KEEPALIVE
                quiet_since = now

    def _expired(self, now: float) -> bool:
        return now >= self.deadline

    def _timeout(self) -> Failed:
        self.stats.outcome = "timeout"
        return Failed("timeout", "the request ran past the request timeout")

    def _finish(self, item: object) -> Event:
        """The terminal event: Finished, or Failed for an engine exception."""
        if isinstance(item, Finished):
            self.stats.outcome = "ok"
            self.stats.cached_tokens = item.usage.cached_tokens
            tokens = self.metrics.tokens
            tokens.labels(self.model.id, "prompt").inc(item.usage.prompt_tokens)
            tokens.labels(self.model.id, "completion").inc(item.usage.completion_tokens)
            return item
        self.stats.outcome = "error"
        log.error("engine failed during generation", model=self.model.id, exc_info=item)
        return Failed("engine_error", "the model failed while generating; the response is incomplete")
