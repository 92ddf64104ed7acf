"""kronk_wsgi as a worker of SGLang's engine protocol (``SglangScheduler``) and vLLM's (``VllmEngine``): token ids
in, token ids out.

It serves one model, the configured default, through the same pool,
scheduler, slots, prompt cache and limits as the HTTP server. Everything
that can fail is checked before a call's first message, so such a failure
is the call's status; once tokens flow, a failure ends the stream with a
status too (gRPC has no in-band error), and a call that is cancelled or
aborted stops its generation before the next token.
Runs on gevent: each call is a greenlet, engine work in the model's threads.
"""

import time
from typing import Callable, Iterator, Optional

import gevent
import grpc
import structlog
from google.protobuf.struct_pb2 import Struct
from google.protobuf.timestamp_pb2 import Timestamp
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc
from smg_grpc_proto.generated import vllm_engine_pb2, vllm_engine_pb2_grpc

from .. import __version__
from ..api.errors import ApiError
from ..api.planning import GenerationRequest, check, plan
from ..config import Settings
from ..metrics import Metrics
from ..serving import offload
from ..serving.drain import ShuttingDown
from ..serving.events import KeepAlive, Failed, Finished
from ..serving.jobs import GenerationJob
from ..serving.pool import LoadedModel, ModelPool, ModelUnavailable, NeverFits, NoRoom
from ..serving.reasoning import reasoning_of
from ..serving.scheduler import ClientGone, Overloaded, QueueFull
from ..serving.session import Session
from .bundle import CHUNK_BYTES, tokenizer_bundle
from .replies import Replies, message
from .requests import Refused, generation_request, stream_interval, vllm_generation_request

log = structlog.get_logger("kronk_wsgi.grpc_worker")

# How a failure after the first message ends the call.
FAILED_STATUS = {"timeout": grpc.StatusCode.DEADLINE_EXCEEDED, "shutdown": grpc.StatusCode.UNAVAILABLE,
                 "grammar_error": grpc.StatusCode.INVALID_ARGUMENT}


