"""A model in a runner process against the same model inline, and against llama-server, side by side.

SmolLM2 on llama.cpp, 4 slots, two cores. Servers: inline with one worker (4 slots, 2 threads), inline with two
workers (2 slots and 1 thread each), a runner behind one worker and behind two (the runner's 4 slots, 2 threads),
and llama-server (-np 4 -t 2) if given. In turns, order alternating each round: one stream of ``tokens`` (tokens/s,
time to first token), four streams at once (aggregate tokens/s), a ~1,100-token prompt and then the same prompt
plus a few words sent as soon as the answer arrived (the next turn's time to first token), and the resident
memory of the server's processes (gunicorn's workers, the runner). Then six conversations of three turns behind two
workers with two slots in all, through a runner and inline (the share of later turns read from a cache). ``bench/run.py --runner [--tokens 200]
[--rounds 3] [--llama-server PATH]`` runs it.
"""

import contextlib
import json
import os
import shutil
import statistics
from pathlib import Path
from typing import Callable, Optional

from grpc_worker import conversations_cached, streams_at_once
from kronk_wsgi.testing import fetch_smollm2, run_llama_server, run_server

ROOT = Path(__file__).resolve().parent.parent
CONTEXT = 4096


def _resident_mb(server_pid: int, runner_dir: Optional[Path]) -> float:
    """Resident memory of a server's worker processes and of the runners in ``runner_dir``, MB."""
    total = 0
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            status = Path(f"/proc/{name}/status").read_text()
            command = Path(f"/proc/{name}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        child = int(fields["PPid"]) == server_pid
        runner = runner_dir is not None and str(runner_dir) in command
        if child or runner:
            total += int(fields.get("VmRSS", "0 kB").split()[0])
    return total / 1000


def _conversations_on_two_slots(workdir: Path, model: dict, chat_turn: Callable) -> dict[str, float]:
    """Six conversations of three turns behind two gunicorn workers with two slots in all, through a runner and
    inline: the share of later turns' prompts served from a cache, by server."""
    configs = {
        "runner": {"KRONK_MODELS": json.dumps({"bench": {**model, "runner": "process"}}), "KRONK_PARALLEL": 2,
                   "KRONK_THREADS": 2, "KRONK_RUNNER_DIR": str(workdir / "runner-dir-conversations")},
        "inline": {"KRONK_MODELS": json.dumps({"bench": model}), "KRONK_PARALLEL": 1, "KRONK_THREADS": 1},
    }
    shares = {}
    for name, env in configs.items():
        folder = workdir / f"conversations, {name}"
        folder.mkdir()
        with run_server(folder, {**env, "KRONK_WORKERS": 2, "KRONK_PROMPT_CACHE_DIR": str(folder / "prompt-cache")}
                        ) as server:
            shares[name] = conversations_cached(server.url, name, chat_turn)
    return shares


def runners_side_by_side(tokens: int, rounds: int, llama_server: Optional[str], one_stream: Callable,
                         chat_turn: Callable) -> list[tuple[str, str]]:
    path = fetch_smollm2()
    workdir = ROOT / "bench" / "results" / "runners"
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    model = {"path": str(path), "engine": "llama.cpp", "context_length": CONTEXT}
    configs = {
        "inline, 1 worker": {"KRONK_MODELS": json.dumps({"bench": model}), "KRONK_PARALLEL": 4, "KRONK_THREADS": 2},
        "inline, 2 workers": {"KRONK_MODELS": json.dumps({"bench": model}), "KRONK_PARALLEL": 2, "KRONK_THREADS": 1,
                              "KRONK_WORKERS": 2},
        "runner, 1 worker": {"KRONK_MODELS": json.dumps({"bench": {**model, "runner": "process"}}),
                             "KRONK_PARALLEL": 4, "KRONK_THREADS": 2, "KRONK_RUNNER_DIR": str(workdir / "runner-dir-1")},
        "runner, 2 workers": {"KRONK_MODELS": json.dumps({"bench": {**model, "runner": "process"}}),
                              "KRONK_PARALLEL": 4, "KRONK_THREADS": 2, "KRONK_WORKERS": 2,
                              "KRONK_RUNNER_DIR": str(workdir / "runner-dir-2")},
    }
    results: dict[str, dict[str, list[float]]] = {}
    with contextlib.ExitStack() as stack:
        urls, memory = {}, {}
        for name, env in configs.items():
            (workdir / name).mkdir()
            server = stack.enter_context(run_server(workdir / name, {
                **env, "KRONK_PROMPT_CACHE_DIR": str(workdir / name / "prompt-cache")}))
            urls[name] = server.url
            memory[name] = (server.proc.pid, Path(env["KRONK_RUNNER_DIR"]) if "KRONK_RUNNER_DIR" in env else None)
        if llama_server:
            urls["llama-server"] = stack.enter_context(
                run_llama_server(llama_server, path, ["-np", "4", "-t", "2", "-c", str(CONTEXT * 4)]))
        for url in urls.values():
            chat_turn(url, [{"role": "user", "content": "Hello"}], 2)
        for round_ in range(rounds):
            document = f"Notes, round {round_}. " + " ".join(
                f"Fact {i} about lighthouses is worth knowing." for i in range(110))
            order = list(urls) if round_ % 2 == 0 else list(reversed(urls))
            for name in order:
                url, measured = urls[name], results.setdefault(name, {})
                stream = one_stream(url, tokens, f"Round {round_}: once", ignore_eos=True)
                measured.setdefault("tokens_per_s", []).append(stream["tokens_per_s"])
                measured.setdefault("ttft_s", []).append(stream["ttft_s"])
                measured.setdefault("four_streams", []).append(streams_at_once(url, tokens, 4, one_stream))
                chat_turn(url, [{"role": "user", "content": document}], 4)
                then = chat_turn(url, [{"role": "user", "content": document + " and more"}], 4)
                measured.setdefault("next_turn_s", []).append(then["ttft_s"])
        for name, (pid, runner_dir) in memory.items():
            results[name]["resident_mb"] = [_resident_mb(pid, runner_dir)]
    shares = _conversations_on_two_slots(workdir, model, chat_turn)
    (workdir / "latest.json").write_text(json.dumps(results, indent=2))
    median = {name: {key: statistics.median(values) for key, values in measured.items()}
              for name, measured in results.items()}
    rows = [(f"{name}: one stream tokens/s, first token s, 4 streams tokens/s, next turn s, resident MB",
             f"{m['tokens_per_s']:.1f}, {m['ttft_s']:.3f}, {m['four_streams']:.1f}, {m['next_turn_s']:.3f}, "
             + (f"{m['resident_mb']:.0f}" if "resident_mb" in m else "-"))
            for name, m in median.items()]
    runner, inline1, inline2 = median["runner, 2 workers"], median["inline, 1 worker"], median["inline, 2 workers"]
    rows += [
        ("runner / inline (1 worker): one stream tokens/s (goal: overhead <= 3%)",
         f"{runner['tokens_per_s'] / inline1['tokens_per_s']:.3f}"),
        ("runner / inline (2 workers): 4 streams tokens/s", f"{runner['four_streams'] / inline2['four_streams']:.2f}"),
        ("runner / inline (2 workers): next turn's first token", f"{runner['next_turn_s'] / inline2['next_turn_s']:.2f}"),
        ("runner + 2 workers / 2 inline workers: resident memory",
         f"{runner['resident_mb'] / inline2['resident_mb']:.2f}"),
    ]
    rows += [("runner, 2 workers / runner, 1 worker: 4 streams tokens/s",
              f"{runner['four_streams'] / median['runner, 1 worker']['four_streams']:.2f}")]
    rows += [(f"six conversations on 2 slots, {name}: later turns' prompt served from a cache (goal >= 95%)",
              f"{100 * share:.0f}%") for name, share in shares.items()]
    if llama_server:
        server = median["llama-server"]
        for name in configs:
            rows += [(f"{name} / llama-server: 4 streams tokens/s, next turn's first token",
                      f"{median[name]['four_streams'] / server['four_streams']:.2f}, "
                      f"{median[name]['next_turn_s'] / server['next_turn_s']:.2f}")]
    return rows
