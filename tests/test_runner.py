"""Models run by a runner process (runner = "process"): real `kronk-wsgi serve` processes with two gunicorn workers
in front of one runner on SmolLM2; the runner killed, a worker killed, a runner that cannot load its model."""

import dataclasses
import json
import os
import signal
import threading
from pathlib import Path

import pytest
import requests

from kronk_wsgi.config import ModelSpec
from kronk_wsgi.engine.gguf_file import read_gguf, write_gguf_copy
from kronk_wsgi.testing import run_server, wait_until

QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


def runner_env(model: Path, folder: Path, workers: int = 2, **spec) -> dict:
    return {"KRONK_MODELS": json.dumps({"smol": {"path": str(model), "engine": "llama.cpp", "runner": "process",
                                                 **spec}}),
            "KRONK_WORKERS": str(workers), "KRONK_RUNNER_DIR": str(folder)}


def runner_pid(folder: Path) -> int:
    """The pid the ready runner wrote (its model's only one in the folder)."""
    ready = wait_until(lambda: list(folder.glob("*.ready")))
    return int(ready[0].read_text())


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def chat(server, **body) -> dict:
    reply = server.post("/v1/chat/completions", {"model": "smol", "messages": QUESTION, "max_tokens": 24,
                                                 "temperature": 0, **body}, headers={"Connection": "close"})
    assert reply.status_code == 200, reply.text
    return reply.json()


def long_stream(server, events: list, first: threading.Event) -> None:
    """A stream of 400 tokens (no end token ends it), ``first`` set at its first token."""
    with requests.post(server.url + "/completion", stream=True, timeout=120,
                       json={"prompt": "Once upon a time", "n_predict": 400, "ignore_eos": True,
                             "stream": True}) as response:
        for line in response.iter_lines():
            events.append(line)
            if b'"content":"' in line and b'"content":""' not in line:
                first.set()


def test_a_model_on_grpc_workers_has_no_runner():
    with pytest.raises(ValueError, match="runner"):
        ModelSpec(engine="grpc", runner="process", engine_options={"workers": ["grpc://h:1"]})


def test_every_worker_process_shares_one_runner_its_answer_and_its_cache(smollm2, tmp_path):
    """Both gunicorn workers' requests go to one runner: the inline engine's greedy answer, the same conversation's
    prompt read from the runner's cache by whichever worker takes it; the runner stops with the server."""
    (tmp_path / "inline").mkdir()
    (tmp_path / "front").mkdir()
    with run_server(tmp_path / "inline", {"KRONK_MODELS": json.dumps({"smol": {"path": str(smollm2),
                                                                               "engine": "llama.cpp"}})}) as inline:
        expected = chat(inline)["choices"][0]["message"]["content"]
    folder = tmp_path / "runners"
    with run_server(tmp_path / "front", runner_env(smollm2, folder)) as server:
        replies = [chat(server, seed=3) for _ in range(6)]  # each on a new connection, to either worker
        assert {r["choices"][0]["message"]["content"] for r in replies} == {expected}
        assert all(r["usage"]["prompt_tokens_details"]["cached_tokens"] >= r["usage"]["prompt_tokens"] - 1
                   for r in replies[1:]), [r["usage"] for r in replies]
        pid = runner_pid(folder)
        assert server.logs().count('"runner started"') == 1
        wait_until(lambda: server.logs().count('"model loaded"') >= 2)  # both workers hold the model
        embedded = server.post("/v1/embeddings", {"model": "smol", "input": "Hi"})
        assert embedded.status_code == 400 and embedded.json()["error"]["param"] == "model", embedded.text
        row = requests.get(server.url + "/admin/models", timeout=30).json()["data"][0]
        assert row["runner"] == "process" and row["runner_pid"] == pid and row["slots"] == 1, row
    wait_until(lambda: not alive(pid), seconds=30)  # its last front gone, the runner stopped


def test_a_ctransformers_model_runs_in_a_runner_as_inline(tiny_model, tmp_path):
    env = runner_env(tiny_model, tmp_path / "runners", workers=1, engine="ctransformers")
    inline_env = {"KRONK_MODELS": json.dumps({"smol": {"path": str(tiny_model), "engine": "ctransformers"}})}
    (tmp_path / "inline").mkdir()
    with run_server(tmp_path / "inline", inline_env) as inline:
        expected = chat(inline)["choices"][0]["message"]["content"]
    with run_server(tmp_path, env) as server:
        assert chat(server)["choices"][0]["message"]["content"] == expected
        runner_pid(tmp_path / "runners")


