"""Fixtures: tiny real GGUF models and real gunicorn servers (gevent worker) on loopback."""

from pathlib import Path

import pytest

from kronk_wsgi.engine.demo_model import write_demo_model
from kronk_wsgi.testing import fetch_gemma3, fetch_smollm2, free_port, metric, run_server  # noqa: F401 (for the tests)

ROOT = Path(__file__).resolve().parent.parent
FAULTY = "kronk_wsgi.testing.faulty:KIND"


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
