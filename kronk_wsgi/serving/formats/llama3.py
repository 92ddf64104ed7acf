"""Llama 3.1-3.3: a reply that is one JSON object ``{"name": ..., "parameters": {...}}`` is a call, as is
the JSON after ``<|python_tag|>``."""

import json

from .base import JSON_HEAD, CallFormat, Streaming, json_calls

FORMAT = CallFormat(
    name="llama3-json",
    markers=("<|start_header_id|>", '"parameters": '),
    opens=("<|python_tag|>",),
    close=None,
    parse=json_calls,
    start="",
    head=lambda name: f'{{"name": {json.dumps(name)}, "parameters": ',
    tail="}",
    between="; ",
    reply_json=True,
    tags=("<|python_tag|>",),
    streaming=Streaming(JSON_HEAD),
)