class Abort(Exception):
    """End the call with ``status`` and ``message`` (before its first message, or instead of its next)."""

    def __init__(self, status: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.status = status


class Calls:
    """The calls a worker runs, and those of them aborted: shared by its services, so that an Abort through one
    stops a call made through the other."""

    def __init__(self) -> None:
        self.running: set[str] = set()
        self.aborted: set[str] = set()
        self.started = time.time()


class SchedulerServicer(pb_grpc.SglangSchedulerServicer):
    """The ``SglangScheduler`` service over a model pool's default model."""

    messages = pb  # the protocol's message types

    def __init__(self, pool: ModelPool, settings: Settings, metrics: Metrics, calls: Optional[Calls] = None) -> None:
        self.pool = pool
        self.settings = settings
        self.metrics = metrics
        self.model_id = settings.default_model
        self.calls = calls or Calls()
        self.started = self.calls.started
        self._aborted = self.calls.aborted
        self._running = self.calls.running
        self._bundle: Optional[tuple[bytes, str]] = None

    # -- generation -------------------------------------------------------------------------------------------

    def Generate(self, request: pb.GenerateRequest, context: grpc.ServicerContext) -> Iterator[pb.GenerateResponse]:
        rid = request.request_id
        started = time.monotonic()
        gone = lambda: rid in self._aborted or not context.is_active()  # noqa: E731
        session: Optional[Session] = None
        outcome, status = "error", grpc.StatusCode.OK
        self._running.add(rid)
        try:
            session, replies = self._start(request, started, gone)
            for event in session:
                if isinstance(event, KeepAlive):
                    continue
                if isinstance(event, Failed):
                    raise Abort(FAILED_STATUS.get(event.code, grpc.StatusCode.INTERNAL), event.message)
                yield from replies.feed(event)
                if isinstance(event, Finished):
                    break
            outcome = session.stats.outcome
            if rid in self._aborted:
                outcome = "aborted"
                yield from replies.aborted()
            elif outcome == "client_gone":
                status = grpc.StatusCode.CANCELLED
        except Abort as exc:
            status = exc.status
            outcome = session.stats.outcome if session is not None and session.stats.outcome else "refused"
            context.abort(exc.status, str(exc))
        finally:
            if session is not None:
                session.close()
                outcome = outcome if outcome == "aborted" else session.stats.outcome or outcome
            self._running.discard(rid)
            self._aborted.discard(rid)
            self.metrics.requests.labels("grpc:Generate", self.model_id, status.name, outcome).inc()
            stats = session.stats if session is not None else None
            log.info("generate completed", request_id=rid[:100], outcome=outcome, status=status.name,
                     seconds=round(time.monotonic() - started, 3),
                     prompt_tokens=stats.prompt_tokens if stats else 0,
                     completion_tokens=stats.completion_tokens if stats else 0,
                     cached_tokens=stats.cached_tokens if stats else 0)

    def _start(self, request: pb.GenerateRequest, started: float, gone: Callable[[], bool]
               ) -> tuple[Session, Replies]:
        """Everything before the first message: the model, the request read and checked, admission, the plan."""
        model = self._claim(gone)
        try:
            try:
                generation, interval = self._read(request, model)
                offload.call(gevent.get_hub().threadpool, check, generation)  # schemas take time to check
            except Refused as exc:
                raise Abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
            except ApiError as exc:
                raise Abort(grpc.StatusCode.INVALID_ARGUMENT, _named(exc)) from None
            lease = self._admit(model, started, gone)
        finally:
            model.unclaim()
        try:
            job = plan(model, generation)
        except ApiError as exc:
            lease.release()
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT, _named(exc)) from None
        except BaseException:
            lease.release()
            raise
        settings = self.settings
        session = Session(model, lease, job, started=started, deadline=started + settings.request_timeout,
                          drain=self.pool.drain, keepalive=settings.keepalive_interval, client_gone=gone,
                          metrics=self.metrics)
        return session, self._replies(request, job, model, interval)

    def _read(self, request: pb.GenerateRequest, model: LoadedModel) -> tuple[GenerationRequest, int]:
        """The generation the call asks for, and how many tokens each streamed chunk waits for."""
        return generation_request(request, model.id), stream_interval(request)

    def _replies(self, request: pb.GenerateRequest, job: GenerationJob, model: LoadedModel, interval: int) -> Replies:
        return Replies(request.request_id, job.prompt_tokens, request.stream, job.decode.end_ids,
                       request.return_logprob, choices=len(job.prompts) * job.n, stream_interval=interval,
                       thinking_end=_thinking_end(model) if request.require_reasoning else ())

    def _claim(self, gone: Callable[[], bool]) -> LoadedModel:
        if self.pool.drain.started:
            raise Abort(grpc.StatusCode.UNAVAILABLE, "the worker is shutting down")
        try:
            return self.pool.claim(self.model_id, self.settings.admission_timeout, gone)
        except ClientGone:
            raise Abort(grpc.StatusCode.CANCELLED, "the call ended while the model loaded") from None
        except ModelUnavailable as exc:
            raise Abort(grpc.StatusCode.UNAVAILABLE, str(exc)) from None
        except NoRoom as exc:
            raise Abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)) from None
        except NeverFits as exc:
            raise Abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc)) from None

    def _admit(self, model: LoadedModel, started: float, gone: Callable[[], bool]):
        """An admission place, waited for up to the admission timeout; RESOURCE_EXHAUSTED after it."""
        wait = min(self.settings.admission_timeout, started + self.settings.request_timeout - time.monotonic())
        try:
            return model.admit(wait, gone, self.pool.drain)
        except ShuttingDown:
            raise Abort(grpc.StatusCode.UNAVAILABLE, "the worker is shutting down") from None
        except (Overloaded, QueueFull) as exc:
            self.metrics.rejected.labels(model.id).inc()
            raise Abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)) from None
        except ClientGone:
            raise Abort(grpc.StatusCode.CANCELLED, "the call ended while waiting for admission") from None

    def Abort(self, request: pb.AbortRequest, context: grpc.ServicerContext) -> pb.AbortResponse:
        """Stop a running call's generation: its stream ends before its next token."""
        found = request.request_id in self._running
        if found:
            self._aborted.add(request.request_id)
        return pb.AbortResponse(success=found, message="aborted" if found else "no such request is running")

    # -- the model and the worker -----------------------------------------------------------------------------

    def _loaded(self, context: grpc.ServicerContext) -> LoadedModel:
        model = self.pool.loaded_model(self.model_id)
        if model is None:
            reason = self.pool.load_errors.get(self.model_id, "the model is loading")
            context.abort(grpc.StatusCode.UNAVAILABLE, reason)
        return model

    def healthy(self) -> tuple[bool, str]:
        """Whether the worker takes calls, and why not."""
        if self.pool.drain.started:
            return False, "the worker is shutting down"
        if self.pool.loaded_model(self.model_id) is None:
            return False, self.pool.load_errors.get(self.model_id, "the model is loading")
        return True, "ok"

    def HealthCheck(self, request: pb.HealthCheckRequest, context: grpc.ServicerContext) -> pb.HealthCheckResponse:
        healthy, message = self.healthy()
        return self.messages.HealthCheckResponse(healthy=healthy, message=message)

    def GetModelInfo(self, request: pb.GetModelInfoRequest, context: grpc.ServicerContext) -> pb.GetModelInfoResponse:
        model = self._loaded(context)
        tokenizer, engine = model.engine.tokenizer, model.engine
        return message(
            self.messages.GetModelInfoResponse, model_path=self.model_id, tokenizer_path="", is_generation=True, served_model_name=self.model_id,
            max_context_length=engine.context_length, vocab_size=tokenizer.vocab_size,
            eos_token_ids=sorted(model.end_ids), bos_token_id=tokenizer.bos_id if tokenizer.bos_id is not None else -1,
            max_req_input_len=engine.context_length - 1, model_type=engine.kind.name, weight_version=__version__,
        )

    def GetServerInfo(self, request: pb.GetServerInfoRequest,
                      context: grpc.ServicerContext) -> pb.GetServerInfoResponse:
        model = self._loaded(context)
        slots = len(model.scheduler.slots)
        args, info = Struct(), Struct()
        args.update({"model_path": self.model_id, "served_model_name": self.model_id, "tp_size": 1, "dp_size": 1,
                     "max_running_requests": slots, "context_length": model.engine.context_length,
                     "engine": model.engine.kind.name})
        info.update({"max_total_num_tokens": slots * model.engine.context_length, "is_generation": True})
        start = Timestamp()
        start.FromSeconds(int(self.started))
        return message(
            self.messages.GetServerInfoResponse, max_num_seqs=slots, data_parallel_size=1,
            server_args=args, scheduler_info=info, active_requests=len(self._running),
            is_paused=self.pool.drain.started, uptime_seconds=time.time() - self.started,
            sglang_version=f"kronk_wsgi {__version__}", server_type="grpc", start_time=start,
            max_total_num_tokens=slots * model.engine.context_length,
        )

    def GetLoads(self, request: pb.GetLoadsRequest, context: grpc.ServicerContext) -> pb.GetLoadsResponse:
        """The model's slots at work, the calls waiting, and the tokens its busy slots hold."""
        model = self._loaded(context)
        scheduler = model.scheduler
        busy = [slot for slot, state in scheduler.states.items() if state != "idle"]
        capacity = len(scheduler.slots) * model.engine.context_length
        used = sum(len(slot.cached) for slot in busy)
        waiting = scheduler.waiting + scheduler.waiting_for_slot
        load = message(
            self.messages.SchedulerLoad,
            dp_rank=0, num_running_reqs=len(busy), num_waiting_reqs=waiting, num_total_reqs=len(busy) + waiting,
            num_used_tokens=used, max_total_num_tokens=capacity, token_usage=used / capacity,
            utilization=len(busy) / len(scheduler.slots), max_running_requests=len(scheduler.slots),
        )
        aggregate = pb.AggregateMetrics(total_running_reqs=len(busy), total_waiting_reqs=waiting,
                                        total_reqs=len(busy) + waiting, avg_token_usage=used / capacity,
                                        avg_utilization=load.utilization)
        return message(self.messages.GetLoadsResponse, timestamp=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                   version=__version__, dp_rank_count=1, loads=[load], aggregate=aggregate)

    def FlushCache(self, request: common_pb2.FlushCacheRequest,
                   context: grpc.ServicerContext) -> common_pb2.FlushCacheResponse:
        """Drop what the idle slots hold and the prompt cache's RAM tier (its disk tier stays); refused while
        generations run, as SGLang refuses it."""
        model = self._loaded(context)
        scheduler = model.scheduler
        if any(state != "idle" for state in scheduler.states.values()):
            return common_pb2.FlushCacheResponse(success=False, message="generations are running")
        for slot in scheduler.slots:
            slot.cached.clear()
        if model.prompt_cache is not None:
            model.prompt_cache.clear_ram()
        return common_pb2.FlushCacheResponse(success=True, message="flushed")

    def GetTokenizer(self, request: common_pb2.GetTokenizerRequest,
                     context: grpc.ServicerContext) -> Iterator[common_pb2.GetTokenizerChunk]:
        model = self._loaded(context)
        if self._bundle is None:
            try:
                self._bundle = offload.call(model.prep, tokenizer_bundle, model)
            except ValueError as exc:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        data, digest = self._bundle
        for start in range(0, len(data), CHUNK_BYTES):
            end = min(start + CHUNK_BYTES, len(data))
            yield common_pb2.GetTokenizerChunk(data=data[start:end], sha256=digest if end == len(data) else "")


