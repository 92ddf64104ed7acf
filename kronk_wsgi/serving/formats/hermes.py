"""Hermes: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, one element per call (Qwen 2.5
and 3, Hermes 2 and 3, Granite 4, SmolLM3, and the built-in ChatML template)."""

import json

from .base import JSON_HEAD, CallFormat, Streaming, json_calls

FORMAT = CallFormat(
    name="hermes",
    markers=("<tool_call>",),
    opens=("<tool_call>",),
    close="</tool_call>",
    parse=json_calls,
    start="<tool_call>\n",
    head=lambda name: f'{{"name": {json.dumps(name)}, "arguments": ',
    tail="}",
    between="\n</tool_call>\n<tool_call>\n",
    end="\n</tool_call>",
    raw_inputs=True,
    tags=("<tool_call>", "</tool_call>"),
    streaming=Streaming(JSON_HEAD),
)
