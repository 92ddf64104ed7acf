"""What the SGLang model gateway asks of a worker, on a real server: its probes, and the fields it writes into
every body it routes."""

import time

import pytest
import requests
from openai import OpenAI

from kronk_wsgi.testing import metric, run_server
from kronk_wsgi.testing.balancers import run_router
from kronk_wsgi.testing.rawhttp import RawStream

from .conftest import faulty_env

SGLANG_CHAT = {"no_stop_trim": False, "ignore_eos": False, "continue_final_message": False,
               "skip_special_tokens": True, "separate_reasoning": True, "stream_reasoning": True,
               "return_hidden_states": False}
HELLO = [{"role": "user", "content": "Hello there"}]


def test_the_gateways_probes(server):
    assert requests.get(server.url + "/health", timeout=10).status_code == 200
    for path in ("/server_info", "/get_server_info"):
        info = requests.get(server.url + path, timeout=10).json()
        assert info["served_model_name"] == "tiny" and info["max_running_requests"] == 1 and info["dp_size"] == 1
    for path in ("/model_info", "/get_model_info"):
        info = requests.get(server.url + path, timeout=10).json()
        assert info["is_generation"] is True and info["model_type"] == "llama"
    (load,) = requests.get(server.url + "/get_load", timeout=10).json()
    assert load["dp_rank"] == 0 and load["num_reqs"] == 0 and load["num_waiting_reqs"] == 0


def test_the_fields_the_gateway_writes_are_taken_at_their_defaults(server):
    chat = server.post("/v1/chat/completions", {"model": "tiny", "messages": HELLO, "max_completion_tokens": 3,
                                                **SGLANG_CHAT})
    assert chat.status_code == 200, chat.text
    completion = server.post("/v1/completions", {"model": "tiny", "prompt": "Once", "max_completion_tokens": 3,
                                                 **SGLANG_CHAT})
    assert completion.status_code == 200 and completion.json()["usage"]["completion_tokens"] <= 3
    response = server.post("/v1/responses", {"model": "tiny", "input": "hi", "max_output_tokens": 3, "priority": 0,
                                             "top_k": -1, "min_p": 0, "repetition_penalty": 1})
    assert response.status_code == 200, response.text
    changed = server.post("/v1/chat/completions", {"model": "tiny", "messages": HELLO, "skip_special_tokens": False})
    assert changed.status_code == 400 and changed.json()["error"]["param"] == "skip_special_tokens"


def test_ignore_eos_runs_to_max_tokens(server):
    reply = server.post("/v1/chat/completions", {"model": "tiny", "messages": HELLO, "max_tokens": 40,
                                                 "ignore_eos": True})
    assert reply.json()["usage"]["completion_tokens"] == 40 and reply.json()["choices"][0]["finish_reason"] == "length"


# -- through the real router (PyPI sglang-router, the gateway's Python launcher) --------------------------------

@pytest.fixture
def two_slow(tiny_model, tmp_path):
    """Two instances of one place each (a token every 0.2 s, no EOS), a 1 s admission wait: a second request
    to a busy one is a 429."""
    env = faulty_env(tiny_model, KRONK_TEST_STEP_DELAY=0.2, KRONK_TEST_NO_EOS=1, KRONK_QUEUE_DEPTH=1,
                     KRONK_ADMISSION_TIMEOUT=1)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with run_server(tmp_path / "a", env) as a, run_server(tmp_path / "b", env) as b:
        yield a, b


def test_the_router_routes_streams_and_resends_a_429_to_the_idle_worker(two_slow, tmp_path):
    a, b = two_slow
    with run_router(tmp_path, [a.url, b.url], "tiny") as url:
        client = OpenAI(base_url=url + "/v1", api_key="unused")
        arrivals = []
        for chunk in client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=4, stream=True):
            if chunk.choices and chunk.choices[0].delta.content:
                arrivals.append(time.monotonic())
        assert len(arrivals) >= 3 and arrivals[-1] - arrivals[0] > 0.3  # a token every 0.2 s, as it came
        completion = client.completions.create(model="tiny", prompt="Once", max_tokens=2)
        assert completion.usage.completion_tokens == 2
        held = RawStream(a.host, a.port, "/v1/chat/completions",
                         {"model": "tiny", "messages": HELLO, "max_tokens": 200, "stream": True})  # a is busy
        next(held.frames())
        statuses = [requests.post(url + "/v1/chat/completions", timeout=60, json={
            "model": "tiny", "messages": HELLO, "max_tokens": 2}).status_code for _ in range(4)]
        held.close()
        assert statuses == [200] * 4  # each 429 of the busy one went to the other
        assert metric(a, "kronk_rejected_total", model="tiny") >= 1


def test_the_router_skips_a_dead_worker(two_slow, tmp_path):
    a, b = two_slow
    with run_router(tmp_path, [a.url, b.url], "tiny") as url:
        b.stop()
        statuses = [requests.post(url + "/v1/chat/completions", timeout=60, json={
            "model": "tiny", "messages": HELLO, "max_tokens": 2}).status_code for _ in range(4)]
        assert statuses == [200] * 4
