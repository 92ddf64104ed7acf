"""A llama.cpp model spread over llama.cpp's rpc-server processes (``engine_options.rpc_servers``): two
ggml-rpc-servers on loopback, built by .ci/run from llama-cpp-python's own llama.cpp (KRONK_TEST_RPC_SERVER), against
the same model loaded here; one that does not answer. Skipped where either is missing, unless
KRONK_TEST_REQUIRE_RPC=1 (as in CI) makes that a failure."""

import json
import os
from pathlib import Path

import pytest
import requests

from kronk_wsgi.testing import free_port, run_rpc_server, run_server

BINARY = os.environ.get("KRONK_TEST_RPC_SERVER")
QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


@pytest.fixture(scope="module", autouse=True)
def rpc_built():
    import llama_cpp

    missing = None if BINARY and llama_cpp.llama_supports_rpc() else "llama.cpp's RPC is not built here"
    if missing and os.environ.get("KRONK_TEST_REQUIRE_RPC") == "1":
        raise RuntimeError(f"{missing}, and KRONK_TEST_REQUIRE_RPC is set")
    if missing:
        pytest.skip(f"{missing} (.ci/run builds it: KRONK_TEST_RPC_SERVER)")


def answer(server) -> dict:
    reply = server.post("/v1/chat/completions", {"model": "smol", "messages": QUESTION, "max_tokens": 24,
                                                 "temperature": 0})
    assert reply.status_code == 200, reply.text
    return reply.json()


def models_env(model, **options) -> dict:
    return {"KRONK_MODELS": json.dumps({"smol": {"path": str(model), "engine": "llama.cpp",
                                                 "engine_options": options}})}


def held(log: Path) -> bool:
    """Whether a client holds a connection to the rpc-server (a loaded model's layers are there)."""
    text = log.read_text()
    return text.count("Accepted client connection") > text.count("Client connection closed")


def test_a_model_spread_over_two_rpc_servers_answers_as_it_does_here(smollm2, tmp_path):
    (tmp_path / "here").mkdir()
    with run_server(tmp_path / "here", models_env(smollm2)) as server:
        expected = answer(server)
    with run_rpc_server(BINARY, tmp_path) as (one, one_log), run_rpc_server(BINARY, tmp_path) as (two, two_log), \
            run_server(tmp_path, models_env(smollm2, rpc_servers=[one, two])) as server:
        got = answer(server)
        assert held(one_log) and held(two_log)
    assert got["choices"][0]["message"]["content"] == expected["choices"][0]["message"]["content"]
    assert got["usage"]["completion_tokens"] == expected["usage"]["completion_tokens"]


def test_an_rpc_server_that_does_not_answer_is_named(smollm2, tmp_path):
    gone = f"127.0.0.1:{free_port()}"
    with run_rpc_server(BINARY, tmp_path) as (one, _), \
            run_server(tmp_path, models_env(smollm2, rpc_servers=[one, gone]), ready="/v1/liveness") as server:
        reply = server.post("/v1/chat/completions", {"model": "smol", "messages": QUESTION})
        assert reply.status_code == 503, reply.text
        assert f"the rpc-server {gone} does not answer" in reply.json()["error"]["message"]
        assert requests.get(server.url + "/v1/liveness", timeout=10).status_code == 200  # the worker lives on
