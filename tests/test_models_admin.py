"""Several models in one server: eviction under a budget, idle unloading, and the admin API, through real gunicorn."""

import json
import os
import threading
import time

import pytest
import requests

from kronk_wsgi.testing import model_row, wait_until
from kronk_wsgi.testing.rawhttp import RawStream

from .conftest import FAULTY, run_server
from .support.hub import FakeHub

HI = [{"role": "user", "content": "hi"}]


def chat(server, model, **extra):
    return server.post("/v1/chat/completions", {"model": model, "messages": HI, "max_tokens": 2, **extra})


def loaded(server, **kwargs) -> set[str]:
    rows = requests.get(server.url + "/admin/models", timeout=10, **kwargs).json()["data"]
    return {row["id"] for row in rows if row["loaded"]}


@pytest.fixture(scope="module")
def budget_of_one(tiny_model, tmp_path_factory):
    """Three models, one loaded at a time; "slow" writes a token every 50 ms."""
    models = {"a": {"path": str(tiny_model)}, "b": {"path": str(tiny_model)},
              "slow": {"path": str(tiny_model), "engine": FAULTY}}
    env = {"KRONK_MODELS": json.dumps(models), "KRONK_DEFAULT_MODEL": "a", "KRONK_MAX_LOADED_MODELS": 1,
           "KRONK_TEST_STEP_DELAY": "0.05"}
    with run_server(tmp_path_factory.mktemp("budget"), env) as server:
        yield server


def test_alternating_models_each_evict_the_last(budget_of_one):
    server = budget_of_one
    for model in ("b", "slow", "a", "b", "a", "slow"):
        reply = chat(server, model)
        assert reply.status_code == 200, reply.text
        assert loaded(server) == {model}
    unloads = [json.loads(line) for line in server.logs().splitlines() if '"model unloaded"' in line]
    assert len(unloads) >= 5 and {u["reason"] for u in unloads} == {"room"}
    metrics = requests.get(server.url + "/metrics", timeout=10).text
    assert 'kronk_model_events_total{event="unloaded_room",model="a"}' in metrics


def test_a_model_with_a_stream_stays_and_another_model_waits_for_its_requests(budget_of_one):
    server = budget_of_one
    assert chat(server, "slow").status_code == 200
    body = {"model": "slow", "messages": HI, "max_tokens": 60, "stream": True, "logit_bias": {"2": -100}}
    stream = RawStream(server.host, server.port, "/v1/chat/completions", body)
    frames = stream.frames()
    next(frames)  # committed: the stream holds "slow"
    replies = {}

    def ask(key, model, **extra):
        reply = chat(server, model, **extra)
        replies[key] = (reply, time.monotonic())

    queued = threading.Thread(target=ask, args=("slow", "slow"), kwargs={"max_tokens": 3})
    queued.start()  # waits for the slot the stream holds
    other = threading.Thread(target=ask, args=("b", "b"))
    other.start()  # waits for "slow" to be free, then takes its place
    wait_until(lambda: model_row(server, "slow")["queued"] == 1)  # the queued request waits for the stream's slot
    assert loaded(server) == {"slow"} and "b" not in replies
    rest = [frame for _, frame in frames]
    assert rest[-1] == "data: [DONE]"
    queued.join(timeout=60)
    other.join(timeout=60)
    assert replies["slow"][0].status_code == 200 and replies["b"][0].status_code == 200, replies["b"][0].text
    assert replies["slow"][1] <= replies["b"][1]
    assert loaded(server) == {"b"}


def test_admin_unload_and_a_model_in_use_is_kept(budget_of_one):
    server = budget_of_one
    assert chat(server, "a").status_code == 200
    unloaded = requests.post(server.url + "/admin/models/a/unload", timeout=10)
    assert unloaded.status_code == 200 and unloaded.json() == {"id": "a", "unloaded": True}
    again = requests.post(server.url + "/admin/models/a/unload", timeout=10)
    assert again.status_code == 409 and again.json()["error"]["code"] == "not_loaded"
    assert requests.post(server.url + "/admin/models/zzz/unload", timeout=10).status_code == 404
    body = {"model": "slow", "messages": HI, "max_tokens": 40, "stream": True, "logit_bias": {"2": -100}}
    stream = RawStream(server.host, server.port, "/v1/chat/completions", body)
    frames = stream.frames()
    next(frames)
    busy = requests.post(server.url + "/admin/models/slow/unload", timeout=10)
    assert busy.status_code == 409 and busy.json()["error"]["code"] == "model_in_use"
    slow = model_row(server, "slow")
    assert slow["loaded"] and slow["busy_slots"] == 1 and slow["memory_mb"] >= 0 and slow["idle_seconds"] is None
    stream.close()
    wait_until(lambda: "slow" not in loaded(server))  # as the 409 said: unloaded once its request ended


