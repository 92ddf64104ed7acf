"""The shipped conf/nginx.conf in front of the server: a real nginx, on loopback.

CI installs nginx (.ci/run sets KRONK_TEST_REQUIRE_NGINX); elsewhere these tests
are skipped when nginx is not installed.
"""

import os
import re
import shutil
import time
from pathlib import Path

import pytest
import requests

from .conftest import FAULTY, run_server
from kronk_wsgi.testing import balancers
from kronk_wsgi.testing.rawhttp import RawStream

CHAT = "/v1/chat/completions"
HELLO = [{"role": "user", "content": "Hello there"}]
READ_TIMEOUT = 2  # proxy_read_timeout in these tests: shorter than the silent prefill below

if shutil.which("nginx") is None:
    if os.environ.get("KRONK_TEST_REQUIRE_NGINX"):
        raise RuntimeError("nginx is required here (KRONK_TEST_REQUIRE_NGINX) but not installed")
    pytest.skip("nginx is not installed", allow_module_level=True)


def run_nginx(tmp_path: Path, *upstream_ports: int):
    """nginx running conf/nginx.conf as shipped, with a read timeout shorter than the silent prefill below."""
    return balancers.run_nginx(tmp_path, upstream_ports, read_timeout=READ_TIMEOUT)


@pytest.fixture(scope="module")
def proxied(tiny_model, tmp_path_factory):
    """The tiny model behind nginx: 0.1 s per token, a 4 s silent prefill when asked, one place."""
    models = '{"tiny": {"path": "%s", "engine": "%s"}}' % (tiny_model, FAULTY)
    env = {"KRONK_MODELS": models, "KRONK_TEST_STEP_DELAY": "0.1", "KRONK_TEST_PREFILL_DELAY": "0.1",
           "KRONK_KEEPALIVE_INTERVAL": "0.5",
           "KRONK_QUEUE_DEPTH": "1", "KRONK_ADMISSION_TIMEOUT": "1"}
    tmp = tmp_path_factory.mktemp("nginx")
    with run_server(tmp, env) as server, run_nginx(tmp, server.port) as (url, port):
        yield server, url, port


def body(**fields):
    return {"model": "tiny", "messages": HELLO, "stream": True, "logit_bias": {"2": -100}, **fields}


def test_streams_pass_unbuffered(proxied):
    server, url, port = proxied
    stream = RawStream("127.0.0.1", port, CHAT, body(max_tokens=20))
    arrivals = [arrived for arrived, frame in stream.frames() if frame.startswith("data: {")]
    assert stream.ended and len(arrivals) >= 20
    assert arrivals[-1] - arrivals[0] > 1.0  # 0.1 s a token: they came one by one, not all at the end


def test_keepalives_outlast_a_short_proxy_read_timeout(proxied, tmp_path):
    """A silent prefill longer than proxy_read_timeout: the keep-alive comments keep nginx waiting."""
    server, url, port = proxied
    long_prompt = [{"role": "user", "content": "word " * 300}]  # 40 prefill chunks at 0.1 s each
    stream = RawStream("127.0.0.1", port, CHAT, body(messages=long_prompt, max_tokens=3))
    frames = [frame for _, frame in stream.frames()]
    assert stream.ended and frames[-1] == "data: [DONE]"
    assert ": keep-alive" in frames


def test_a_client_gone_through_nginx_frees_the_slot(proxied):
    server, url, port = proxied
    stream = RawStream("127.0.0.1", port, CHAT, body(max_tokens=500))
    next(stream.frames())
    stream.close()
    deadline = time.monotonic() + 30
    while True:  # with one place and a 1 s admission wait, this is a 429 until the slot is free
        reply = requests.post(url + CHAT, json={"model": "tiny", "messages": HELLO, "max_tokens": 2}, timeout=30)
        if reply.status_code == 200:
            break
        assert reply.status_code == 429 and time.monotonic() < deadline
    assert '"outcome": "client_gone"' in server.logs()


def test_429_passes_through_in_the_api_shape(proxied):
    server, url, port = proxied
    holder = RawStream("127.0.0.1", port, CHAT, body(max_tokens=200))
    next(holder.frames())
    refused = requests.post(url + CHAT, json={"model": "tiny", "messages": HELLO, "max_tokens": 2}, timeout=30)
    holder.close()
    assert refused.status_code == 429
    assert refused.json()["error"]["code"] == "model_busy" and refused.headers["Retry-After"]


def test_request_id_is_kept_or_made(proxied):
    server, url, port = proxied
    given = requests.get(url + "/v1/liveness", headers={"X-Request-ID": "client-chosen-42"}, timeout=10)
    assert given.headers["X-Request-ID"] == "client-chosen-42"
    made = requests.get(url + "/v1/liveness", timeout=10)
    assert re.fullmatch(r"[0-9a-f]{32}", made.headers["X-Request-ID"])
    assert '"request_id": "client-chosen-42"' in server.logs()


@pytest.fixture(scope="module")
def two(tiny_model, tmp_path_factory):
    """Two instances behind nginx, one place each and a 1 s admission wait, so a busy one answers 429 soon."""
    models = '{"tiny": {"path": "%s", "engine": "%s"}}' % (tiny_model, FAULTY)
    env = {"KRONK_MODELS": models, "KRONK_TEST_STEP_DELAY": "0.1", "KRONK_QUEUE_DEPTH": "1",
           "KRONK_ADMISSION_TIMEOUT": "1"}
    tmp = tmp_path_factory.mktemp("two")
    with run_server(tmp, env) as a, run_server(tmp, env) as b, run_nginx(tmp, a.port, b.port) as (url, port):
        yield a, b, url, port


def test_a_busy_instances_429_goes_to_the_idle_one(two):
    a, b, url, port = two
    holder = RawStream("127.0.0.1", a.port, CHAT, body(max_tokens=300))  # holds a's one place for 30 s
    next(holder.frames())
    try:
        statuses = [requests.post(url + CHAT, json={"model": "tiny", "messages": HELLO, "max_tokens": 2},
                                  timeout=60).status_code for _ in range(4)]
    finally:
        holder.close()
    assert statuses == [200, 200, 200, 200]


def test_both_busy_is_the_apis_own_429_and_both_serve_right_after(two):
    a, b, url, port = two
    holders = [RawStream("127.0.0.1", s.port, CHAT, body(max_tokens=300)) for s in (a, b)]
    for holder in holders:
        next(holder.frames())
    try:
        refused = requests.post(url + CHAT, json={"model": "tiny", "messages": HELLO, "max_tokens": 2}, timeout=60)
    finally:
        for holder in holders:
            holder.close()
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "model_busy"  # JSON, not nginx's HTML
    assert int(refused.headers["Retry-After"]) >= 1
    deadline = time.monotonic() + 30
    served = []
    while len(served) < 4:  # once the hang-ups are noticed, both serve again: nobody was taken out for 10 s
        reply = requests.post(url + CHAT, json={"model": "tiny", "messages": HELLO, "max_tokens": 2}, timeout=60)
        if reply.status_code == 200:
            served.append(reply)
        assert time.monotonic() < deadline


def test_a_killed_instance_is_skipped(two):  # the last of the module: it leaves one instance
    a, b, url, port = two
    b.proc.kill()  # SIGKILL: no drain, the port simply refuses
    b.proc.wait(timeout=30)
    statuses = [requests.post(url + CHAT, json={"model": "tiny", "messages": HELLO, "max_tokens": 2},
                              timeout=60).status_code for _ in range(6)]
    assert statuses == [200] * 6
