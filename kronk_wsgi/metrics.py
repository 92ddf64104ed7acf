"""Prometheus metrics of one app, in a registry of its own (several apps per process work).

Under the standalone server, PROMETHEUS_MULTIPROC_DIR is set before the workers
start (server.on_starting): every worker then writes its values to files there,
and /metrics, whichever worker answers, reports the whole server.
"""

import bisect
import dataclasses
import os
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import multiprocess
from prometheus_client.metrics_core import Metric

from .engine.speculation import Drafting

@dataclasses.dataclass
class _Totals:
    """One model's sums behind llama-server's average throughputs, and its decode calls counted so far."""

    prompt_tokens: int = 0
    prompt_seconds: float = 0.0
    predicted: int = 0
    predicted_seconds: float = 0.0
    calls: int = 0


# Values llama-server publishes that kronk's own gauges hold: written once, shown under both names.
_LLAMACPP_NAMES = {
    "kronk_active_generations": ("llamacpp:requests_processing", "Number of requests processing."),
    "kronk_requests_waiting": ("llamacpp:requests_deferred", "Number of requests deferred."),
}

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 180)
_TOKEN_GAP = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1)


class Metrics:
    """Every metric kronk_wsgi records."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._serving(self.registry)
        self._prompt_cache(self.registry)
        self._llamacpp(self.registry)
        self._llamacpp_totals: dict[str, _Totals] = {}  # per model: this app's sums behind the averages

    def _serving(self, r: CollectorRegistry) -> None:
        """kronk's own: requests, their timings and tokens, slots and lines, background responses, model events."""
        self.requests = Counter(
            "kronk_requests", "Requests by route, model, status and outcome.",
            ["route", "model", "status", "outcome"], registry=r,
        )
        self.request_duration = Histogram(
            "kronk_request_duration_seconds", "Request time until the response closed.",
            ["route"], buckets=_LATENCY, registry=r,
        )
        self.time_to_first_token = Histogram(
            "kronk_time_to_first_token_seconds", "From request start to the first generated text.",
            ["model"], buckets=_LATENCY, registry=r,
        )
        self.inter_token_latency = Histogram(
            "kronk_inter_token_latency_seconds", "Gap between two generated tokens.",
            ["model"], buckets=_TOKEN_GAP, registry=r,
        )
        self.tokens = Counter("kronk_tokens", "Tokens processed.", ["model", "kind"], registry=r)
        self.queue_wait = Histogram(
            "kronk_queue_wait_seconds", "Wait for an admission place and a slot.",
            ["model"], buckets=_LATENCY, registry=r,
        )
        self.active_streams = Gauge("kronk_active_generations", "Generations running on a slot.", ["model"], registry=r,
                                    multiprocess_mode="livesum")
        self.slots = Gauge("kronk_slots", "Slots of loaded models by state: idle, prefilling, generating, finishing "
                           "(after an answer).", ["model", "state"], registry=r, multiprocess_mode="livesum")
        self.waiting = Gauge("kronk_requests_waiting", "Requests waiting in line for an admission place or a slot.",
                             ["model"], registry=r, multiprocess_mode="livesum")
        self.background_responses = Counter("kronk_background_responses", "Background responses by how they ended.",
                                            ["model", "status"], registry=r)
        self.rejected = Counter("kronk_rejected", "Requests refused with 429 after the admission wait.", ["model"], registry=r)
        self.model_events = Counter(
            "kronk_model_events", "Model loads, failed loads, unloads (idle, room, admin) and refused loads "
            "(no_room, never_fits).", ["model", "event"], registry=r)

    def _prompt_cache(self, r: CollectorRegistry) -> None:
        """The prompt cache's lookups, saves and evictions, and what it holds."""
        self.prompt_cache_events = Counter(
            "kronk_prompt_cache_events", "Prompt cache lookups (hits, misses), states saved, evicted (from RAM, from "
            "disk) and disk entries found corrupt.", ["model", "event"], registry=r)
        self.prompt_cache_restored_tokens = Counter(
            "kronk_prompt_cache_restored_tokens", "Prompt tokens restored from saved states.", ["model"], registry=r)
        self.prompt_cache_ram_bytes = Gauge("kronk_prompt_cache_ram_bytes", "Saved states held in RAM.", ["model"],
                                            registry=r, multiprocess_mode="livesum")
        self.prompt_cache_disk_bytes = Gauge("kronk_prompt_cache_disk_bytes", "Saved states on disk (shared by the "
                                             "workers).", ["model"], registry=r, multiprocess_mode="max")

    def _llamacpp(self, r: CollectorRegistry) -> None:
        """llama-server's metrics, under its names, for the dashboards made for it: each labelled with the model
        (its requests processing and deferred are kronk's gauges, shown under its names too)."""
        self.llamacpp_prompt_tokens = Counter("llamacpp:prompt_tokens", "Number of prompt tokens processed.",
                                              ["model"], registry=r)
        self.llamacpp_prompt_tokens_cached = Counter("llamacpp:prompt_tokens_cached", "Number of prompt tokens "
                                                     "served from a cache.", ["model"], registry=r)
        self.llamacpp_prompt_seconds = Counter("llamacpp:prompt_seconds", "Prompt process time in seconds.",
                                               ["model"], registry=r)
        self.llamacpp_tokens_predicted = Counter("llamacpp:tokens_predicted", "Number of generation tokens processed.",
                                                 ["model"], registry=r)
        self.llamacpp_tokens_predicted_seconds = Counter(
            "llamacpp:tokens_predicted_seconds", "Predict process time in seconds.", ["model"], registry=r)
        self.llamacpp_prompt_throughput = Gauge(
            "llamacpp:prompt_tokens_seconds", "Average prompt throughput in tokens/s (of the worker that last "
            "answered).", ["model"], registry=r, multiprocess_mode="mostrecent")
        self.llamacpp_predicted_throughput = Gauge(
            "llamacpp:predicted_tokens_seconds", "Average generation throughput in tokens/s (of the worker that last "
            "answered).", ["model"], registry=r, multiprocess_mode="mostrecent")
        self.llamacpp_n_tokens_max = Gauge("llamacpp:n_tokens_max", "High watermark of the context size observed.",
                                           ["model"], registry=r, multiprocess_mode="max")
        self.llamacpp_n_decode = Counter("llamacpp:n_decode", "Total number of llama_decode() calls.", ["model"],
                                         registry=r)
        self.llamacpp_busy_slots_per_decode = Gauge(
            "llamacpp:n_busy_slots_per_decode", "Average number of busy slots per llama_decode() call (of the worker "
            "that last answered).", ["model"], registry=r, multiprocess_mode="mostrecent")
        self.llamacpp_draft_tokens = Counter(
            "llamacpp:spec_decode_num_draft_tokens", "Speculative: Total draft tokens generated.", ["model"], registry=r)
        self.llamacpp_accepted_tokens = Counter(
            "llamacpp:spec_decode_num_accepted_tokens", "Speculative: Total draft tokens accepted by the target model.",
            ["model"], registry=r)
        self.llamacpp_drafts = Counter(
            "llamacpp:spec_decode_num_drafts", "Speculative: Total speculative decoding verification steps.", ["model"],
            registry=r)
        self.accepted_by_position = Counter(
            "kronk_spec_decode_accepted_tokens", "Speculative: draft tokens accepted, by their place in their draft "
            "(1: the first).", ["model", "position"], registry=r)

    def generation_done(self, model: str, prompt_tokens: int, cached_tokens: int, prompt_seconds: float,
                        predicted: int, predicted_seconds: float, context_used: int, decodes: tuple[int, int]) -> None:
        """Count a generation under llama-server's names: the prompt tokens it evaluated (and those a cache served)
        and how long that took, the tokens it generated and how long that took, the context it filled, and the
        model's decode calls and the sequences they carried so far (``decodes``, since its load)."""
        self.llamacpp_prompt_tokens.labels(model).inc(prompt_tokens)
        self.llamacpp_prompt_tokens_cached.labels(model).inc(cached_tokens)
        self.llamacpp_prompt_seconds.labels(model).inc(prompt_seconds)
        self.llamacpp_tokens_predicted.labels(model).inc(predicted)
        self.llamacpp_tokens_predicted_seconds.labels(model).inc(predicted_seconds)
        totals = self._llamacpp_totals.setdefault(model, _Totals())
        totals.prompt_tokens += prompt_tokens
        totals.prompt_seconds += prompt_seconds
        totals.predicted += predicted
        totals.predicted_seconds += predicted_seconds
        if totals.prompt_seconds > 0:
            self.llamacpp_prompt_throughput.labels(model).set(totals.prompt_tokens / totals.prompt_seconds)
        if totals.predicted_seconds > 0:
            self.llamacpp_predicted_throughput.labels(model).set(totals.predicted / totals.predicted_seconds)
        high = self.llamacpp_n_tokens_max.labels(model)
        if context_used > high._value.get():
            high.set(context_used)
        calls, sequences = decodes
        if calls < totals.calls:  # the model was loaded again: its counts start over
            totals.calls = 0
        self.llamacpp_n_decode.labels(model).inc(calls - totals.calls)
        totals.calls = calls
        if calls:
            self.llamacpp_busy_slots_per_decode.labels(model).set(sequences / calls)

    def speculation_done(self, model: str, drafting: Drafting) -> None:
        """Count a generation's speculative drafts, the tokens drafted and those taken (by their place too)."""
        self.llamacpp_drafts.labels(model).inc(drafting.drafts)
        self.llamacpp_draft_tokens.labels(model).inc(drafting.drafted)
        self.llamacpp_accepted_tokens.labels(model).inc(drafting.accepted)
        for place, count in enumerate(drafting.accepted_at, 1):
            self.accepted_by_position.labels(model, str(place)).inc(count)

    def exposition(self) -> bytes:
        """The metrics in Prometheus' text format: of all workers when they share a directory, else of this app."""
        if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            return generate_latest(_WithLlamaCppNames(self.registry))
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        return generate_latest(_WithLlamaCppNames(registry))


