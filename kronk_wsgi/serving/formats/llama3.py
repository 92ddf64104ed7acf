"""Llama 3.1-3.3: a reply that is one JSON object ``{"name": ..., "parameters": {...}}`` is a call, as is
the JSON after ``<|python_tag|>``."""

import json

from .base import JSON_HEAD, CallFormat, CallReader, Event, Streaming, json_calls


class _JsonReplyReader(CallReader):
    """A reply that begins with a JSON object is calls, to its end; any other is read as CallReader reads it."""

    def __init__(self, rules) -> None:
        super().__init__(rules)
        self._at_start = True

    def feed(self, text: str) -> list[Event]:
        if not self._at_start:
            return super().feed(text)
        self._pending += text
        head = self._pending.lstrip()
        if not head:
            return []
        self._at_start = False
        pending, self._pending = self._pending, ""
        if head.startswith("{"):
            self._opened, pending = "", head  # calls with no opening
        return super().feed(pending)

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
    tags=("<|python_tag|>",),
    streaming=Streaming(JSON_HEAD),
    reader=_JsonReplyReader,
)
