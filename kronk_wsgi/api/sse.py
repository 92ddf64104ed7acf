"""Server-Sent Events frames."""

import json
from typing import Optional

DONE = "data: [DONE]\n\n"
compact_json = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode  # one, not one per frame


def sse(data: dict, event: Optional[str] = None) -> str:
    """One SSE frame with a compact JSON payload."""
    payload = compact_json(data)
    return f"event: {event}\ndata: {payload}\n\n" if event else f"data: {payload}\n\n"