class _WithLlamaCppNames:
    """A registry's metrics, and again under llama-server's name those of ``_LLAMACPP_NAMES``."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry

    def collect(self):
        for family in self._registry.collect():
            yield family
            if family.name in _LLAMACPP_NAMES:
                name, documentation = _LLAMACPP_NAMES[family.name]
                alias = Metric(name, documentation, family.type)
                alias.samples = [sample._replace(name=name) for sample in family.samples]
                yield alias


class GapCounter:
    """One stream's inter-token gaps, counted here and added to the histogram about once a second.

    ``Histogram.observe`` writes two values to the metrics file under a lock, a cost per token
    on the event loop that shows in a stream's rate (docs/ENGINES.rst). A stream's gaps fall in a few buckets,
    so adding each bucket's count at once costs a few writes a second instead. It adds to the
    child's own bucket and sum values, as ``observe`` does (prometheus_client's internals: a test
    checks that the result is what observing each gap gives). Call ``flush`` when the stream ends.
    """

    FLUSH_SECONDS = 1.0

    def __init__(self, histogram) -> None:
        self._histogram = histogram  # one labelled child
        self._counts: dict[int, int] = {}
        self._sum = 0.0
        self._flushed = time.monotonic()

    def observe(self, gap: float) -> None:
        bucket = bisect.bisect_left(self._histogram._upper_bounds, gap)  # the first bound >= gap, as observe() picks
        self._counts[bucket] = self._counts.get(bucket, 0) + 1
        self._sum += gap
        if time.monotonic() - self._flushed >= self.FLUSH_SECONDS:
            self.flush()

    def flush(self) -> None:
        if self._counts:
            self._histogram._sum.inc(self._sum)
            for bucket, count in self._counts.items():
                self._histogram._buckets[bucket].inc(count)
        self._counts.clear()
        self._sum = 0.0
        self._flushed = time.monotonic()
