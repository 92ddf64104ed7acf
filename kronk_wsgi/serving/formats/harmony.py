"""gpt-oss's Harmony: a reply is a run of messages, each ``<|channel|>name`` (with `` to=functions.x``
when it is a call, in its header or its channel's), ``<|message|>``, the text, then ``<|end|>`` (another
message follows, after ``<|start|>assistant``), ``<|call|>`` or ``<|return|>``.

The ``analysis`` channel is the model's reasoning, a message to ``functions.x`` is a call of the tool x
(its text the arguments' JSON), and any other message (``final``, ``commentary``) is the answer. A message
to a recipient the request offers no tool for (gpt-oss's built-in ``python`` or ``browser``) is left out,
as llama-server leaves it out.
"""

import json
import re
import uuid
from typing import Optional

from ...engine.generate import partial_tag
from ..events import ReasoningDelta, TextDelta, ToolCall
from .base import CallFormat, CallReader, Event, ToolCallRules, named_call

MESSAGE, ENDS, START = "<|message|>", ("<|end|>", "<|call|>", "<|return|>"), "<|start|>"
_CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")
_NOT_TOOLS = ("assistant", "user")  # recipients that are not calls
_RECIPIENT = re.compile(r"\bto=(?:functions\.)?([^\s<]+)")


class HarmonyReader(CallReader):
    """Splits a streamed Harmony reply into reasoning, answer and calls."""

    def __init__(self, rules: ToolCallRules) -> None:
        super().__init__(rules)
        self._header: Optional[str] = ""  # the current message's header so far; None once it is complete
        self._channel = ""
        self._recipient: Optional[str] = None
        self._arguments = ""

    def feed(self, text: str) -> list[Event]:
        self._pending += text
        out: list[Event] = []
        while True:
            if self._header is not None:
                at = self._pending.find(MESSAGE)
                if at < 0:
                    return out
                header, self._pending = self._pending[:at], self._pending[at + len(MESSAGE):]
                channels = _CHANNEL.findall(header)
                recipient = _RECIPIENT.search(header)
                self._channel = channels[-1] if channels else ""
                self._recipient = recipient.group(1) if recipient and recipient.group(1) not in _NOT_TOOLS else None
                self._header, self._arguments = None, ""
                continue
            found = [(at, end) for end in ENDS + (START,) if (at := self._pending.find(end)) >= 0]
            if not found:
                cut = len(self._pending) - partial_tag(self._pending, ENDS + (START,))
                self._content(self._pending[:cut], out)
                self._pending = self._pending[cut:]
                return out
            at, end = min(found)
            self._content(self._pending[:at], out)
            self._pending = self._pending[at + len(end):].removeprefix("assistant" if end == START else "")
            self._end_message(out)

    def flush(self, cut: bool = False) -> list[Event]:
        out: list[Event] = []
        pending, self._pending = self._pending, ""
        if self._header is None:
            self._content(pending, out)
            self._end_message(out, cut)
        elif pending.strip():  # a reply that never wrote a header: its text is the answer
            self._text(pending, out)
        if self._space and not self._after_call:
            out.append(TextDelta(self._space))
        self._space = ""
        return out

    def _content(self, text: str, out: list) -> None:
        if not text:
            return
        if self._recipient is not None:
            self._arguments += text
        elif self._channel == "analysis":
            out.append(ReasoningDelta(text))
        else:
            self._text(text, out)

    def _end_message(self, out: list, cut: bool = False) -> None:
        if self._recipient is not None:
            name, arguments = self._recipient, self._arguments
            call = named_call(name, arguments.strip() or "{}")
            if call is not None and self.rules.accept(call.name, call.arguments):
                out.append(ToolCall(uuid.uuid4().hex[:24], name, json.dumps(call.arguments, ensure_ascii=False)))
                self.calls += 1
                self._after_call = True
            elif cut and name in self.rules.schemas:
                out.append(ToolCall(uuid.uuid4().hex[:24], name, arguments.strip(), complete=False))
                self.calls += 1
            # else a call of a tool not on offer (a built-in one, python or the browser): left out
        self._header, self._recipient, self._channel, self._arguments = "", None, "", ""


class _Harmony(CallFormat):
    def reader(self, rules: ToolCallRules) -> CallReader:
        return HarmonyReader(rules)


FORMAT = _Harmony(
    name="harmony",
    markers=("<|channel|>", "<|message|>"),
    opens=(" to=functions.",),  # where a call begins to be held to its tool's schema
    close=None,
    parse=lambda body, schemas: None,  # HarmonyReader reads the messages
    start="<|channel|>commentary to=functions.",
    head=lambda name: f"{name} <|constrain|>json<|message|>",
    tail="<|call|>",
    between="<|start|>assistant<|channel|>commentary to=functions.",
    reads_reasoning=True,
    tags=("<|channel|>", "<|message|>", "<|constrain|>", "<|end|>", "<|call|>", "<|return|>", "<|start|>"),
)