def test_a_model_larger_than_the_memory_budget_is_a_400(tiny_model, tmp_path):
    # The tiny model's KV cache grows with the context: at 32768 tokens it alone passes 8 MB.
    models = {"small": {"path": str(tiny_model)}, "huge": {"path": str(tiny_model), "context_length": 32768}}
    env = {"KRONK_MODELS": json.dumps(models), "KRONK_DEFAULT_MODEL": "small", "KRONK_MAX_MEMORY_MB": 8}
    with run_server(tmp_path, env) as server:
        refused = chat(server, "huge")
        error = refused.json()["error"]
        assert refused.status_code == 400 and error["code"] == "model_too_large" and "max_memory_mb" in error["message"]
        assert chat(server, "small").status_code == 200


def test_idle_models_unload_but_the_default_stays(tiny_model, tmp_path):
    env = {"KRONK_MODELS": f"a={tiny_model},b={tiny_model}", "KRONK_DEFAULT_MODEL": "a", "KRONK_IDLE_UNLOAD_SECONDS": 1}
    with run_server(tmp_path, env) as server:
        assert chat(server, "b").status_code == 200
        wait_until(lambda: loaded(server) == {"a"} and '"reason": "idle"' in server.logs())  # the log line follows the unload
        assert requests.get(server.url + "/v1/readiness", timeout=10).status_code == 200
        assert chat(server, "b").status_code == 200  # loads again on use


def test_admin_keys_are_not_inference_keys(tiny_model, tmp_path):
    env = {"KRONK_MODELS": f"a={tiny_model}", "KRONK_API_KEYS": "user-key"}
    with run_server(tmp_path, env) as server:
        closed = requests.get(server.url + "/admin/models", headers={"Authorization": "Bearer user-key"}, timeout=10)
        assert closed.status_code == 403 and closed.json()["error"]["code"] == "admin_closed"
    env["KRONK_ADMIN_KEYS"] = "admin-key"
    with run_server(tmp_path, env) as server:
        as_user = requests.get(server.url + "/admin/models", headers={"Authorization": "Bearer user-key"}, timeout=10)
        assert as_user.status_code == 401
        as_admin = requests.get(server.url + "/admin/models", headers={"Authorization": "Bearer admin-key"}, timeout=10)
        assert as_admin.status_code == 200 and as_admin.json()["data"][0]["id"] == "a"
        assert chat(server, "a", ).status_code == 401  # no key
        infer = server.post("/v1/chat/completions", {"model": "a", "messages": HI, "max_tokens": 2},
                            headers={"Authorization": "Bearer admin-key"})
        assert infer.status_code == 401  # the admin key is not an inference key
        unknown = requests.get(server.url + "/admin/nothing", headers={"Authorization": "Bearer admin-key"}, timeout=10)
        assert unknown.status_code == 404 and unknown.json()["error"]


def test_pull_streams_its_progress(tiny_model, tmp_path):
    with FakeHub() as hub:
        data = os.urandom(31 << 20)  # huggingface-hub reports progress every 10 MiB
        hub.add("someone/tiny-GGUF", "big.Q8_0.gguf", data)
        hub.add("someone/tiny-GGUF", "bad.Q2_K.gguf", b"GGUF" + b"\0" * 2_000_000)
        hub.corrupt.add("bad.Q2_K.gguf")
        hub.delay = 0.005  # a piece of 64 KiB every 5 ms: about 2.5 s in all
        env = {"KRONK_MODELS": f"a={tiny_model}", "HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf")}
        with run_server(tmp_path, env) as server:
            stream = RawStream(server.host, server.port, "/admin/pull", {"repo_id": "someone/tiny-GGUF", "file": "Q8_0"})
            events = [(frame.split("\n")[0].removeprefix("event: "), json.loads(frame.split("data: ", 1)[1]))
                      for _, frame in stream.frames()]
            kinds = [kind for kind, _ in events]
            assert kinds[0] == "start" and kinds[-1] == "done" and kinds.count("progress") >= 3
            progress = [data for kind, data in events if kind == "progress"]
            assert progress[-1]["total"] == len(data)
            assert all(a["done"] <= b["done"] for a, b in zip(progress, progress[1:]))
            assert events[-1][1]["size"] == len(data)
            corrupt = RawStream(server.host, server.port, "/admin/pull", {"repo_id": "someone/tiny-GGUF", "file": "Q2_K"})
            frames = [f for _, f in corrupt.frames()]
            last_kind, last = frames[-1].split("\n")[0], json.loads(frames[-1].split("data: ", 1)[1])
            assert last_kind == "event: error" and "SHA-256" in last["error"]["message"]
            unknown = server.post("/admin/pull", {"repo_id": "someone/tiny-GGUF", "file": "Q5_K_M"})
            assert unknown.status_code == 400 and "no GGUF file" in unknown.json()["error"]["message"]
            named = server.post("/admin/pull", {"repo_id": "someone/tiny-GGUF", "file": "missing.Q8_0.gguf"})
            assert named.status_code == 400 and "big.Q8_0.gguf" in named.json()["error"]["message"]  # before the commit
