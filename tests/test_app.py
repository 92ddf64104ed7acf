"""Configuration layers, the embedded demo model, embedding in a host app, hub cache, startup checks."""

import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import gevent
import pytest
import requests
from flask import Flask

from kronk_wsgi import Kronk
from kronk_wsgi.catalog import model_file
from kronk_wsgi.config import ConfigError, ModelSpec, Settings, read_config, settings_from_config

from .conftest import ROOT, free_port, run_server


def test_config_layers(tmp_path):
    toml = tmp_path / "kronk.toml"
    toml.write_text(
        'default_model = "medium"\nparallel = 2\nkeepalive_interval = 0.5\nqueue_depth = 3\n'
        '[models.medium]\npath = "/data/medium.gguf"\ncontext_length = 1024\n'
        '[models.small]\npath = "/data/small.gguf"\n'
    )
    env = {"KRONK_CONFIG": str(toml), "KRONK_PARALLEL": "3", "KRONK_KEEPALIVE_INTERVAL": "0.25"}
    settings = settings_from_config(read_config(environ=env, flags={"parallel": 4}))
    assert settings.parallel == 4  # flag > env > file
    assert settings.keepalive_interval == 0.25  # env > file
    assert settings.queue_depth == 3  # file > default
    assert settings.admission_timeout == 180 and settings.request_timeout == 3600  # defaults
    assert settings.models["medium"].context_length == 1024
    assert settings.default_model == "medium"


@pytest.mark.parametrize("env,message", [
    ({"KRONK_PARALLEL": "0"}, "parallel"),
    ({"KRONK_MODELS": "broken"}, "id=path"),
    ({"KRONK_MODELS": "a=/x,b=/y"}, "default_model"),
    ({"KRONK_MODELS": "a=/x", "KRONK_DEFAULT_MODEL": "b"}, "default_model"),
    ({"KRONK_MODELS": '{"a": {"path": "/x", "repo_id": "o/r", "filename": "f"}}'}, "exactly one"),
    ({"KRONK_MODELS": '{"a": {"engine": "llama.cpp"}}'}, r"exactly one of .* \(or none, for engine \"grpc\"\)"),
])
def test_bad_config_is_refused_clearly(env, message):
    with pytest.raises(ConfigError, match=message):
        settings_from_config(read_config(environ=env))


def test_a_model_on_grpc_workers_may_name_no_file():
    settings = settings_from_config(read_config(environ={
        "KRONK_MODELS": '{"a": {"engine": "grpc", "engine_options": {"workers": ["grpc://h1:30000"]}}}'}))
    assert settings.models["a"].describe() == "gRPC workers grpc://h1:30000"


def test_unknown_toml_key(tmp_path):
    toml = tmp_path / "bad.toml"
    toml.write_text("paralel = 2\n")
    with pytest.raises(ConfigError, match="paralel"):
        read_config(environ={"KRONK_CONFIG": str(toml)})


def test_oversubscription_is_refused(tmp_path, tiny_model):
    env = {"KRONK_MODELS": f"tiny={tiny_model}", "KRONK_THREADS": "64", "PYTHONPATH": str(ROOT), "PATH": ""}
    result = subprocess.run(
        [sys.executable, "-m", "kronk_wsgi.cli", "serve", "--bind", "127.0.0.1:0"],
        env=env, capture_output=True, text=True, timeout=60, cwd=tmp_path,
    )
    assert result.returncode != 0
    assert "compute threads" in result.stderr and "cores" in result.stderr


def test_compute_threads_follow_how_the_engine_decodes(monkeypatch):
    """ctransformers slots decode at once, each on its own threads; a llama.cpp model's slots share each call."""
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    four_slots = Settings(parallel=4)
    assert four_slots.threads_per_call(batched=False) == 1 and four_slots.threads_per_call(batched=True) == 4
    two_threads = Settings(parallel=4, threads=2)
    two_threads.check_cores(batched=True)  # one call at a time: 2 threads
    with pytest.raises(ConfigError, match=r"parallel \(4\) x threads \(2\) = 8 compute threads"):
        two_threads.check_cores(batched=False)
    with pytest.raises(ConfigError, match=r"workers \(3\) x threads \(2\) = 6 compute threads"):
        Settings(workers=3, threads=2).check_cores(batched=True)


