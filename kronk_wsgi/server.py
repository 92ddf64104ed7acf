"""Running under gunicorn with the gevent worker: hooks and the embedded application."""

import json
import os
import resource
import shutil
import sys
import tempfile
from typing import Any, Mapping, Optional

from gunicorn.app.base import BaseApplication

from .config import ConfigError, config_key, read_config, settings_from_config

# Settings both `kronk-wsgi serve` and conf/gunicorn.conf.py use.
GUNICORN_DEFAULTS = {
    "worker_class": "kronk_wsgi.worker.Worker",  # gunicorn's gevent worker, answering errors in JSON
    "worker_connections": 10000,
    "timeout": 30,  # gevent: fires only when the loop is blocked; engine calls never block it
    "keepalive": 5,
    "preload_app": False,  # gevent patches after fork: every worker builds its own app
    # gunicorn's control socket is one path per user (~/.gunicorn/gunicorn.ctl): two instances on one machine
    # would take it from each other. kronk-wsgi has no use for it.
    "control_socket_disable": True,
}

# After the drain deadline, streams end with an in-band error: gunicorn must wait that long, and a little more.
GRACE_AFTER_DRAIN = 15


def graceful_timeout(drain_timeout: float) -> int:
    """gunicorn's graceful_timeout for a drain deadline: workers are not killed before their streams end."""
    return int(drain_timeout) + GRACE_AFTER_DRAIN


def on_exit(server) -> None:
    """Remove the metrics and runner directories the server made for itself (a runner stops once its last worker
    has gone)."""
    for directory in (getattr(server, "kronk_metrics_dir", None), getattr(server, "kronk_runner_dir", None)):
        if directory:
            shutil.rmtree(directory, ignore_errors=True)


def child_exit(server, worker) -> None:
    """A worker ended: its live gauges (generations running) no longer count."""
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(worker.pid)


def post_worker_init(worker) -> None:
    """Load the default model; begin the app's drain the moment gunicorn tells the worker to stop (SIGTERM, or a
    reload); the first worker says what is served once its default model is loaded."""
    import gevent

    kronk = worker.wsgi.extensions["kronk"]
    kronk.start()

    def watch() -> None:
        while worker.alive:
            gevent.sleep(0.1)
        worker.log.info("kronk_wsgi: draining, running streams may go on for %g s", kronk.settings.drain_timeout)
        kronk.pool.drain.begin(kronk.settings.drain_timeout)

    gevent.spawn(watch)
    if worker.age == 1:
        gevent.spawn(_announce, worker, kronk)


def _announce(worker, kronk) -> None:
    """Print, in plain words, what is served and where, and one command to try it."""
    import gevent

    from .catalog import local_file

    settings, pool = kronk.settings, kronk.pool
    model_id = settings.default_model
    while worker.alive and pool.loaded_model(model_id) is None and model_id not in pool.load_errors:
        gevent.sleep(0.2)
    model = pool.loaded_model(model_id)
    if model is None:
        return  # the load failed: the log and readiness say why
    host, _, port = str(worker.cfg.bind[0]).rpartition(":")
    url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{port}"
    engine = model.engine
    others = sorted(set(settings.models) - {model_id})
    example = json.dumps({"model": model_id, "stream": True, "messages": [{"role": "user", "content": "Hello!"}]})
    lines = [
        f"kronk-wsgi: serving {model_id} at {url}/v1 (OpenAI), {url}/v1/messages (Anthropic)",
        f"  file     {local_file(settings.models[model_id]) or settings.models[model_id].describe()}",
        f"  engine   {engine.kind.name}, context {engine.context_length} tokens, {settings.parallel} slot(s), "
        f"{settings.workers} worker(s)",
        *([f"  also     {', '.join(others)} (each loaded on first use)"] if others else []),
        f"  try      curl -N {url}/v1/chat/completions -H 'Content-Type: application/json' -d '{example}'",
    ]
    print("\n".join(lines), file=sys.stderr, flush=True)


def _open_files(wanted: int) -> None:
    """Raise the soft limit of open files towards ``wanted`` (at most the hard limit): the workers inherit it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


def on_starting(server) -> None:
    """Validate the configuration in the master before any worker starts; give the workers a metrics directory
    and room for their connections."""
    os.environ[config_key("workers")] = str(server.cfg.workers)
    _open_files(server.cfg.worker_connections + 1024)  # connections, plus models, threads and files
    # Before any worker imports prometheus_client: the directory decides how every value is kept.
    if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = server.kronk_metrics_dir = tempfile.mkdtemp(prefix="kronk-metrics-")
    if not os.environ.get(config_key("runner_dir")):  # where the workers share their models' runners
        os.environ[config_key("runner_dir")] = server.kronk_runner_dir = tempfile.mkdtemp(prefix="kronk-runners-")
    try:
        settings = settings_from_config(read_config())
        # What any engine run in the workers needs; each model's own engine is checked when a worker loads it (the
        # engine modules import ssl, which must come after gevent's patching, in the workers). A runner is one
        # process: its threads are checked there.
        if any(spec.runner == "inline" for spec in settings.models.values()):
            settings.check_cores(batched=True)
    except ConfigError as exc:
        sys.stderr.write(f"kronk-wsgi: {exc}\n")
        sys.exit(2)
    server.log.info("kronk_wsgi: %d worker(s) x %d slot(s); default model %s",
                    settings.workers, settings.parallel, settings.default_model)


class KronkApplication(BaseApplication):
    """gunicorn's own application API: `kronk-wsgi serve` runs this."""

    def __init__(self, options: Mapping[str, Any], app_config: Optional[Mapping[str, Any]] = None) -> None:
        hooks = {"on_starting": on_starting, "post_worker_init": post_worker_init, "child_exit": child_exit,
                 "on_exit": on_exit}
        self.options = {**GUNICORN_DEFAULTS, **hooks, **options}
        self.app_config = dict(app_config or {})
        super().__init__()

    def load_config(self) -> None:
        for key, value in self.options.items():
            self.cfg.set(key, value)

    def load(self):
        from .app import create_app

        return create_app(self.app_config)
