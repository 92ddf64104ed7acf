"""Server-Sent Events frames."""

import json
from typing import Any, Iterator, Optional

DONE = "data: [DONE]\n\n"
compact_json = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode  # one, not one per frame


def compact_json_pieces(value: Any, depth: int = 5) -> Iterator[str]:
    """compact_json(value) in pieces: containers down to ``depth`` are walked here, and only what lies below is
    encoded by one call each. The encoder holds the GIL for a whole call: for an answer of tens of megabytes,
    one call would stall every other thread (the event loop's) for seconds."""
    if depth and isinstance(value, dict) and value:
        opening = "{"
        for key, item in value.items():
            yield opening + compact_json(str(key)) + ":"
            yield from compact_json_pieces(item, depth - 1)
            opening = ","
        yield "}"
    elif depth and isinstance(value, (list, tuple)) and value:
        opening = "["
        for item in value:
            yield opening
            yield from compact_json_pieces(item, depth - 1)
            opening = ","
        yield "]"
    else:
        yield compact_json(value)


def sse(data: dict, event: Optional[str] = None) -> str:
    """One SSE frame with a compact JSON payload."""
    payload = compact_json(data)
    return f"event: {event}\ndata: {payload}\n\n" if event else f"data: {payload}\n\n"
