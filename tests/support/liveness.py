"""The event loop's liveness while a request runs: /v1/liveness polled from another thread."""

import threading
import time
from typing import Callable, TypeVar

import requests

T = TypeVar("T")


def liveness_during(server, send: Callable[[], T]) -> tuple[T, float]:
    """What ``send()`` gives, and the slowest liveness answer while it ran."""
    latencies: list[float] = []
    done = []

    def probe() -> None:
        while not done:
            started = time.monotonic()
            requests.get(server.url + "/v1/liveness", timeout=60)
            latencies.append(time.monotonic() - started)
            time.sleep(0.02)

    prober = threading.Thread(target=probe)
    prober.start()
    try:
        reply = send()
    finally:
        done.append(True)
        prober.join()
    return reply, max(latencies)
