"""A hostile client, round two: input that made 500s or stalled the worker, failures that never ended, budgets
that did not hold, and cross-site requests. Each test failed on the code before its fix."""

import json
import math
import os
import socket
import time

import gevent
import pytest
import requests

from kronk_wsgi import catalog
from kronk_wsgi.testing import run_server
from kronk_wsgi.config import ModelSpec, Settings
from kronk_wsgi.describe import footprint
from kronk_wsgi.metrics import Metrics
from kronk_wsgi.serving import pool as pool_module
from kronk_wsgi.serving.pool import ModelPool, ModelUnavailable, NoRoom

from .support.liveness import liveness_during


HI = [{"role": "user", "content": "hi"}]
CHAT = "/v1/chat/completions"


def json_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


def nested(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


@pytest.mark.parametrize("body, param", [
    ({"messages": [{"role": "user", "content": "\ud800"}]}, "messages[0].content"),
    ({"messages": HI, "metadata": {"\udc00": "x"}}, "metadata"),
    ({"messages": HI, "stream": True, "stop": ["\ud83d"]}, "stop[0]"),
    ({"messages": HI, "logit_bias": {"²": 1}}, "logit_bias"),
    ({"messages": HI, "logit_bias": {"٣": 1}}, "logit_bias"),
    ({"messages": HI, "response_format": json_format(nested(100))}, "response_format"),
    ({"messages": HI, "response_format": json_format({"type": "integer", "maximum": 2**64})}, "response_format"),
    ({"messages": HI, "response_format": json_format({"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}})},
     "response_format"),
    ({"messages": HI, "response_format": json_format({"type": "string", "pattern": "(a|ab)" * 400})},
     "response_format"),
], ids=["lone surrogate", "surrogate key", "surrogate in a stream", "superscript digit", "arabic digit",
        "100 deep", "2^64", "$ref cycle", "long pattern"])
def test_input_that_made_500s_is_a_400_naming_the_field(server, body, param):
    reply = requests.post(server.url + CHAT, timeout=60, json={"model": "tiny", "max_tokens": 2, **body},
                          headers={"Accept": "text/event-stream"})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param
    assert "Traceback" not in server.logs()


def test_a_recursive_schema_with_a_base_case_is_taken(server):
    tree = {"type": "object", "properties": {"name": {"type": "string"},
                                             "children": {"type": "array", "items": {"$ref": "#"}, "maxItems": 0}},
            "required": ["name", "children"], "additionalProperties": False}
    reply = server.post(CHAT, {"model": "tiny", "messages": HI, "max_tokens": 30, "response_format": json_format(tree)})
    assert reply.status_code == 200


def test_a_schema_of_many_patterns_is_checked_off_the_event_loop(server):
    """Compiling patterns with shared alternation prefixes grows fast: done on the event loop it stalled every
    request of the worker. The liveness probe keeps answering while a request carries them."""
    def pattern(i: int) -> str:  # 20 alternatives sharing a 40-character prefix, each pattern its own
        return "|".join(f"{'a' * 40}{i:04d}{j:03d}" for j in range(20))

    # ~3 s of checking on this machine (1,000 of these patterns take 1.2 s)
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string", "pattern": pattern(i)} for i in range(2500)}}
    body = {"model": "unknown-model", "messages": HI, "response_format": json_format(schema)}
    reply, slowest = liveness_during(server, lambda: requests.post(server.url + CHAT, json=body, timeout=120))
    assert reply.status_code in (400, 404)
    assert slowest < 1.0, slowest


def test_a_cross_site_request_is_refused_and_same_origin_and_curl_are_not(server):
    evil = requests.post(server.url + "/admin/models/tiny/unload", data="{}", timeout=30,
                         headers={"Origin": "https://evil.example", "Content-Type": "text/plain"})
    assert evil.status_code == 403 and evil.json()["error"]["code"] == "origin_not_allowed"
    chat = {"model": "tiny", "messages": HI, "max_tokens": 1}
    own = requests.post(server.url + CHAT, json=chat, headers={"Origin": server.url}, timeout=30)
    assert own.status_code == 200
    assert requests.post(server.url + CHAT, json=chat, timeout=30).status_code == 200
    curl_form = requests.post(server.url + CHAT, data=json.dumps(chat), timeout=30,
                              headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert curl_form.status_code == 400 and "JSON" in curl_form.json()["error"]["message"]


def test_the_console_cannot_be_framed_and_the_log_names_the_client(server):
    page = requests.get(server.url + "/console/", timeout=30)
    assert page.status_code == 200 and "frame-ancestors 'none'" in page.headers["Content-Security-Policy"]
    assert '"client": "127.0.0.1"' in server.logs()


def test_a_rebound_name_is_refused_on_a_loopback_server(server, tiny_model, tmp_path):
    rebound = requests.get(server.url + "/v1/models", headers={"Host": f"attacker.example:{server.port}"}, timeout=30)
    assert rebound.status_code == 400 and rebound.json()["error"]["code"] == "host_not_allowed"
    for name in ("localhost", "127.0.0.1", "[::1]"):
        assert requests.get(server.url + "/v1/models", headers={"Host": f"{name}:{server.port}"}).status_code == 200
    env = {"KRONK_MODELS": f"tiny={tiny_model}", "KRONK_ALLOWED_HOSTS": "llm.example.org"}
    with run_server(tmp_path, env) as named:  # probes answer whatever the Host
        assert requests.get(named.url + "/v1/models", headers={"Host": "llm.example.org"}).status_code == 200
        assert requests.get(named.url + "/v1/models").status_code == 400  # only the names given


@pytest.fixture
def in_process_pool(tiny_model):
    def make(**settings) -> ModelPool:
        models = {"a": ModelSpec(path=str(tiny_model), context_length=8192),
                  "b": ModelSpec(path=str(tiny_model), context_length=8192)}
        return ModelPool(Settings(models=models, default_model="a", threads=1, **settings), Metrics())
    return make


def test_a_load_that_fails_unexpectedly_reaches_every_waiter(in_process_pool, monkeypatch):
    def failing(model_id, spec, progress):
        deadline = time.monotonic() + 30
        while pool._waiting.get("a", 0) < 3 and time.monotonic() < deadline:  # the other requests arrive and wait
            time.sleep(0.01)
        raise OSError("disk full while writing the prepared copy")

    monkeypatch.setattr(pool_module, "load_engine", failing)
    pool = in_process_pool()
    outcomes: list[str] = []

    def ask() -> None:
        try:
            pool.claim("a")
            outcomes.append("loaded")
        except ModelUnavailable as exc:
            outcomes.append(str(exc))

    waiters = [gevent.spawn(ask) for _ in range(4)]
    gevent.joinall(waiters, timeout=90)  # past the load's own 30 s wait for them: it fails by then in any case
    assert len(outcomes) == 4 and all("could not be loaded" in o for o in outcomes), outcomes
    assert "OSError: disk full" in pool.load_errors["a"]


def test_two_first_loads_at_once_keep_the_memory_budget(in_process_pool, tiny_model):
    each = footprint(tiny_model, 8192, 1)
    budget = math.ceil(1.5 * each / 1e6)  # room for one, not two
    pool = in_process_pool(max_memory_mb=budget)
    results: dict[str, str] = {}

    def load(model_id: str) -> None:
        try:
            pool.claim(model_id)
            results[model_id] = "loaded"
        except NoRoom:
            results[model_id] = "no room"

    gevent.joinall([gevent.spawn(load, "a"), gevent.spawn(load, "b")], timeout=60)
    assert sorted(results.values()) == ["loaded", "no room"], results
    assert sum(m.memory for m in pool.loaded()) <= budget * 1e6


def test_the_catalog_loads_through_the_registry(tiny_model):
    engine = catalog.load_engine("a", ModelSpec(path=str(tiny_model), engine_options={"prefill_chunk": 8}))
    assert engine.kind.name == "ctransformers" and engine.new_slots(1, 1)[0].prefill_chunk == 8
    with pytest.raises(ValueError, match="gpu_layers"):
        catalog.check_engine_options(ModelSpec(path=str(tiny_model), engine="ctransformers",
                                               engine_options={"gpu_layers": 3}))
    catalog.check_engine_options(ModelSpec(path=str(tiny_model), engine_options={"gpu_layers": 3}))  # llama.cpp's


def test_a_view_that_fails_after_admission_gives_its_place_back(tiny_model, monkeypatch):
    from kronk_wsgi import create_app
    from kronk_wsgi.api.protocols import openai_chat

    def broken(*args, **kwargs):
        raise RuntimeError("the encoder could not be made")

    monkeypatch.setattr(openai_chat.ChatEncoder, "__init__", broken)
    app = create_app({"KRONK_MODELS": {"tiny": {"path": str(tiny_model)}}, "KRONK_QUEUE_DEPTH": 1,
                      "KRONK_ADMISSION_TIMEOUT": 1})
    client = app.test_client()
    for _ in range(3):  # one place: a leaked lease would make the second a 429
        reply = client.post(CHAT, json={"model": "tiny", "messages": HI, "max_tokens": 1})
        assert reply.status_code == 500 and "Traceback" not in reply.get_data(as_text=True)
    assert app.extensions["kronk"].pool.loaded_model("tiny").scheduler.held_places == 0


def test_a_model_file_changed_under_a_loaded_model_is_loaded_again(tiny_model, tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(tiny_model.read_bytes())
    pool = ModelPool(Settings(models={"m": ModelSpec(path=str(path))}, threads=1), Metrics())
    first = pool.claim("m")
    path.write_bytes(tiny_model.read_bytes())  # rewritten in place: a new modification time
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))  # however coarse the clock
    with pytest.raises(ModelUnavailable, match="changed on disk"):
        pool.claim("m")  # the first claim still holds it: it cannot be reloaded under its user
    first.unclaim()
    second = pool.claim("m")
    assert second is not first and not second.file_changed()
    second.unclaim()


@pytest.mark.parametrize("origin, allowed", [
    ("http://localhost:5173", True), ("http://127.0.0.1:3000", True), ("http://[::1]:8080", True),
    ("vscode-webview://abc123", True), ("tauri://localhost", True),
    ("http://localhost.evil.example", False), ("https://evil.example", False), ("http://127.0.0.1.nip.io", False),
])
def test_pages_of_this_machine_may_call_the_api_and_foreign_ones_may_not(server, origin, allowed):
    preflight = requests.options(server.url + CHAT, timeout=30, headers={
        "Origin": origin, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"})
    chat = requests.post(server.url + CHAT, json={"model": "tiny", "messages": HI, "max_tokens": 1},
                         headers={"Origin": origin}, timeout=30)
    if allowed:
        assert preflight.headers.get("Access-Control-Allow-Origin") == origin and chat.status_code == 200
        assert chat.headers.get("Access-Control-Allow-Origin") == origin
    else:
        assert "Access-Control-Allow-Origin" not in preflight.headers and chat.status_code == 403


@pytest.mark.parametrize("path, body, words", [
    ("/api/generate", {"prompt": "hi", "keep_alive": 1e300}, "keep_alive is longer"),
    ("/api/generate", {"prompt": "hi", "keep_alive": "9999999999h"}, "keep_alive is longer"),
    ("/api/generate", {"prompt": "hi", "keep_alive": 2**64}, "keep_alive is longer"),
    ("/api/generate", '{"model": "tiny", "prompt": "hi", "keep_alive": 1e400}', "1e400 is too large"),
    ("/api/generate", {"prompt": "hi", "options": {"temperature": 1e300}}, "options.temperature"),
    ("/api/generate", '{"model": "tiny", "prompt": "hi", "options": {"temperature": 1e400}}', "too large"),
    ("/api/generate", {"prompt": "hi", "options": {"repeat_penalty": 1e-300}}, "options.repeat_penalty"),
    ("/v1/messages", {"max_tokens": 2, "messages": HI, "context_management": {"edits": [
        {"type": "clear_tool_uses_20250919", "trigger": {"type": "input_tokens", "value": "x"}}]}}, "trigger.value"),
    ("/v1/messages", {"max_tokens": 2, "messages": HI, "context_management": {"edits": [
        {"type": "clear_tool_uses_20250919", "keep": {"type": "tool_uses", "value": None}}]}}, "keep"),
])
def test_numbers_past_what_is_meant_are_a_400_naming_them(server, path, body, words):
    data = body if isinstance(body, str) else json.dumps({"model": "tiny", "stream": False, **body})
    reply = requests.post(server.url + path, data=data, headers={"Content-Type": "application/json"}, timeout=30)
    assert reply.status_code == 400 and words in reply.text
    assert requests.get(server.url + "/api/ps", timeout=30).status_code == 200


@pytest.mark.parametrize("after", ["10000000000000000000000", "--1", "²"])
def test_a_resumed_stream_takes_only_a_sequence_number(server, after):
    made = requests.post(server.url + "/v1/responses", timeout=30,
                         json={"model": "tiny", "input": "hi", "background": True, "max_output_tokens": 2}).json()
    reply = requests.get(f"{server.url}/v1/responses/{made['id']}", params={"stream": "true", "starting_after": after},
                         timeout=30)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "starting_after"


def test_unloading_through_keep_alive_takes_an_admin_key(tiny_model, tmp_path):
    env = {"KRONK_MODELS": f"tiny={tiny_model}", "KRONK_API_KEYS": "user,boss", "KRONK_ADMIN_KEYS": "boss"}
    with run_server(tmp_path, env) as server:
        def unload(key: str) -> requests.Response:
            return requests.post(server.url + "/api/generate", json={"model": "tiny", "keep_alive": 0}, timeout=30,
                                 headers={"Authorization": f"Bearer {key}"})

        refused = unload("user")
        assert refused.status_code == 403 and "admin key" in refused.json()["error"]
        loaded = requests.get(server.url + "/api/ps", headers={"Authorization": "Bearer user"}, timeout=30).json()
        assert [m["name"] for m in loaded["models"]] == ["tiny:latest"]
        assert unload("boss").json()["done_reason"] == "unload"


def test_smaller_findings_of_round_three(server):
    pull = requests.post(server.url + "/api/pull", json={"model": "hf.co/x/y:Q4_K_M\n"}, timeout=30)
    assert pull.status_code == 400
    shown = requests.post(server.url + "/api/show", json={"model": "tiny"}, timeout=30).json()
    assert shown["modelfile"].splitlines()[1] == "FROM tiny.gguf"  # the file's name, not the server's directories
    metrics = requests.get(server.url + "/metrics", timeout=30)
    assert metrics.headers["Content-Type"].count("charset") == 1
    raw = socket.create_connection((server.host, server.port), timeout=30)
    raw.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                b"Transfer-Encoding: gzip, chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n")
    assert raw.recv(100).startswith(b"HTTP/1.1 501")
    raw.close()
