"""Fixtures: tiny real GGUF models and real gunicorn servers (gevent worker) on loopback."""

from pathlib import Path

import pytest

from kronk_wsgi.engine.demo_model import write_demo_model
from kronk_wsgi.testing import fetch_gemma3, fetch_smollm2, free_port, metric, run_server  # noqa: F401 (for the tests)

ROOT = Path(__file__).resolve().parent.parent
FAULTY = "kronk_wsgi.testing.faulty:KIND"


def faulty_env(tiny_model, **extra):
    """A server's settings for the tiny model on the fault-injecting engine (delays and failures, as ``extra``
    KRONK_TEST_* settings say)."""
    models = '{"tiny": {"path": "%s", "engine": "%s"}}' % (tiny_model, FAULTY)
    return {"KRONK_MODELS": models, **extra}


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return write_demo_model(tmp_path_factory.mktemp("models") / "tiny.gguf", "tiny")


@pytest.fixture(scope="session")
def smollm2() -> Path:
    return fetch_smollm2()


@pytest.fixture(scope="session")
def gemma3() -> Path:
    return fetch_gemma3()


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    """A plain server on the tiny model: parallel 1, queue depth 2."""
    with run_server(tmp_path_factory.mktemp("server"), {"KRONK_MODELS": f"tiny={tiny_model}"}) as s:
        yield s


@pytest.fixture(scope="module")
def slow(tiny_model, tmp_path_factory):
    """0.3 s per token, keep-alive every 0.1 s, no EOS; one place, 1 s admission wait."""
    env = faulty_env(tiny_model, KRONK_TEST_STEP_DELAY=0.3, KRONK_TEST_NO_EOS=1, KRONK_KEEPALIVE_INTERVAL=0.1,
                     KRONK_QUEUE_DEPTH=1, KRONK_ADMISSION_TIMEOUT=1)
    with run_server(tmp_path_factory.mktemp("slow"), env) as server:
        yield server


@pytest.fixture(scope="module")
def failing(tiny_model, tmp_path_factory):
    """The engine fails on the 3rd decode step."""
    env = faulty_env(tiny_model, KRONK_TEST_FAIL_AFTER=3, KRONK_TEST_NO_EOS=1)
    with run_server(tmp_path_factory.mktemp("failing"), env) as server:
        yield server
