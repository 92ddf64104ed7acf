"""Server-Sent Events framing and the streaming response."""

import json
from typing import Iterable, Optional

from flask import Response

KEEPALIVE_COMMENT = ": keep-alive\n\n"
DONE = "data: [DONE]\n\n"
_compact_json = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode  # one, not one per frame


def sse(data: dict, event: Optional[str] = None) -> str:
    """One SSE frame with a compact JSON payload."""
    payload = _compact_json(data)
    return f"event: {event}\ndata: {payload}\n\n" if event else f"data: {payload}\n\n"


def event_stream(frames: Iterable[str]) -> Response:
    """The commit: 200, text/event-stream, no caching, no proxy buffering."""
    response = Response(frames, status=200, mimetype="text/event-stream")
    response.headers["Cache-Control"] = "no-cache"
    response.headers["X-Accel-Buffering"] = "no"
    return response
