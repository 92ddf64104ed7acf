"""Functionary v3.1: ``<function=name>{...}</function>`` for each call.

Functionary v3.2: a reply of messages, each ``>>>`` (the prompt writes the first), its recipient, a newline,
then its text: to ``all`` it is the answer; to a tool, a call with its arguments' JSON.
"""

import json
import re
import uuid
from typing import Optional

from ...engine.generate import partial_tag
from ..events import TextDelta, ToolCall
from .base import Call, CallFormat, CallReader, Event, MessageCall, Schemas, Streaming, ToolCallRules, named_call


def _calls(body: str, _schemas: Schemas) -> Optional[list[Call]]:
    name, found, arguments = body.partition(">")
    if not found or not name.strip() or "\n" in name:
        return None
    try:
        value = json.loads(arguments)
    except ValueError:
        return None
    call = named_call(name.strip(), value)
    return [call] if call is not None else None


V3_1 = CallFormat(
    name="functionary-v3.1",
    markers=("<function=", "python_tag"),
    opens=("<function=",),
    close="</function>",
    parse=_calls,
    start="<function=",
    head=lambda name: f"{name}>",
    between="</function><function=",
    end="</function>",
    streaming=Streaming(re.compile(r"\s*(?P<name>[^>\n]+)>\s*")),
)


SEND, ALL = ">>>", "all"


class _V3_2Reader(CallReader):
    """Reads a Functionary v3.2 reply message by message: the answer streams, and so does a call, as its JSON
    comes. A message to no tool on offer is text, its header with it."""

    frames_replies = True  # the answer's header is left out
    streams_calls = True

    def __init__(self, rules: ToolCallRules) -> None:
        super().__init__(rules)
        self._recipient: Optional[str] = None  # None: reading a message's header
        self._streamed: Optional[MessageCall] = None  # the message's call, if it is one to start as it is written

    def feed(self, text: str) -> list[Event]:
        self._pending += text
        out: list[Event] = []
        while True:
            if self._recipient is None:
                head, found, rest = self._pending.partition("\n")
                if not found:
                    return out
                self._recipient, self._pending = head.strip(), rest
                if self._recipient not in self.rules.schemas and self._recipient != ALL:
                    self._text(head + "\n", out)  # not a recipient: the model wrote text
                    self._recipient = ALL
                self._streamed = MessageCall(self._recipient) if self.may_start(self._recipient) else None
                continue
            at = self._pending.find(SEND)
            if at < 0:
                if self._recipient == ALL:
                    cut = len(self._pending) - partial_tag(self._pending, (SEND,))
                    self._text(self._pending[:cut], out)
                    self._pending = self._pending[cut:]
                elif self._streamed is not None:
                    self._calls(self._streamed.read(self._pending), out)
                return out
            body, self._pending = self._pending[:at], self._pending[at + len(SEND):]
            self._end_message(body, out)

    def flush(self, cut: bool = False) -> list[Event]:
        out: list[Event] = []
        pending, self._pending = self._pending, ""
        if self._recipient is None:
            self._text(pending, out)
        else:
            self._end_message(pending, out, cut)
        if self._space and not self._after_call:
            out.append(TextDelta(self._space))
        self._space = ""
        return out

    def _end_message(self, body: str, out: list, cut: bool = False) -> None:
        recipient, self._recipient = self._recipient, None
        streamed, self._streamed = self._streamed, None
        if recipient == ALL:
            self._text(body, out)
            return
        call = named_call(recipient, body.strip() or "{}")
        if streamed is not None:
            self._calls(streamed.read(body), out)
            if streamed.id is not None:
                self._calls([streamed.end(call, cut)], out)
                return
        if call is not None and self.rules.accept(call.name, call.arguments):
            out.append(ToolCall(uuid.uuid4().hex[:24], call.name, json.dumps(call.arguments, ensure_ascii=False)))
            self.calls += 1
            self._after_call, self._space = True, ""
        elif cut:
            out.append(ToolCall(uuid.uuid4().hex[:24], recipient, body.strip(), complete=False))
            self.calls += 1
        else:
            self._text(f"{recipient}\n{body}", out)


V3_2 = CallFormat(
    name="functionary-v3.2",
    markers=(">>>all",),
    opens=(SEND,),
    close=None,
    parse=lambda body, schemas: None,  # its reader reads the messages
    start="",  # the prompt ends with the first message's >>>
    head=lambda name: f"{name}\n",
    between=SEND,
    reader=_V3_2Reader,
)
