"""The first run of `kronk-wsgi serve` with no model configured: the default model pulled from a (local) hub with
its progress on the terminal, served from the cache after, and the demo model when the hub cannot give it."""

import fcntl
import os
import pty
import signal
import struct
import subprocess
import sys
import termios
import threading
import time

import pytest
import requests

from kronk_wsgi.testing import free_port

from .conftest import ROOT
from .support.hub import FakeHub

REPO = "someone/Tiny-Instruct-GGUF"
DEFAULT = f"{REPO}:Q8_0"


class Terminal:
    """`kronk-wsgi serve` with its output on a pseudo-terminal, as a user sees it."""

    def __init__(self, env: dict, *args: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        main, side = pty.openpty()
        fcntl.ioctl(side, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))  # progress bars need a width
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kronk_wsgi.cli", "serve", "--bind", f"127.0.0.1:{self.port}", *args],
            stdin=subprocess.DEVNULL, stdout=side, stderr=side,
            env={**os.environ, "PYTHONPATH": str(ROOT), "KRONK_THREADS": "1", **env})
        os.close(side)
        self.shown = b""
        self._reader = threading.Thread(target=self._read, args=(main,), daemon=True)
        self._reader.start()

    def _read(self, fd: int) -> None:
        try:
            while chunk := os.read(fd, 4096):
                self.shown += chunk
        except OSError:  # the server is gone: the terminal has no writer left
            pass

    @property
    def text(self) -> str:
        return self.shown.decode(errors="replace")

    def wait_until(self, condition, seconds: float = 60) -> None:
        deadline = time.monotonic() + seconds
        while not condition():
            assert self.proc.poll() is None, self.text
            assert time.monotonic() < deadline, self.text
            time.sleep(0.1)

    def ready(self) -> bool:
        try:
            return requests.get(self.url + "/v1/readiness", timeout=1).status_code == 200
        except requests.RequestException:
            return False

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGQUIT)
        self.proc.wait(timeout=30)


@pytest.fixture
def hub(tiny_model, tmp_path):
    with FakeHub() as fake:
        fake.add_file(REPO, tiny_model, "Tiny-Instruct-Q8_0.gguf")
        fake.add_file(REPO, tiny_model, "Tiny-Instruct-F16.gguf")
        fake.env = {"HF_ENDPOINT": fake.url, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_DISABLE_TELEMETRY": "1",
                    "XDG_CACHE_HOME": str(tmp_path / "cache"), "KRONK_DEFAULT_PULL": DEFAULT}
        yield fake


def answer(url: str, model: str) -> str:
    reply = requests.post(url + "/v1/chat/completions", timeout=60, json={
        "model": model, "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 3})
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["message"]["content"]


def test_the_first_start_pulls_the_default_with_progress_and_the_next_serves_it_offline(hub):
    first = Terminal(hub.env)
    try:
        first.wait_until(first.ready)
        first.wait_until(lambda: "try      curl" in first.text)
        answer(first.url, "tiny-instruct")
    finally:
        first.stop()
    shown = first.text
    assert f"no model is configured: serving {DEFAULT}" in shown
    assert "Tiny-Instruct-Q8_0.gguf" in shown and "100%" in shown  # huggingface-hub's progress bar
    assert "serving tiny-instruct at " + first.url + "/v1" in shown
    assert "engine   ctransformers, context" in shown and "1 slot(s)" in shown
    downloads = [r for r in hub.requests if r[1].endswith("Tiny-Instruct-Q8_0.gguf")]
    assert downloads

    hub.requests.clear()
    second = Terminal({**hub.env, "HF_HUB_OFFLINE": "1"})
    try:
        second.wait_until(second.ready)
        answer(second.url, "tiny-instruct")
    finally:
        second.stop()
    assert hub.requests == []  # from the cache, without asking the hub
    assert "100%" not in second.text


def test_an_unreachable_hub_with_an_empty_cache_says_what_to_do_and_serves_the_demo(hub):
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    started = time.monotonic()
    term = Terminal({**hub.env, "HF_ENDPOINT": dead})
    try:
        term.wait_until(lambda: "serving the generated demo model" in term.text, seconds=30)
        said = time.monotonic() - started
        term.wait_until(term.ready)
        answer(term.url, "kronk-demo")
    finally:
        term.stop()
    assert said < 15, said
    text = term.text
    assert f"could not get {DEFAULT} from {dead}" in text
    assert "--model ID=/path/to/model.gguf" in text and "--demo" in text
    assert "Traceback" not in text


def test_demo_never_touches_the_hub(hub):
    term = Terminal(hub.env, "--demo")
    try:
        term.wait_until(term.ready)
        answer(term.url, "kronk-demo")
    finally:
        term.stop()
    assert hub.requests == [] and "Hugging Face" not in term.text


def test_a_configured_model_is_announced_too(hub, tiny_model):
    term = Terminal({**hub.env, "KRONK_MODELS": f"mine={tiny_model}"})
    try:
        term.wait_until(lambda: "try      curl" in term.text)
    finally:
        term.stop()
    assert hub.requests == [] and f"file     {tiny_model}" in term.text and "serving mine at" in term.text