class VllmEngineServicer(SchedulerServicer, vllm_engine_pb2_grpc.VllmEngineServicer):
    """The ``VllmEngine`` service over the same pool: the same calls in vLLM's messages (``calls`` shared with
    the worker's ``SglangScheduler``, so that either service sees every running call)."""

    messages = vllm_engine_pb2

    def _read(self, request: vllm_engine_pb2.GenerateRequest, model: LoadedModel) -> tuple[GenerationRequest, int]:
        params = request.sampling_params
        if params.grammar_from_first_token and params.WhichOneof("constraint") and reasoning_of(model.template.source):
            raise Refused("sampling_params.grammar_from_first_token", "this model thinks first: its constraint "
                          "applies from the end of its thinking")
        return vllm_generation_request(request, model.id), 1

    def _replies(self, request: vllm_engine_pb2.GenerateRequest, job: GenerationJob, model: LoadedModel,
                 interval: int) -> Replies:
        return Replies(request.request_id, job.prompt_tokens, request.stream, job.decode.end_ids,
                       request.sampling_params.HasField("logprobs"), choices=len(job.prompts) * job.n,
                       pb=vllm_engine_pb2)

    def Abort(self, request: vllm_engine_pb2.AbortRequest,
              context: grpc.ServicerContext) -> vllm_engine_pb2.AbortResponse:
        """Stop the running calls named: each stream ends before its next token."""
        self._aborted.update(rid for rid in request.request_ids if rid in self._running)
        return vllm_engine_pb2.AbortResponse()


def _thinking_end(model: LoadedModel) -> tuple[int, ...]:
    """The ids of the tag that closes the model's thinking, as its template writes it; empty if it has none."""
    syntax = reasoning_of(model.template.source)
    return tuple(model.engine.tokenizer.encode(syntax.close)) if syntax is not None else ()


def _named(exc: ApiError) -> str:
    """An API error's message with the field it names."""
    return f"{exc.param}: {exc}" if exc.param else str(exc)
