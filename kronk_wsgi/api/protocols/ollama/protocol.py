"""The Ollama API's protocol: its blueprint, its NDJSON framing, its error shape, its paths and its root probe."""

import datetime
import time

from flask import Blueprint, Response

from ...protocol import Framing, Protocol
from ...sse import compact_json

# A line every Ollama client reads as "nothing new yet": a reply's delta with no text.
KEEPALIVE = '{"message":{"role":"assistant","content":""},"response":"","done":false}\n'
NDJSON = Framing("application/x-ndjson", KEEPALIVE)

bp = Blueprint("ollama", __name__)


def running() -> Response:
    """GET / : the probe Ollama's clients make before anything else."""
    return Response("Ollama is running", mimetype="text/plain")


PROTOCOL = Protocol(
    "ollama", bp, prefixes=("/api/",), error_body=lambda error: {"error": error.message}, framing=NDJSON,
    open_paths=("/",), unknown_below=("/api/",), root=running,
    # What changes the models on disk, as the admin API does: behind the admin keys.
    admin_paths=("/api/pull", "/api/delete", "/api/copy", "/api/create", "/api/push", "/api/blobs/"),
)


def line(obj: dict) -> str:
    """One NDJSON line."""
    return compact_json(obj) + "\n"


def timestamp(seconds: float | None = None) -> str:
    """A time (now by default) as Ollama writes times."""
    when = datetime.datetime.fromtimestamp(time.time() if seconds is None else seconds, datetime.timezone.utc)
    return when.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def nanoseconds(seconds: float) -> int:
    """A duration as Ollama counts durations."""
    return int(seconds * 1e9)
