"""Pull, list and remove models with the real huggingface-hub client, against a local hub (HF_ENDPOINT)."""

import hashlib
import json
import fcntl
import os
import pty
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest
import requests

from .conftest import ROOT, run_server
from .support.hub import FakeHub

REPO = "someone/tiny-GGUF"


@pytest.fixture
def hub(tiny_model, tmp_path):
    """A local hub with a repository of two quantizations and a README, and a fresh HF_HOME."""
    with FakeHub() as fake:
        fake.add_file(REPO, tiny_model, "tiny.Q8_0.gguf")
        fake.add(REPO, "tiny.F16.gguf", tiny_model.read_bytes()[:4096] + b"\0" * 4096)
        fake.add(REPO, "README.md", b"# tiny\n")
        fake.env = {"HF_ENDPOINT": fake.url, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_DISABLE_TELEMETRY": "1",
                    "XDG_CACHE_HOME": str(tmp_path / "cache"), "KRONK_MODELS": f"local={tiny_model}"}
        yield fake


def cli(hub, *args, **env):
    return subprocess.run(
        [sys.executable, "-m", "kronk_wsgi.cli", *args], capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT), **hub.env, **env},
    )


def on_a_terminal(hub, *args) -> tuple[int, str, str]:
    """Run the command with its stderr on a pseudo-terminal, as a user sees it: exit status, stdout, terminal."""
    main, side = pty.openpty()
    fcntl.ioctl(side, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # 24 rows of 100 columns
    with os.fdopen(main, "rb", buffering=0) as terminal:
        proc = subprocess.Popen([sys.executable, "-m", "kronk_wsgi.cli", *args], stdout=subprocess.PIPE, stderr=side,
                                env={**os.environ, "PYTHONPATH": str(ROOT), **hub.env})
        os.close(side)
        shown = b""
        try:
            while chunk := terminal.read(4096):
                shown += chunk
        except OSError:  # the command is done: the terminal has no writer left
            pass
        stdout = proc.communicate(timeout=120)[0]
    return proc.returncode, stdout.decode(), shown.decode(errors="replace")


def test_pull_by_quantization_shows_progress_and_lands_in_the_cache(hub, tiny_model):
    status, stdout, terminal = on_a_terminal(hub, "pull", REPO, "q8_0")
    assert status == 0, terminal
    path = stdout.strip()
    assert path.endswith("tiny.Q8_0.gguf") and "/hf/hub/models--someone--tiny-GGUF/snapshots/" in path
    assert open(path, "rb").read() == tiny_model.read_bytes()
    assert "tiny.Q8_0.gguf" in terminal and "100%" in terminal  # huggingface-hub's progress bar
    listed = cli(hub, "models")
    assert listed.returncode == 0, listed.stderr
    rows = [line.split() for line in listed.stdout.splitlines()]
    cached = next(row for row in rows if row[:3] == ["-", REPO, "tiny.Q8_0.gguf"])
    assert "llama" in cached and "ctransformers" in cached
    assert any(row[0] == "local" and "llama" in row for row in rows)


def test_a_file_must_be_named_when_the_repository_has_several(hub):
    ambiguous = cli(hub, "pull", REPO)
    assert ambiguous.returncode == 1 and "tiny.F16.gguf, tiny.Q8_0.gguf" in ambiguous.stderr
    missing = cli(hub, "pull", REPO, "Q4_K_M")
    assert missing.returncode == 1 and "no GGUF file" in missing.stderr and "tiny.Q8_0.gguf" in missing.stderr
    absent = cli(hub, "pull", "nobody/nothing", "Q8_0")
    assert absent.returncode == 1 and "cannot list the files of nobody/nothing" in absent.stderr


def test_a_dropped_connection_resumes_where_it_stopped(hub):
    data = os.urandom(12 << 20)  # huggingface-hub writes in 10 MiB pieces: cut past the first
    hub.add(REPO, "big.Q4_0.gguf", data)
    hub.cut_once["big.Q4_0.gguf"] = 11 << 20
    pulled = cli(hub, "pull", REPO, "big.Q4_0.gguf")
    assert pulled.returncode == 0, pulled.stderr
    assert hashlib.sha256(open(pulled.stdout.strip(), "rb").read()).digest() == hashlib.sha256(data).digest()
    ranges = [r for method, path, r in hub.requests if method == "GET" and path.endswith("big.Q4_0.gguf")]
    assert ranges == ["", f"bytes={10 << 20}-"]


def test_a_corrupted_download_is_refused_and_removed(hub):
    hub.corrupt.add("tiny.Q8_0.gguf")
    pulled = cli(hub, "pull", REPO, "Q8_0")
    assert pulled.returncode == 1 and "SHA-256" in pulled.stderr and "removed" in pulled.stderr
    assert "tiny.Q8_0.gguf" not in cli(hub, "models").stdout
    assert list((Path(hub.env["HF_HOME"]) / "hub").rglob("blobs/*")) == []
    hub.corrupt.clear()
    assert cli(hub, "pull", REPO, "Q8_0").returncode == 0  # pulled again, whole


def test_rm_removes_the_file_and_its_blob(hub):
    assert cli(hub, "pull", REPO, "Q8_0").returncode == 0
    assert cli(hub, "pull", REPO, "F16").returncode == 0
    removed = cli(hub, "rm", REPO, "tiny.F16.gguf")
    assert removed.returncode == 0 and "removed someone/tiny-GGUF tiny.F16.gguf" in removed.stdout
    listing = cli(hub, "models").stdout
    assert "tiny.F16.gguf" not in listing and "tiny.Q8_0.gguf" in listing
    assert cli(hub, "rm", REPO).returncode == 0
    assert REPO not in cli(hub, "models").stdout
    again = cli(hub, "rm", REPO)
    assert again.returncode == 1 and "nothing of someone/tiny-GGUF" in again.stderr


def test_a_model_named_by_repository_and_quantization_serves_offline(hub, tmp_path):
    assert cli(hub, "pull", REPO, "Q8_0").returncode == 0
    models = {"tiny": {"repo_id": REPO, "quant": "Q8_0"}}
    env = {**hub.env, "KRONK_MODELS": json.dumps(models), "HF_HUB_OFFLINE": "1", "HF_ENDPOINT": "http://127.0.0.1:9"}
    with run_server(tmp_path, env) as server:
        reply = server.post("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                                                     "max_tokens": 3})
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] >= 1
        assert requests.get(server.url + "/v1/models", timeout=10).json()["data"][0]["id"] == "tiny"


@pytest.mark.parametrize("revision", ["../../../../tmp/owned", "/etc/passwd", "main/../../x", "a//b", ".hidden"])
def test_a_revision_that_is_no_git_name_never_reaches_the_cache(hub, tmp_path, revision):
    """huggingface-hub writes refs/<revision>: a revision of "../" segments wrote outside the cache."""
    with run_server(tmp_path, hub.env) as server:
        refused = server.post("/admin/pull", {"repo_id": REPO, "file": "Q8_0", "revision": revision})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "revision"
        escaped = server.post("/admin/pull", {"repo_id": REPO, "file": "../../x.gguf"})
        assert escaped.status_code == 400 and escaped.json()["error"]["param"] == "file"
    result = cli(hub, "pull", REPO, "Q8_0", "--revision", revision)
    assert result.returncode != 0 and "not a branch, tag or commit name" in result.stderr
    assert not any(p.name == "owned" for p in (tmp_path / "hf").rglob("*")) and not Path("/tmp/owned").exists()


def test_a_git_name_revision_is_taken(hub):
    result = cli(hub, "pull", REPO, "Q8_0", "--revision", "main")
    assert result.returncode == 0, result.stderr
