"""kronk_wsgi's gRPC workers behind the real Shepherd Model Gateway (SMG), beside kronk's own HTTP server.

SmolLM2 on llama.cpp, one slot and one thread per process (two cores). In turns, order alternating: one
stream direct from `kronk-wsgi serve`, through `kronk-wsgi serve` whose model is a `kronk-wsgi grpc` worker
(the grpc engine) and through SMG -> the same worker; two streams at once through SMG with one worker and
with two; then six conversations of three turns, each with its own ~600-token document, through SMG and
through kronk with cache_aware and with round_robin over two workers: the share of later turns' prompts the
workers served from their cache. ``bench/run.py --grpc [--tokens 200] [--rounds 5]`` runs it; any worker URL
can stand in for kronk's with ``--worker-url`` (SGLang, vLLM: see docs/BENCHMARKS.rst).
"""

import contextlib
import json
import shutil
import statistics
import threading
import time
from pathlib import Path
from typing import Optional, Sequence

from kronk_wsgi.testing import fetch_smollm2, run_grpc_worker, run_server, run_smg

ROOT = Path(__file__).resolve().parent.parent
TOPICS = ["lighthouses", "bread", "glaciers", "violins", "railways", "honeybees"]
ASKS = ["Summarize it.", "What is the most surprising fact?", "And the second?"]


def streams_at_once(url: str, tokens: int, count: int, one_stream) -> float:
    """Aggregate tokens/s of ``count`` concurrent streams, each with its own prompt."""
    results: list[dict] = []
    threads = [threading.Thread(target=lambda i=i: results.append(
        one_stream(url, tokens, f"Story {i}: once", ignore_eos=True))) for i in range(count)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sum(r["completion_tokens"] for r in results) / (time.perf_counter() - started)


def conversations_cached(url: str, label: str, chat_turn) -> float:
    """Six conversations of three turns, in turn; the share of later turns' prompts served from a cache."""
    documents = [f"A document about {topic} ({label}). " + " ".join(
        f"Fact {i} about {topic} is worth knowing." for i in range(70)) for topic in TOPICS]
    history = [[{"role": "user", "content": f"{doc}\n\n{ASKS[0]}"}] for doc in documents]
    prompt = cached = 0
    for turn in range(3):
        # Each turn starts one conversation later: with round robin over two workers, a conversation's next turn
        # then goes to the other worker (in one order, six conversations would keep each on one worker).
        for messages in history[turn:] + history[:turn]:
            result = chat_turn(url, messages)
            if turn:
                prompt += result["prompt_tokens"]
                cached += result["cached_tokens"]
            messages += [{"role": "assistant", "content": result["text"]},
                         {"role": "user", "content": ASKS[turn + 1] if turn < 2 else "Thank you."}]
    return cached / prompt


def _front_env(worker_urls: Sequence[str], policy: str = "cache_aware") -> dict:
    """`kronk-wsgi serve` with the model's replies from ``worker_urls`` (the grpc engine)."""
    options = {"workers": list(worker_urls), "policy": policy}
    return {"KRONK_MODELS": json.dumps({"bench": {"path": str(fetch_smollm2()), "engine": "grpc",
                                                  "engine_options": options}})}


def grpc_side_by_side(tokens: int, rounds: int, one_stream, chat_turn,
                      worker_urls: Optional[Sequence[str]] = None) -> list[tuple[str, str]]:
    workdir = ROOT / "bench" / "results" / "grpc"
    workdir.mkdir(parents=True, exist_ok=True)
    env = {"KRONK_MODELS": json.dumps({"bench": {"path": str(fetch_smollm2()), "engine": "llama.cpp"}}),
           "KRONK_THREADS": 1, "KRONK_PARALLEL": 1}
    with contextlib.ExitStack() as stack:
        if worker_urls is None:
            for name in ("a", "b"):  # no prompt-cache entry of an earlier run may serve this one
                shutil.rmtree(workdir / name / "cache", ignore_errors=True)
            workers = [stack.enter_context(run_grpc_worker(workdir / name, env)) for name in ("a", "b")]
            worker_urls = [w.url for w in workers]
        http = stack.enter_context(run_server(workdir, env))
        front = stack.enter_context(run_server(workdir, _front_env(worker_urls[:1])))
        one = stack.enter_context(run_smg(worker_urls[:1], "bench", ["--policy", "round_robin"],
                                          log=workdir / "smg-one.log"))
        both = stack.enter_context(run_smg(worker_urls, "bench", ["--policy", "round_robin"],
                                           log=workdir / "smg-both.log"))
        urls = {"kronk HTTP": http.url, "kronk -> kronk gRPC": front.url, "SMG -> kronk gRPC": one}
        for url in (*urls.values(), both):
            one_stream(url, 20, "warm up", ignore_eos=True)
        runs: dict[str, list[dict]] = {name: [] for name in urls}
        for round_ in range(rounds):
            for name in (list(urls) if round_ % 2 == 0 else list(reversed(urls))):
                runs[name].append(one_stream(urls[name], tokens, f"Tell a story, round {round_}.",
                                                 ignore_eos=True))
        aggregate = {"one": [], "two": []}
        for round_ in range(max(2, rounds // 2)):
            for name in (("one", "two") if round_ % 2 == 0 else ("two", "one")):
                aggregate[name].append(streams_at_once(one if name == "one" else both, tokens, 2, one_stream))
        shares = {}
        for policy in ("cache_aware", "round_robin"):
            with run_smg(worker_urls, "bench", ["--policy", policy], log=workdir / f"smg-{policy}.log") as url:
                shares[f"SMG {policy}"] = conversations_cached(url, f"SMG {policy}", chat_turn)
            with run_server(workdir, _front_env(worker_urls, policy)) as server:
                shares[f"kronk {policy}"] = conversations_cached(server.url, f"kronk {policy}", chat_turn)
    (workdir / "latest.json").write_text(json.dumps({"runs": runs, "aggregate": aggregate, "shares": shares},
                                                    indent=2))

    def median(name: str, key: str) -> float:
        return statistics.median(run[key] for run in runs[name])

    direct = "kronk HTTP"
    ratios = [(f"{way} / HTTP, tokens/s, time to first token",
               f"{median(way, 'tokens_per_s') / median(direct, 'tokens_per_s'):.3f}, "
               f"{median(way, 'ttft_s') / median(direct, 'ttft_s'):.3f}") for way in urls if way != direct]
    return [
        *[(f"{name}: tokens/s, time to first token ms", f"{median(name, 'tokens_per_s'):.1f}, "
           f"{1000 * median(name, 'ttft_s'):.1f}") for name in urls],
        *ratios,
        ("2 streams through SMG, aggregate tokens/s: 1 worker, 2 workers",
         f"{statistics.median(aggregate['one']):.1f}, {statistics.median(aggregate['two']):.1f}"),
        ("2 workers / 1 worker", f"{statistics.median(aggregate['two']) / statistics.median(aggregate['one']):.2f}x"),
        *[(f"six conversations, {way}: later turns' prompt served from a cache", f"{100 * share:.0f}%")
          for way, share in shares.items()],
    ]