def test_a_runner_killed_mid_stream_ends_it_in_band_and_the_next_request_starts_another(smollm2, tmp_path):
    folder = tmp_path / "runners"
    with run_server(tmp_path, runner_env(smollm2, folder)) as server:
        chat(server)
        pid = runner_pid(folder)
        events, first = [], threading.Event()
        reader = threading.Thread(target=long_stream, args=(server, events, first))
        reader.start()
        assert first.wait(60)
        os.kill(pid, signal.SIGKILL)
        reader.join(60)
        assert not reader.is_alive()
        assert any(b'"error"' in line for line in events), events[-3:]
        assert chat(server)["usage"]["completion_tokens"] > 0  # a runner started again
        assert runner_pid(folder) != pid
        assert "Traceback" not in server.logs()


def serving_worker(server, client_port: int) -> int:
    """The pid of the gunicorn worker whose connection is the client's at ``client_port``."""
    inodes = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if int(fields[2].split(":")[1], 16) == client_port and int(fields[1].split(":")[1], 16) == server.port:
            inodes.add(fields[9])
    for pid in map(int, filter(str.isdigit, os.listdir("/proc"))):
        try:
            links = {os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")}
        except OSError:
            continue
        if pid != server.proc.pid and any(f"socket:[{inode}]" in links for inode in inodes):
            return pid
    raise AssertionError(f"no process holds the connection from port {client_port}")


def test_a_worker_killed_mid_stream_frees_its_slot_in_the_runner(smollm2, tmp_path):
    """The runner's one slot, taken by a stream whose worker process is killed: the call is cancelled with the
    worker's connection, and the slot serves the next request at once (with 400 tokens left, it would wait)."""
    folder = tmp_path / "runners"
    with run_server(tmp_path, runner_env(smollm2, folder)) as server:
        chat(server)
        pid = runner_pid(folder)
        session = requests.Session()
        events, first = [], threading.Event()
        port = []

        def stream() -> None:
            with session.post(server.url + "/completion", stream=True, timeout=120,
                              json={"prompt": "Once upon a time", "n_predict": 400, "ignore_eos": True,
                                    "stream": True}) as response:
                port.append(response.raw._connection.sock.getsockname()[1])
                try:
                    for line in response.iter_lines():
                        events.append(line)
                        if b'"content":"' in line and b'"content":""' not in line:
                            first.set()
                except requests.exceptions.ChunkedEncodingError:  # its worker killed
                    events.append(b"cut")

        reader = threading.Thread(target=stream)
        reader.start()
        assert first.wait(60)
        os.kill(serving_worker(server, port[0]), signal.SIGKILL)
        reader.join(60)
        assert events[-1] == b"cut"
        wait_until(lambda: '"outcome": "client_gone"' in server.logs() or '"outcome": "aborted"' in server.logs(),
                   seconds=10)
        assert chat(server, max_tokens=4)["usage"]["completion_tokens"] == 4
        assert runner_pid(folder) == pid  # the other worker held it: the same runner


def test_a_runner_that_cannot_load_its_model_says_why(smollm2, tmp_path):
    """A file the front reads (its tokenizer, its size) whose header names layers it lacks: the runner's load
    fails, and the request is told the runner's reason."""
    source = read_gguf(smollm2)
    fields = dict(source.fields)
    fields["llama.block_count"] = dataclasses.replace(fields["llama.block_count"], value=90)
    broken = tmp_path / "broken.gguf"
    write_gguf_copy(source, broken, fields, {})
    folder = tmp_path / "runners"
    env = runner_env(broken, folder, workers=1)
    with run_server(tmp_path, env, ready="/v1/liveness") as server:
        reply = server.post("/v1/chat/completions", {"model": "smol", "messages": QUESTION})
        assert reply.status_code == 503, reply.text
        assert "the model's runner failed" in reply.json()["error"]["message"], reply.text
        assert not list(folder.glob("*.ready"))
