"""Mistral's ``[TOOL_CALLS]``: a JSON list of calls to the end of the reply (v3: Mistral Nemo, 7B v0.3), or,
from the v11 tokenizer on, ``[TOOL_CALLS]name[ARGS]{...}`` for each call, with an optional
``[CALL_ID]id`` before ``[ARGS]`` (Mistral Small 3.2, Devstral, Magistral, Ministral 3)."""

import json
import re
from typing import Optional

from .base import JSON_HEAD, Call, CallFormat, Schemas, Streaming, json_calls, named_call

_CALL = re.compile(r"\s*(?P<name>[^\[\]\s]+)\s*(?:\[CALL_ID\][^\[]*)?\[ARGS\]")


def _named_calls(body: str, _schemas: Schemas) -> Optional[list[Call]]:
    """``name[ARGS]{...}`` calls, each after the first opened by ``[TOOL_CALLS]``."""
    calls = []
    decoder = json.JSONDecoder()
    for part in body.split("[TOOL_CALLS]"):
        head = _CALL.match(part)
        if head is None:
            return None
        try:
            arguments, at = decoder.raw_decode(part, head.end())
        except ValueError:
            return None
        call = named_call(head.group(1), arguments)
        if call is None or part[at:].strip():
            return None
        calls.append(call)
    return calls or None


V3 = CallFormat(
    name="mistral-v3",
    markers=("[TOOL_CALLS]",),
    opens=("[TOOL_CALLS]",),
    close=None,
    parse=json_calls,
    start="[TOOL_CALLS][",
    head=lambda name: f'{{"name": {json.dumps(name)}, "arguments": ',
    tail="}",
    between=", ",
    end="]",
    tags=("[TOOL_CALLS]",),
    streaming=Streaming(JSON_HEAD),
)

V11 = CallFormat(
    name="mistral-v11",
    markers=("[TOOL_CALLS]", "[ARGS]"),
    opens=("[TOOL_CALLS]",),
    close=None,
    parse=_named_calls,
    start="[TOOL_CALLS]",
    head=lambda name: f"{name}[ARGS]",
    between="[TOOL_CALLS]",
    tags=("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"),
    streaming=Streaming(re.compile(r"\s*(?:\[TOOL_CALLS\])?" + _CALL.pattern + r"\s*")),
)