def test_a_ctransformers_model_with_more_slot_threads_than_cores_fails_to_load(tmp_path, tiny_model):
    """One-thread ctransformers slots, one more than the cores: the worker refuses to load the model, and says why."""
    parallel = (os.cpu_count() or 1) + 1
    env = {"KRONK_MODELS": f"tiny={tiny_model}", "KRONK_PARALLEL": parallel, "KRONK_THREADS": 1}
    with run_server(tmp_path, env, ready="/v1/liveness") as server:
        deadline = time.monotonic() + 60
        while (ready := requests.get(server.url + "/v1/readiness", timeout=10).json())["status"] == "loading":
            assert time.monotonic() < deadline
            time.sleep(0.2)
        assert ready["status"] == "failed"
        assert f"x parallel ({parallel}) x threads (1) = {parallel} compute threads" in ready["error"]
        reply = server.post("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]})
        assert reply.status_code == 503 and "compute threads" in reply.json()["error"]["message"]


def test_default_demo_model_without_configuration(tmp_path):
    """`kronk-wsgi serve` with no model and no default_pull configured serves the generated demo model."""
    with run_server(tmp_path, {"KRONK_DEFAULT_PULL": ""}) as server:
        models = requests.get(server.url + "/v1/models", timeout=10).json()["data"]
        assert [m["id"] for m in models] == ["kronk-demo"]
        reply = server.post("/v1/chat/completions", {"model": "kronk-demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
        assert reply.status_code == 200
    assert list((tmp_path / "cache" / "kronk_wsgi").glob("kronk-demo-tiny-*.gguf"))


def test_request_timeout_is_an_in_band_error(tmp_path, tiny_model):
    models = '{"tiny": {"path": "%s", "engine": "kronk_wsgi.testing.faulty:KIND"}}' % tiny_model
    env = {"KRONK_MODELS": models, "KRONK_TEST_STEP_DELAY": "0.3", "KRONK_REQUEST_TIMEOUT": "1"}
    with run_server(tmp_path, env) as server:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 100, "logit_bias": {"2": -100}}
        response = requests.post(server.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=30)
        assert response.status_code == 200
        frames = [f for f in response.text.split("\n\n") if f]
        assert '"code":"timeout"' in frames[-1] and "[DONE]" not in response.text
        whole = server.post("/v1/chat/completions", body)
        assert whole.status_code == 504
        assert '"outcome": "timeout"' in server.logs()


def test_embedding_in_a_host_app(tiny_model):
    """Kronk(app) in an existing Flask app: its routes and error pages stay its own."""
    host = Flask("host")

    @host.get("/")
    def index():
        return "host page"

    host.config["KRONK_MODELS"] = {"tiny": {"path": str(tiny_model)}}
    Kronk(host)
    assert host.config["KRONK_QUEUE_DEPTH"] == 2  # effective defaults are visible
    client = host.test_client()
    assert client.get("/").text == "host page"
    assert "<html" in client.get("/missing").text.lower()  # the host keeps its own 404 page
    assert client.get("/v1/missing").json["error"]["code"] == "unknown_url"
    reply = client.post("/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert reply.status_code == 200 and reply.json["usage"]["completion_tokens"] >= 1
    other = Flask("other")
    other.config["KRONK_MODELS"] = {"tiny": {"path": str(tiny_model)}, "other": {"path": str(tiny_model)}}
    other.config["KRONK_DEFAULT_MODEL"] = "other"
    Kronk(other)
    assert other.extensions["kronk"] is not host.extensions["kronk"]  # two apps, two pools


def test_hub_model_from_local_cache(tmp_path, tiny_model, monkeypatch):
    """A hub-configured model resolves from the local cache with HF_HUB_OFFLINE=1."""
    cache = tmp_path / "hub"
    repo = cache / "models--kronk--tiny-demo"
    commit = "0" * 40
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (snapshot / "tiny.gguf").write_bytes(tiny_model.read_bytes())
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    import huggingface_hub.constants as hub_constants

    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    path = model_file(ModelSpec(repo_id="kronk/tiny-demo", filename="tiny.gguf"))
    assert path.read_bytes() == tiny_model.read_bytes()
    from kronk_wsgi.engine.base import EngineError

    with pytest.raises(EngineError, match="kronk/absent"):
        model_file(ModelSpec(repo_id="kronk/absent", filename="x.gguf"))


def test_concurrent_first_requests_load_once(tmp_path, tiny_model):
    env = {"KRONK_MODELS": f"a={tiny_model},b={tiny_model}", "KRONK_DEFAULT_MODEL": "a", "KRONK_QUEUE_DEPTH": 4}
    with run_server(tmp_path, env) as server:
        assert requests.get(server.url + "/v1/models/b", timeout=10).json()["created"] == 0  # not loaded yet
        body = {"model": "b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        with ThreadPoolExecutor(4) as pool:
            statuses = list(pool.map(lambda _: server.post("/v1/chat/completions", body).status_code, range(4)))
        assert statuses == [200] * 4
        loads = [line for line in server.logs().splitlines() if '"model loaded"' in line and '"model": "b"' in line]
        assert len(loads) == 1


def test_readiness_reports_a_default_model_that_cannot_load(tmp_path):
    app = Flask("broken")
    app.config["KRONK_MODELS"] = {"gone": {"path": str(tmp_path / "missing.gguf")}}
    Kronk(app)
    assert not app.extensions["kronk"].started  # init_app registers; the first request starts the load
    deadline = time.monotonic() + 60
    while (response := app.test_client().get("/v1/readiness")).json["status"] == "loading":
        assert time.monotonic() < deadline
        gevent.sleep(0.05)
    assert response.status_code == 503
    assert response.json["status"] == "failed" and "not found" in response.json["error"]
    chat = app.test_client().post("/v1/chat/completions", json={"model": "gone", "messages": [{"role": "user", "content": "x"}]})
    assert chat.status_code == 503 and chat.json["error"]["code"] == "model_unavailable"
    assert str(tmp_path) not in chat.json["error"]["message"]  # no server paths for inference clients


def test_gunicorn_config_file(tmp_path, tiny_model):
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "KRONK_MODELS": f"tiny={tiny_model}", "KRONK_THREADS": "1",
           "KRONK_BIND": f"127.0.0.1:{port}"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "gunicorn", "-c", str(ROOT / "conf" / "gunicorn.conf.py"), "kronk_wsgi:create_app()"],
        env=env, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if requests.get(f"http://127.0.0.1:{port}/v1/readiness", timeout=1).status_code == 200:
                    break
            except (requests.ConnectionError, requests.Timeout):  # not listening yet, or still booting
                time.sleep(0.1)
        live = requests.get(f"http://127.0.0.1:{port}/v1/liveness", timeout=5).json()
        assert live["status"] == "ok" and live["pid"] != proc.pid  # answered by a worker
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=15)
    assert "Using worker: kronk_wsgi.worker.Worker" in err  # the gevent worker, answering its errors in JSON
