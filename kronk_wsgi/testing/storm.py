"""Eight maximal request bodies at once, while one unrelated stream runs and liveness is polled.

Used by the hardening test (generous bounds: the worker survives, the stream ends
properly) and by bench/run.py --storm (the figures: liveness p99, largest stream gap).
"""

import json
import subprocess
import sys
import threading
import time

import requests

from .rawhttp import RawStream

MAX_BODY = 8 * 1024 * 1024

POLLER = """
import json, sys, threading, time, requests
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.readline(), stop.set()), daemon=True).start()
session, latencies = requests.Session(), []
while not stop.is_set():
    started = time.monotonic()
    session.get(sys.argv[1] + "/v1/liveness", timeout=60)
    latencies.append(time.monotonic() - started)
    time.sleep(0.01)
print(json.dumps(latencies))
"""


def maximal_bodies(model: str) -> list[bytes]:
    """The expensive shapes a body under 8 MB can take, two of each."""
    tiny_messages = {"model": model, "messages": [{"role": "user", "content": "hi"}] * 230_000}
    huge_message = {"model": model, "messages": [{"role": "user", "content": "word " * (MAX_BODY // 5 - 100)}]}
    many_values = {"model": model, "max_tokens": 1,
                   "messages": [{"role": "user", "content": f"message {i}"} for i in range(6_000)]}
    huge_tool = {"model": model, "messages": [{"role": "user", "content": "hi"}], "tools": [{
        "type": "function", "function": {"name": "f", "description": "d " * (MAX_BODY // 2 - 1000)}}]}
    shapes = [tiny_messages, huge_message, many_values, huge_tool]
    return [json.dumps(shape).encode() for shape in shapes for _ in range(2)]


def storm(url: str, host: str, port: int, stream_body: dict) -> dict:
    """Run the storm against a server; return what happened."""
    stream = RawStream(host, port, "/v1/chat/completions", stream_body)
    arrivals: list[float] = []
    frames: list[str] = []

    def read_stream() -> None:
        for arrived, frame in stream.frames():
            arrivals.append(arrived)
            frames.append(frame)

    reader = threading.Thread(target=read_stream)
    reader.start()
    statuses: list = []

    def post(body: bytes) -> None:
        try:
            response = requests.post(url + "/v1/chat/completions", data=body, timeout=120,
                                     headers={"Content-Type": "application/json"})
            statuses.append(response.status_code)
        except requests.RequestException as exc:
            statuses.append(repr(exc))

    posters = [threading.Thread(target=post, args=(body,)) for body in maximal_bodies(stream_body["model"])]
    started = time.monotonic()
    for poster in posters:
        poster.start()
    # Liveness is polled from a process of its own: this one is busy sending 64 MB.
    poller = subprocess.Popen([sys.executable, "-c", POLLER, url], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    for poster in posters:
        poster.join()
    storm_seconds = time.monotonic() - started
    latencies = json.loads(poller.communicate("stop\n", timeout=120)[0])
    reader.join(timeout=120)
    stream.close()
    latencies.sort()
    during = [t for t in arrivals if t <= started + storm_seconds] or arrivals
    gaps = [b - a for a, b in zip(during, during[1:])]
    return {
        "statuses": statuses, "frames": frames, "storm_seconds": storm_seconds,
        "liveness_p99_s": latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))] if latencies else None,
        "liveness_max_s": latencies[-1] if latencies else None, "liveness_samples": len(latencies),
        "largest_stream_gap_s": max(gaps, default=0.0),
    }
