"""``kronk-wsgi grpc``: the gRPC worker process, with health and metrics on a small HTTP side port.

gevent must have patched the process before this module is imported (the
CLI does it first): gRPC's calls then run as greenlets, on gevent's loop.
"""

import signal
from concurrent import futures
from typing import Optional, Sequence

import gevent
import gevent.event
import grpc
import grpc.experimental.gevent
import structlog
from gevent.pywsgi import WSGIServer
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc, vllm_engine_pb2_grpc

from ..config import Settings
from ..logs import configure_logging
from ..metrics import Metrics
from ..serving.pool import ModelPool, ModelUnavailable
from ..serving.runners import RunnerFiles
from .servicer import Calls, SchedulerServicer, VllmEngineServicer

log = structlog.get_logger("kronk_wsgi.grpc_worker")

# The services a worker may serve, by the name `kronk-wsgi grpc --protocol` knows each by.
SERVICES = {"sglang": "sglang.grpc.scheduler.SglangScheduler", "vllm": "vllm.grpc.engine.VllmEngine"}
# Calls served at once: each is a greenlet for as long as it streams; admission bounds the work.
MAX_CALLS = 10_000
MESSAGE_BYTES = 256 * 1024 * 1024  # a long prompt's ids, a tokenizer bundle
UNUSED_POLL_SECONDS = 0.5  # how often a runner looks whether a front still holds its model


def side_app(servicer: SchedulerServicer, metrics: Metrics):
    """The side port's WSGI app: GET /health (200 while the worker takes calls, else 503) and GET /metrics."""

    def app(environ, start_response):
        path = environ.get("PATH_INFO", "")
        if path == "/metrics":
            start_response("200 OK", [("Content-Type", "text/plain; version=0.0.4")])
            return [metrics.exposition()]
        if path == "/health":
            healthy, message = servicer.healthy()
            start_response("200 OK" if healthy else "503 Service Unavailable", [("Content-Type", "text/plain")])
            return [message.encode() + b"\n"]
        start_response("404 Not Found", [("Content-Type", "text/plain")])
        return [b"not found\n"]

    return app


def _stop_when_unused(files: RunnerFiles, users: int, stopping: gevent.event.Event) -> None:
    """A runner's watch: stop once no front holds its model, first taking back that it is ready."""
    while not stopping.is_set():
        gevent.sleep(UNUSED_POLL_SECONDS)
        if files.unused(users):
            files.path("ready").unlink(missing_ok=True)
            log.info("runner unused, stopping", model=files.model_id)
            stopping.set()


def serve(settings: Settings, bind: str, http_bind: Optional[str], protocols: Sequence[str] = tuple(SERVICES),
          runner: Optional[tuple[RunnerFiles, int]] = None) -> int:
    """Serve the default model as the services of ``protocols`` until SIGTERM or SIGINT, then drain as the HTTP
    server does; the exit status. As a model's ``runner`` (its files, and its descriptor of ``.users``), say in its
    files that the model is ready (or why not: then exit at once), and stop once no front holds it."""
    grpc.experimental.gevent.init_gevent()
    configure_logging()
    metrics = Metrics()
    pool = ModelPool(settings, metrics)
    calls = Calls()
    servicer = SchedulerServicer(pool, settings, metrics, calls)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=MAX_CALLS), options=[
        ("grpc.max_send_message_length", MESSAGE_BYTES), ("grpc.max_receive_message_length", MESSAGE_BYTES),
        ("grpc.keepalive_permit_without_calls", True), ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ])
    if "sglang" in protocols:
        sglang_scheduler_pb2_grpc.add_SglangSchedulerServicer_to_server(servicer, server)
    if "vllm" in protocols:
        vllm_engine_pb2_grpc.add_VllmEngineServicer_to_server(VllmEngineServicer(pool, settings, metrics, calls), server)
    names = ["", *(SERVICES[protocol] for protocol in protocols)]
    health_status = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_status, server)
    for name in names:
        health_status.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    if not server.add_insecure_port(bind):
        log.error("grpc bind failed", bind=bind)
        return 1
    side = None
    if http_bind:
        host, _, port = http_bind.rpartition(":")
        side = WSGIServer((host or "127.0.0.1", int(port)), side_app(servicer, metrics), log=None)
        side.start()
    server.start()
    stopping = gevent.event.Event()
    gevent.signal_handler(signal.SIGTERM, stopping.set)
    gevent.signal_handler(signal.SIGINT, stopping.set)
    log.info("grpc worker listening", bind=bind, http=http_bind, model=settings.default_model,
             protocols=list(protocols))
    try:
        with pool.use(settings.default_model):
            pass
    except ModelUnavailable as exc:  # logged by the pool; health says why
        if runner is not None:
            runner[0].mark_failed(str(exc))
            stopping.set()
    else:
        for name in names:
            health_status.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info("grpc worker ready", model=settings.default_model)
        if runner is not None:
            runner[0].mark_ready()
            gevent.spawn(_stop_when_unused, *runner, stopping)
    stopping.wait()
    log.info("grpc worker stopping", drain_seconds=settings.drain_timeout)
    for name in names:
        health_status.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    pool.drain.begin(settings.drain_timeout)
    server.stop(settings.drain_timeout + 1).wait()
    if side is not None:
        side.stop()
    pool.write_now()
    for model in pool.loaded():
        model.close()
    return 0
