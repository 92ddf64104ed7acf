"""The hostile requests that once stalled a worker, each beside a quiet baseline, on one server.

For each probe: a stream on the slow model (a token every 50 ms) is running, /v1/liveness is polled on fresh
connections the whole time, and the probe's requests are sent. Reported: liveness p50 / p99 / max and the
stream's largest gap. ``bench/run.py --stalls`` runs it; ``--storm`` and ``--idle`` are two more such probes.
"""

import json
import os
import shutil
import socket
import sqlite3
import threading
import time
from pathlib import Path
from typing import Callable

import requests

from kronk_wsgi.engine.demo_model import ensure_demo_model
from kronk_wsgi.testing import fetch_gemma3, run_server

HI = [{"role": "user", "content": "hi"}]
LONG = "A prompt long enough to be worth a prompt-cache entry. " * 20


def _json_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "probe", "schema": schema}}


def _pattern(i: int) -> str:  # 20 alternatives sharing a 40-character prefix: quadratic to compile
    return "|".join(f"{'a' * 40}{i:04d}{j:03d}" for j in range(20))


def _post(url: str, body: dict) -> None:
    requests.post(url + "/v1/chat/completions", json=body, timeout=300)


def probes(url: str, host: str, port: int, store: Path) -> dict[str, Callable[[], None]]:
    """Each probe: what it sends, run to its end."""
    def patterns() -> None:  # item 3: ~1.4 MB of patterns, an unknown model, no key
        schema = {"type": "object",
                  "properties": {f"p{i}": {"type": "string", "pattern": _pattern(i)} for i in range(2500)}}
        _post(url, {"model": "unknown-model", "messages": HI, "response_format": _json_format(schema)})

    def large_schemas() -> None:  # item 3: 9,000 prefixItems, 6,000 properties
        items = {"type": "array", "prefixItems": [{"type": "integer"}] * 9000}
        props = {"type": "object", "properties": {f"k{i}": {"type": "integer"} for i in range(6000)}}
        for schema in (items, props):
            _post(url, {"model": "fast", "messages": HI, "max_tokens": 2, "response_format": _json_format(schema)})

    def many_logprobs() -> None:  # item 4: a whole answer of 16 x 2,000 tokens with 20 top logprobs each
        _post(url, {"model": "fast", "messages": HI, "max_tokens": 2000, "n": 16, "logprobs": True, "top_logprobs": 20,
                    "logit_bias": {"2": -100}})

    def never_reads() -> None:  # item 4: ~8 MB of answer to a client with a 4 KB window that never reads
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect((host, port))
        body = json.dumps({"model": "fast", "messages": HI, "max_tokens": 400, "n": 16, "logprobs": True,
                           "top_logprobs": 20, "stream": True, "logit_bias": {"2": -100}}).encode()
        sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        time.sleep(8)  # past the write timeout (5 s here): the server hangs up
        sock.close()

    def locked_store() -> None:  # item 2: another process holds the Responses store's write lock
        locker = sqlite3.connect(store, timeout=1)
        locker.execute("BEGIN IMMEDIATE")
        try:
            for _ in range(3):
                requests.post(url + "/v1/responses", json={"model": "fast", "input": "hi", "max_output_tokens": 2},
                              timeout=300)
                _post(url, {"model": "fast", "messages": HI, "max_tokens": 2})
        finally:
            locker.rollback()
            locker.close()

    def grammars() -> None:  # round 3, item 1: 1,000 nested GBNF rules (converted), 4,000 (refused)
        for rules in (1000, 4000):
            gbnf = "\n".join(["root ::= r0"] + [f'r{i} ::= "(" r{i + 1} ")" | "x"' for i in range(rules)]
                             + [f'r{rules} ::= "y"'])
            _post(url, {"model": "fast", "messages": HI, "max_tokens": 2, "grammar": gbnf})

    def cache_files() -> None:  # round 3, item 3: a FIFO, a stray name, a directory and a forged entry
        (directory,) = [d for d in (store.parent / "prompt-cache").iterdir() if d.is_dir()]
        os.mkfifo(directory / ("ab" * 16 + ".kv"))
        (directory / "zz-not-hex.kv").write_bytes(b"x")
        (directory / ("cd" * 16 + ".kv")).mkdir()
        for entry in directory.glob("*.kv"):
            if entry.is_file() and entry.stat().st_size > 1000:
                data = bytearray(entry.read_bytes())
                data[-100] ^= 1
                entry.write_bytes(bytes(data))
        for i in range(3):
            _post(url, {"model": "cached", "messages": [{"role": "user", "content": LONG + str(i)}], "max_tokens": 2})

    def long_line() -> None:  # scheduler issue: 40 requests at once in one model's line
        threads = [threading.Thread(target=_post, args=(url, {"model": "fast", "messages": HI, "max_tokens": 50,
                                                              "logit_bias": {"2": -100}})) for _ in range(40)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    def background_flood() -> None:  # scheduler issue: 300 background responses from one key (16 are taken)
        for _ in range(300):
            requests.post(url + "/v1/responses", json={"model": "fast", "input": "hi", "max_output_tokens": 20,
                                                       "background": True}, timeout=300)

    def many_messages() -> None:  # round 4, item 5: 8 clients at once, each a 6 MB body of 200,000 messages
        body = json.dumps({"model": "fast", "messages": [{"role": "user", "content": "hi"}] * 200_000,
                           "max_tokens": 2}, separators=(",", ":")).encode()
        threads = [threading.Thread(target=requests.post, args=(url + "/v1/chat/completions",),
                                    kwargs={"data": body, "headers": {"Content-Type": "application/json"},
                                            "timeout": 300}) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    return {"quiet (baseline)": lambda: time.sleep(5), "1.4 MB of schema patterns": patterns,
            "8 bodies of 200,000 messages at once (6 MB each)": many_messages,
            "40 requests at once in one line": long_line, "300 background responses": background_flood,
            "GBNF grammars of 1,000 and 4,000 rules": grammars, "untrustworthy prompt-cache files": cache_files,
            "9,000 prefixItems, 6,000 properties": large_schemas, "n=16 x 2,000 tokens, top_logprobs 20": many_logprobs,
            "a client that never reads 8 MB": never_reads, "the Responses store locked": locked_store}


def _measure(url: str, probe: Callable[[], None], model: str = "slow") -> tuple[list[float], float]:
    """Liveness latencies while the probe runs, and the largest gap of a stream on ``model`` running throughout."""
    arrivals: list[float] = []
    started = threading.Event()

    def stream() -> None:
        body = {"model": model, "messages": HI, "max_tokens": 100000, "stream": True, "ignore_eos": True}
        with requests.post(url + "/v1/chat/completions", json=body, stream=True, timeout=300) as response:
            for line in response.iter_lines():
                if line.startswith(b"data: {"):
                    arrivals.append(time.perf_counter())
                    started.set()
                if done.is_set():
                    return

    done = threading.Event()
    runner = threading.Thread(target=stream)
    runner.start()
    started.wait(60)
    latencies: list[float] = []

    def poll() -> None:
        while not done.is_set():
            begun = time.perf_counter()
            requests.get(url + "/v1/liveness", timeout=300)
            latencies.append(time.perf_counter() - begun)
            time.sleep(0.02)

    poller = threading.Thread(target=poll)
    poller.start()
    first = len(arrivals)
    probe()
    time.sleep(0.5)
    done.set()
    poller.join()
    runner.join()
    during = arrivals[max(first - 1, 0):]
    return sorted(latencies), max(b - a for a, b in zip(during, during[1:]))


def stall_probes() -> list[tuple[str, str]]:
    workdir = Path(__file__).resolve().parent / "results" / "stalls"
    workdir.mkdir(parents=True, exist_ok=True)
    path = ensure_demo_model("tiny")
    models = {"slow": {"path": str(path), "engine": "kronk_wsgi.testing.faulty:KIND"}, "fast": {"path": str(path)},
              "cached": {"path": str(path), "engine": "llama.cpp"}}
    store = workdir / "responses.sqlite3"
    shutil.rmtree(workdir / "prompt-cache", ignore_errors=True)
    env = {"KRONK_MODELS": json.dumps(models), "KRONK_DEFAULT_MODEL": "slow", "KRONK_TEST_STEP_DELAY": "0.05",
           "KRONK_WRITE_TIMEOUT": 5, "KRONK_PARALLEL": 2, "KRONK_RESPONSES_DB": str(store),
           "KRONK_PROMPT_CACHE_DIR": str(workdir / "prompt-cache")}
    rows = []
    with run_server(workdir, env) as server:
        _post(server.url, {"model": "fast", "messages": HI, "max_tokens": 2})  # the models loaded, the store made
        _post(server.url, {"model": "cached", "messages": [{"role": "user", "content": LONG}], "max_tokens": 2})
        requests.post(server.url + "/v1/responses", json={"model": "fast", "input": "hi", "max_output_tokens": 2},
                      timeout=60)
        for name, probe in probes(server.url, server.host, server.port, store).items():
            latencies, gap = _measure(server.url, probe)
            p = [1000 * latencies[min(int(q * len(latencies)), len(latencies) - 1)] for q in (0.5, 0.99)]
            rows.append((f"{name}: liveness p50 / p99 / max ms, stream's largest gap ms",
                         f"{p[0]:.0f} / {p[1]:.0f} / {1000 * latencies[-1]:.0f}, {1000 * gap:.0f}"))
    rows.append(("goals", "liveness p99 < 250 ms, largest gap < 1000 ms"))
    return rows


def joining_prompt() -> list[tuple[str, str]]:
    """Round 4, item 7: a stream on Gemma 3 (llama.cpp, two slots, one thread) while the other slot's conversation
    of ~8,900 tokens gives way to a new prompt of ~3,100 tokens, the prompt cache on and then off."""
    workdir = Path(__file__).resolve().parent / "results" / "joining"
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    models = {"gemma": {"path": str(fetch_gemma3()), "engine": "llama.cpp", "context_length": 32768}}
    held = [{"role": "user", "content": " ".join(f"word{i}" for i in range(2000))}]
    joining = [{"role": "user", "content": " ".join(f"other{i}" for i in range(800)) + " Say hi."}]
    rows = []
    for cache, settings in (("on", {}), ("off", {"KRONK_PROMPT_CACHE_RAM_MB": 0, "KRONK_PROMPT_CACHE_DISK_MB": 0})):
        env = {"KRONK_MODELS": json.dumps(models), "KRONK_PARALLEL": 2, "KRONK_PROMPT_CACHE_DIR": str(workdir / "pc"),
               **settings}
        with run_server(workdir, env) as server:
            server.post("/v1/chat/completions", {"model": "gemma", "messages": held, "max_tokens": 1}, timeout=900)
            latencies, gap = _measure(server.url, lambda: server.post(
                "/v1/chat/completions", {"model": "gemma", "messages": joining, "max_tokens": 2}, timeout=900),
                model="gemma")
        rows.append((f"prompt cache {cache}: liveness p99 ms, stream's largest gap ms",
                     f"{1000 * latencies[min(int(0.99 * len(latencies)), len(latencies) - 1)]:.0f}, "
                     f"{1000 * gap:.0f}"))
    rows.append(("goal", "largest gap < 1000 ms"))
    return rows
