"""What a hostile or careless client or operator could do: each case reproduced against real gunicorn."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import requests
import yaml
from flask import Flask

from kronk_wsgi import Kronk
from kronk_wsgi.config import ConfigError, read_config, settings_from_config
from kronk_wsgi.server import graceful_timeout

from .conftest import ROOT, metric, run_server
from kronk_wsgi.testing.rawhttp import RawStream
from kronk_wsgi.testing.storm import storm

CHAT = "/v1/chat/completions"
HI = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("env", [{"KRONK_API_KEYS": ","}, {"KRONK_API_KEYS": "key, "}, {"KRONK_API_KEYS": " "},
                                 {"KRONK_API_KEYS": '["key", ""]'}])
def test_empty_api_keys_are_a_configuration_error(env):
    with pytest.raises(ConfigError, match="api_keys"):
        settings_from_config(read_config(environ=env))


def test_empty_api_key_in_the_config_file_stops_the_server(tmp_path, tiny_model):
    toml = tmp_path / "kronk.toml"
    toml.write_text('api_keys = ["key", ""]\n')
    env = {"KRONK_CONFIG": str(toml), "KRONK_MODELS": f"tiny={tiny_model}", "PYTHONPATH": str(ROOT), "PATH": ""}
    result = subprocess.run([sys.executable, "-m", "kronk_wsgi.cli", "serve", "--bind", "127.0.0.1:0"],
                            env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "api_keys" in result.stderr


def test_unknown_model_ids_do_not_grow_the_metrics(server):
    for i in range(3):
        response = server.post(CHAT, {"model": f"{i}" + "m" * 10_000, "messages": HI})
        assert response.status_code == 404 and len(response.text) < 1000
    metrics = requests.get(server.url + "/metrics", timeout=10).text
    assert "m" * 100 not in metrics
    assert len(metrics) < 200_000


@pytest.mark.parametrize("stream", [False, True])
def test_negative_seed_is_a_seed(server, stream):
    body = {"model": "tiny", "messages": HI, "max_tokens": 4, "seed": -5, "stream": stream}
    first, again = server.post(CHAT, body), server.post(CHAT, body)
    assert first.status_code == 200 and '"error"' not in first.text
    if not stream:
        assert first.json()["choices"][0]["message"] == again.json()["choices"][0]["message"]


def test_deeply_nested_json_is_a_400(server):
    data = b'{"model": "tiny", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    response = requests.post(server.url + CHAT, data=data, headers={"Content-Type": "application/json"}, timeout=30)
    assert response.status_code == 400 and "nested" in response.json()["error"]["message"]


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_numbers_are_named(server, constant):
    data = f'{{"model": "tiny", "messages": [{{"role": "user", "content": "hi"}}], "temperature": {constant}}}'
    response = requests.post(server.url + CHAT, data=data, headers={"Content-Type": "application/json"}, timeout=30)
    assert response.status_code == 400
    assert constant in response.json()["error"]["message"]


@pytest.fixture(scope="module")
def small_bodies(tiny_model, tmp_path_factory):
    env = {"KRONK_MODELS": f"tiny={tiny_model}", "KRONK_MAX_BODY_BYTES": "4096"}
    with run_server(tmp_path_factory.mktemp("small"), env) as server:
        yield server


def test_chunked_body_over_the_limit_is_413(small_bodies):
    payload = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "x" * 10_000}]}).encode()
    with socket.create_connection((small_bodies.host, small_bodies.port), timeout=30) as sock:
        head = (f"POST {CHAT} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                "Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n")
        sock.sendall(head.encode() + f"{len(payload):x}\r\n".encode() + payload + b"\r\n0\r\n\r\n")
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
    assert b"request_too_large" in reply


def test_no_warning_at_start(server):
    assert "Warning" not in server.logs()


def test_nginx_conf_keeps_the_clients_request_id():
    conf = (ROOT / "conf" / "nginx.conf").read_text()
    assert "proxy_set_header X-Request-ID $request_id;" not in conf
    assert "$http_x_request_id" in conf


def test_the_kubernetes_manifest_probes_the_server_and_waits_for_its_drain():
    deployment, service = yaml.safe_load_all((ROOT / "conf" / "kubernetes.yaml").read_text())
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/v1/readiness"
    assert container["livenessProbe"]["httpGet"]["path"] == "/v1/liveness"
    drain = float(next(e["value"] for e in container["env"] if e["name"] == "KRONK_DRAIN_TIMEOUT"))
    assert pod["terminationGracePeriodSeconds"] > graceful_timeout(drain)  # gunicorn is never cut short
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]


def host_app(tiny_model) -> Flask:
    host = Flask("host")
    host.config["KRONK_MODELS"] = {"tiny": {"path": str(tiny_model)}}

    @host.errorhandler(404)
    def not_found(exc):
        return "host 404 page", 404

    @host.errorhandler(Exception)
    def broken(exc):
        return "host 500 page", 500

    @host.get("/boom")
    def boom():
        raise RuntimeError("host bug")

    return host


def test_a_host_apps_error_pages_stay_its_own(tiny_model):
    host = host_app(tiny_model)
    Kronk(host)
    client = host.test_client()
    assert client.get("/nowhere").text == "host 404 page"
    assert client.get("/boom").text == "host 500 page"
    assert client.get("/v1/nowhere").json["error"]["code"] == "unknown_url"
    assert client.post("/v1/chat/completions", json={"model": "nope", "messages": HI}).json["error"]["code"] == "model_not_found"


def test_second_init_app_is_refused(tiny_model):
    host = host_app(tiny_model)
    Kronk(host)
    with pytest.raises(RuntimeError, match="already"):
        Kronk(host)


def test_url_prefix(tiny_model):
    host = host_app(tiny_model)
    Kronk(host, url_prefix="/llm")
    client = host.test_client()
    assert client.get("/llm/v1/liveness").json["status"] == "ok"
    assert client.get("/v1/liveness").text == "host 404 page"
    assert client.get("/llm/v1/nowhere").json["error"]["code"] == "unknown_url"
    messages = client.post("/llm/v1/messages", json={"model": "nope", "max_tokens": 1, "messages": HI})
    assert messages.json["type"] == "error" and messages.json["error"]["type"] == "not_found_error"


def test_eight_maximal_bodies_do_not_stall_the_worker(tiny_model, tmp_path):
    """Bodies parsed, validated and rendered off the event loop: a stream and liveness go on, no worker dies."""
    models = {"slow": {"path": str(tiny_model), "engine": "kronk_wsgi.testing.faulty:KIND"},
              "tiny": {"path": str(tiny_model)}}
    env = {"KRONK_MODELS": json.dumps(models), "KRONK_DEFAULT_MODEL": "slow", "KRONK_TEST_STEP_DELAY": "0.05"}
    with run_server(tmp_path, env) as server:
        body = {"model": "slow", "messages": HI, "max_tokens": 200, "stream": True, "logit_bias": {"2": -100}}
        result = storm(server.url, server.host, server.port, body)
        assert all(status in (400, 413) for status in result["statuses"]), result["statuses"]
        assert result["frames"][-1] == "data: [DONE]"
        assert result["largest_stream_gap_s"] < 5 and result["liveness_max_s"] < 5  # generous: the goal is 1 s
        assert "WORKER TIMEOUT" not in server.logs()


def test_a_body_that_never_arrives_gets_408_and_the_connection_closed(tiny_model, tmp_path):
    env = {"KRONK_MODELS": f"tiny={tiny_model}", "KRONK_BODY_TIMEOUT": "1"}
    with run_server(tmp_path, env) as server:
        stalled = []
        for _ in range(3):
            sock = socket.create_connection((server.host, server.port), timeout=60)
            sock.sendall(f"POST {CHAT} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                         "Content-Length: 100000\r\n\r\n{".encode())
            stalled.append(sock)
        for sock in stalled:
            reply = b""
            while chunk := sock.recv(65536):  # returns b"" once the server hangs up
                reply += chunk
            sock.close()
            assert reply.startswith(b"HTTP/1.1 408") and b"request_timeout" in reply
        assert server.post(CHAT, {"model": "tiny", "messages": HI, "max_tokens": 2}).status_code == 200


@pytest.fixture
def draining(tiny_model, tmp_path):
    models = json.dumps({"tiny": {"path": str(tiny_model), "engine": "kronk_wsgi.testing.faulty:KIND"}})
    env = {"KRONK_MODELS": models, "KRONK_TEST_STEP_DELAY": "0.1", "KRONK_DRAIN_TIMEOUT": "4", "KRONK_PARALLEL": "2",
           "KRONK_THREADS": "1"}
    with run_server(tmp_path, env) as server:
        yield server


def test_shutdown_drains_then_ends_streams_in_band(draining):
    """On SIGTERM: readiness 503 at once, nothing new admitted, running streams end with an in-band error."""
    kept = requests.Session()
    assert kept.get(draining.url + "/v1/readiness", timeout=10).status_code == 200  # a kept-alive connection
    long = {"model": "tiny", "messages": HI, "max_tokens": 500, "stream": True, "logit_bias": {"2": -100}}
    short = {**long, "max_tokens": 5}
    cut, finished = RawStream(draining.host, draining.port, CHAT, long), RawStream(draining.host, draining.port, CHAT, short)
    assert cut.status == finished.status == 200
    draining.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 30
    while kept.get(draining.url + "/v1/readiness", timeout=10).status_code != 503:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    refused = kept.post(draining.url + CHAT, json={"model": "tiny", "messages": HI, "max_tokens": 2}, timeout=10)
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
    assert [f for _, f in finished.frames()][-1] == "data: [DONE]"  # done before the drain deadline
    frames = [f for _, f in cut.frames()]  # ends at the drain deadline, with the body properly ended
    assert cut.ended and finished.ended  # each chunked body properly ended, not a bare EOF
    assert '"code":"shutting_down"' not in frames[-1] and '"code":"shutdown"' in frames[-1]
    assert "[DONE]" not in "".join(frames)
    draining.proc.wait(timeout=60)
    outcomes = {entry["outcome"] for entry in draining.completed() if entry["route"] == CHAT}
    assert outcomes == {"ok", "shutdown"}


def liveness_count(server) -> float:
    text = requests.get(server.url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("kronk_requests_total{") and 'route="/v1/liveness"' in line)


def test_metrics_report_every_worker(tiny_model, tmp_path):
    env = {"KRONK_MODELS": f"tiny={tiny_model}", "KRONK_THREADS": "1"}
    with run_server(tmp_path, env, args=("--workers", "2")) as server:
        pids, asked = set(), 0
        deadline = time.monotonic() + 60
        while len(pids) < 2:  # separate connections, until both workers have answered
            pids.add(requests.get(server.url + "/v1/liveness", timeout=10).json()["pid"])
            asked += 1
            assert time.monotonic() < deadline
        for _ in range(4):  # whichever worker answers, it counts every worker's requests
            deadline = time.monotonic() + 30  # a request is counted when its response closes: poll
            while (counted := liveness_count(server)) != asked:
                assert counted < asked and time.monotonic() < deadline



@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_stops_reading_is_hung_up_on(tiny_model, tmp_path, stream):
    models = json.dumps({"tiny": {"path": str(tiny_model), "engine": "kronk_wsgi.testing.faulty:KIND"}})
    env = {"KRONK_MODELS": models, "KRONK_TEST_NO_EOS": 1, "KRONK_WRITE_TIMEOUT": 1}
    with run_server(tmp_path, env) as server:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window, never read
        sock.connect((server.host, server.port))
        # About 8 MB of answer: more than the server's send buffer (4 MB at most) and the client's window
        body = json.dumps({"model": "tiny", "messages": HI, "max_tokens": 400, "n": 16, "logprobs": True,
                           "top_logprobs": 20, "stream": stream}).encode()
        sock.sendall(f"POST {CHAT} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        deadline = time.monotonic() + 120
        while '"outcome": "write_timeout"' not in server.logs():
            assert time.monotonic() < deadline, server.logs()[-2000:]
            time.sleep(0.2)
        assert "client stopped reading" in server.logs() and "Traceback" not in server.logs()
        sock.close()
        assert server.post(CHAT, {"model": "tiny", "messages": HI, "max_tokens": 2}).status_code == 200
        assert metric(server, "kronk_active_generations", model="tiny") == 0


def raw_exchange(server, request: bytes) -> bytes:
    """Send bytes as they are; everything the server answers until it closes."""
    with socket.create_connection((server.host, server.port), timeout=30) as sock:
        sock.sendall(request)
        answer = b""
        while data := sock.recv(65536):
            answer += data
    return answer


@pytest.mark.parametrize("request_bytes, status", [
    (b"GET /v1/" + b"a" * 5000 + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n", 414),
    (b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n" + b"X-Big: " + b"b" * 9000 + b"\r\n\r\n", 431),
    (b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nBad Header: x\r\n\r\n", 400),
    (b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nExpect: 100-wait\r\n\r\n", 417),
])
def test_what_gunicorn_refuses_is_answered_in_json(server, request_bytes, status):
    """Requests refused before the app sees them get the API's JSON error and one log line: no HTML page."""
    head, _, body = raw_exchange(server, request_bytes).partition(b"\r\n\r\n")
    assert head.split(b"\r\n")[0].split()[1] == str(status).encode()
    assert b"Content-Type: application/json" in head
    error = json.loads(body)["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    deadline = time.monotonic() + 30
    while f'"status": {status}' not in server.logs():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert "<html" not in server.logs() and "Traceback" not in server.logs()


@pytest.mark.parametrize("path", ["/admin//models", "/v1//models", "/v1/chat//completions"])
def test_doubled_slashes_are_not_redirected_by_the_host_header(server, path):
    """Not a 308 to a URL built from the Host the client chose: not an API path. (gunicorn itself reads a
    leading ``//admin`` as ``/admin``, which the admin keys guard like any other.)"""
    answer = requests.get(server.url + path, headers={"Host": "localhost"}, allow_redirects=False, timeout=10)
    assert answer.status_code == 404 and "Location" not in answer.headers
    assert answer.json()["error"]["code"] == "unknown_url"


def test_the_client_behind_trusted_proxy_hops_is_logged(tiny_model, tmp_path, server):
    forged = {"X-Forwarded-For": "198.51.100.9, 203.0.113.7"}
    requests.get(server.url + "/v1/models", headers=forged, timeout=10)
    env = {"KRONK_MODELS": f"tiny={tiny_model}", "KRONK_PROXY_HOPS": 1}
    with run_server(tmp_path, env) as behind_proxy:
        requests.get(behind_proxy.url + "/v1/models", headers=forged, timeout=10)
        assert '"client": "203.0.113.7"' in behind_proxy.logs()  # one hop: the address the proxy appended
    assert '"client": "203.0.113.7"' not in server.logs()  # no hops trusted: a client cannot name itself


@pytest.mark.parametrize("sig, outcome", [(signal.SIGABRT, "worker_aborted"), (signal.SIGQUIT, "worker_stopped")])
def test_streams_a_dying_worker_cuts_are_logged(tiny_model, tmp_path, sig, outcome):
    """gunicorn's timeout (SIGABRT to the worker) and a quick shutdown cut the running streams: each is logged."""
    models = json.dumps({"tiny": {"path": str(tiny_model), "engine": "kronk_wsgi.testing.faulty:KIND"}})
    env = {"KRONK_MODELS": models, "KRONK_TEST_STEP_DELAY": "0.1", "KRONK_TEST_NO_EOS": 1}
    with run_server(tmp_path, env) as server:
        pid = requests.get(server.url + "/v1/liveness", timeout=10).json()["pid"]
        stream = RawStream(server.host, server.port, CHAT, {"model": "tiny", "messages": HI, "max_tokens": 2000,
                                                             "stream": True})
        assert stream.status == 200 and next(stream.frames())
        os.kill(pid, sig)
        deadline = time.monotonic() + 30
        while f'"outcome": "{outcome}"' not in server.logs():
            assert time.monotonic() < deadline, server.logs()[-2000:]
            time.sleep(0.05)
        cut = [entry for entry in server.completed() if entry["outcome"] == outcome]
        assert [(entry["route"], entry["status"]) for entry in cut] == [(CHAT, 200)]


def test_ctrl_c_stops_the_server_at_once_without_a_traceback(tiny_model, tmp_path):
    """A terminal's Ctrl-C reaches the master and its workers alike: the worker stops, its main greenlet ending
    (gunicorn's gevent worker ended a greenlet of its own with SystemExit, which gevent printed), or at once when
    the master's signal follows."""
    with run_server(tmp_path, {"KRONK_MODELS": f"tiny={tiny_model}"}) as server:
        worker = requests.get(server.url + "/v1/liveness", timeout=10).json()["pid"]
        for pid in (server.proc.pid, worker):
            os.kill(pid, signal.SIGINT)
        assert server.proc.wait(timeout=30) == 0
        assert "Shutting down: Master" in server.logs() and "Traceback" not in server.logs(), server.logs()[-3000:]
