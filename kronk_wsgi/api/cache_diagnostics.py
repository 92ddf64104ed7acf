"""Anthropic's cache diagnostics: why a request's prompt could not reuse the prefix of the one before it.

A request that sends ``diagnostics`` has its fingerprint kept (digests of its model, tools, system and each
message, with their sizes) in the response store, under its message's id, so every worker sees it; one that
names ``previous_message_id`` is compared with that one's, in the order the prompt is built (tools, then the
system, then the messages), and its message says what changed first. A prompt that only appends messages to
the earlier one has nothing to report (null). Token counts are estimates, four characters a token.
"""

import hashlib
import json
from typing import Any, Optional

import structlog

from ..serving import offload
from .state import record, state

log = structlog.get_logger("kronk_wsgi.anthropic")

CHARS_PER_TOKEN = 4


def _digest(value: Any) -> tuple[str, int]:
    text = json.dumps(value, sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()[:32], len(text) // CHARS_PER_TOKEN


def fingerprint(body: Any) -> dict:
    """What of a Messages request decides its prompt's prefix: digests, and estimated tokens of each part."""
    tools, tools_size = _digest([tool.model_dump(mode="json", exclude_none=True) for tool in body.tools or ()])
    system = body.system if isinstance(body.system, str) or body.system is None else \
        [block.model_dump(mode="json", exclude_none=True) for block in body.system]
    system, system_size = _digest(system)
    messages = [_digest(message.model_dump(mode="json", exclude_none=True)) for message in body.messages]
    return {"model": [body.model, body.speed], "tools": tools, "system": system,
            "messages": [digest for digest, _ in messages],
            "sizes": [tools_size, system_size] + [size for _, size in messages]}


def diagnosis(previous: Optional[dict], current: dict) -> Optional[dict]:
    """The cache_miss_reason of ``current`` after ``previous`` (None: nothing diverged)."""
    if previous is None:
        return {"type": "previous_message_not_found"}
    whole = sum(previous["sizes"])
    for part in ("model", "tools", "system"):
        if previous[part] != current[part]:
            return {"type": f"{part}_changed", "cache_missed_input_tokens": whole}
    earlier, now = previous["messages"], current["messages"]
    first = next((i for i, (a, b) in enumerate(zip(earlier, now)) if a != b), min(len(earlier), len(now)))
    if first < len(earlier):  # not only appended to: what followed the change had to be evaluated again
        return {"type": "messages_changed", "cache_missed_input_tokens": sum(previous["sizes"][2 + first:])}
    return None


def diagnose(body: Any, message_id: str) -> Optional[dict]:
    """Keep this request's fingerprint and compare it with the previous message's: the message's
    ``diagnostics`` (None: nothing diverged)."""
    kronk, owner = state(), record().owner
    current = offload.call(kronk.body_thread, fingerprint, body)  # digests of the whole conversation
    previous_id = body.diagnostics.previous_message_id
    try:
        previous = (offload.call(kronk.store_thread, kronk.responses.fingerprint, previous_id, owner)
                    if previous_id is not None else None)
        offload.call(kronk.store_thread, kronk.responses.put_fingerprint, message_id, owner, current)
    except Exception as exc:  # sqlite3's and the file system's errors: the request is served all the same
        log.error("cache diagnostics not kept", message_id=message_id, error=f"{type(exc).__name__}: {exc}")
        return {"cache_miss_reason": {"type": "unavailable"}}
    if previous_id is None:
        return None  # the first turn: opted in, nothing to compare with
    reason = diagnosis(previous, current)
    return None if reason is None else {"cache_miss_reason": reason}
