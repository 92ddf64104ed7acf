"""Loads and pulls that take long, through real gunicorn and a local hub that serves slowly: their progress shows,
they stop when every request waiting for them has gone, and they end at load_timeout."""

import json
import os
import socket
import time
from pathlib import Path

import pytest
import requests

from kronk_wsgi.testing import model_row, run_server, wait_until

from .support.hub import FakeHub

REPO = "someone/big-GGUF"
NAME = f"hf.co/{REPO}:Q8_0"
HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture
def slow_hub():
    """25 MB served in 64 KiB pieces 20 ms apart (about 8 s); huggingface-hub reports each 10 MB it reads."""
    with FakeHub() as fake:
        fake.add(REPO, "big.Q8_0.gguf", os.urandom(25 << 20))
        fake.delay = 0.02
        yield fake


def hub_env(fake: FakeHub, tmp_path: Path, **extra) -> dict:
    models = {"local": {"demo": "tiny"}, "far": {"repo_id": REPO, "quant": "Q8_0"}}
    return {"HF_ENDPOINT": fake.url, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_DISABLE_TELEMETRY": "1",
            "KRONK_MODELS": json.dumps(models), "KRONK_DEFAULT_MODEL": "local", **extra}


def leaving_client(server, path: str, body: dict) -> socket.socket:
    """A request sent over a raw socket whose answer is never read: close the socket to leave."""
    sock = socket.create_connection((server.host, server.port), timeout=30)
    payload = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: {server.host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n")
    sock.sendall(head.encode() + payload)
    return sock


def downloaded(tmp_path: Path) -> tuple[int, int]:
    """Bytes in unfinished downloads, and finished blobs, in the hub's cache."""
    blobs = list((tmp_path / "hf").rglob("blobs/*"))
    partial = sum(b.stat().st_size for b in blobs if b.name.endswith(".incomplete"))
    return partial, sum(not b.name.endswith(".incomplete") for b in blobs)


def stays_stopped(tmp_path: Path) -> None:
    """The download does not go on: once what it fetched has stopped growing (five looks 0.1 s apart agree, where a
    live download grows by a piece each 20 ms), it grows no more for 2 s, and it never completes."""
    looks = []
    wait_until(lambda: looks.append(downloaded(tmp_path)) or (len(looks) >= 5 and len(set(looks[-5:])) == 1))
    time.sleep(2.0)  # a window in which nothing may happen
    after = downloaded(tmp_path)
    assert after == looks[-1] and after[1] == 0, (looks[-1], after)


def test_a_load_shows_its_progress_and_stops_when_its_requests_have_gone(slow_hub, tmp_path):
    with run_server(tmp_path, hub_env(slow_hub, tmp_path)) as server:
        first = leaving_client(server, "/v1/chat/completions", {"model": "far", "messages": HI, "max_tokens": 2})
        second = leaving_client(server, "/v1/chat/completions", {"model": "far", "messages": HI, "max_tokens": 2})
        loading = wait_until(lambda: (model_row(server, "far").get("loading") or {}).get("done"))
        assert loading >= 10 << 20 and model_row(server, "far")["loading"]["total"] == 25 << 20
        first.close()  # the one that started the load leaves: it goes on for the other
        wait_until(lambda: (model_row(server, "far").get("loading") or {}).get("done", 0) >= loading + (10 << 20))
        assert not model_row(server, "far")["load_error"]
        second.close()
        error = wait_until(lambda: model_row(server, "far")["load_error"])
        assert "every request waiting for it has gone" in error and "loading" not in model_row(server, "far")
        stays_stopped(tmp_path)
        assert "Traceback" not in server.logs()


def test_a_pull_stops_when_its_client_leaves(slow_hub, tmp_path):
    with run_server(tmp_path, hub_env(slow_hub, tmp_path)) as server:
        pull = requests.post(server.url + "/api/pull", json={"model": NAME}, stream=True, timeout=60)
        lines = pull.iter_lines()
        while json.loads(next(lines)).get("completed", 0) == 0:  # until some of it has arrived
            pass
        pull.close()
        stays_stopped(tmp_path)


def test_loads_and_pulls_end_at_the_load_timeout(slow_hub, tmp_path):
    with run_server(tmp_path, hub_env(slow_hub, tmp_path, KRONK_LOAD_TIMEOUT=2)) as server:
        started = time.monotonic()
        reply = server.post("/v1/chat/completions", {"model": "far", "messages": HI, "max_tokens": 2})
        assert reply.status_code == 503 and reply.json()["error"]["code"] == "model_unavailable"
        assert "load_timeout" in reply.json()["error"]["message"] and time.monotonic() - started < 30
        pulled = requests.post(server.url + "/api/pull", json={"model": NAME, "stream": False}, timeout=60)
        assert pulled.status_code == 500 and "load_timeout" in pulled.json()["error"]
        stays_stopped(tmp_path)
