"""gpt-oss's Harmony: a reply is a run of messages, each ``<|channel|>name`` (with `` to=functions.x``
when it is a call, in its header or its channel's), ``<|message|>``, the text, then ``<|end|>`` (another
message follows, after ``<|start|>assistant``), ``<|call|>`` or ``<|return|>``.

The ``analysis`` channel is the model's reasoning, a message to ``functions.x`` is a call of the tool x
(its text the arguments' JSON), and any other message (``final``, ``commentary``) is the answer. A message
to a recipient the request offers no tool for (gpt-oss's built-in ``python`` or ``browser``) is left out,
as llama-server leaves it out.

Muse Glimmer's ATEM has the same frame without channels (see ``MUSE``).
"""

import json
import re
import uuid
from typing import Optional

from ...engine.generate import partial_tag
from ..events import ReasoningDelta, TextDelta, ToolCall
from .base import Call, CallFormat, CallReader, Event, MessageCall, ToolCallRules, XmlArguments, named_call, \
    text_value

MESSAGE, ENDS, START = "<|message|>", ("<|end|>", "<|call|>", "<|return|>"), "<|start|>"
_CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")
_NOT_TOOLS = ("assistant", "user")  # recipients that are not calls
_RECIPIENT = re.compile(r"\bto=(?:functions\.)?([^\s<]+)")


class HarmonyReader(CallReader):
    """Splits a streamed Harmony reply into reasoning, answer and calls."""

    ends = ENDS  # what ends a message
    thinking_recipient = ""  # a recipient whose messages are reasoning, if the format has one
    reads_reasoning = True
    streams_calls = True  # a call's message is its arguments' JSON, which goes out as it is written

    def __init__(self, rules: ToolCallRules) -> None:
        super().__init__(rules)
        self._header: Optional[str] = ""  # the current message's header so far; None once it is complete
        self._channel = ""
        self._recipient: Optional[str] = None
        self._arguments = ""
        self._streamed: Optional[MessageCall] = None  # the message's call, if it is one to start as it is written

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
                if self._recipient is not None and self._recipient == self.thinking_recipient:
                    self._channel, self._recipient = "analysis", None
                self._header, self._arguments = None, ""
                may_start = self.streams_calls and self.may_start(self._recipient)
                self._streamed = MessageCall(self._recipient) if may_start else None
                continue
            found = [(at, end) for end in self.ends + (START,) if (at := self._pending.find(end)) >= 0]
            if not found:
                cut = len(self._pending) - partial_tag(self._pending, self.ends + (START,))
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
            if self._streamed is not None:
                self._calls(self._streamed.read(self._arguments), out)
        elif self._channel == "analysis":
            out.append(ReasoningDelta(text))
        else:
            self._text(text, out)

    def _end_message(self, out: list, cut: bool = False) -> None:
        streamed, self._streamed = self._streamed, None
        if streamed is not None and streamed.id is not None:
            self._calls([streamed.end(self._call(self._recipient, self._arguments), cut)], out)
        elif self._recipient is not None:
            name, arguments = self._recipient, self._arguments
            call = self._call(name, arguments)
            if call is not None and self.rules.accept(call.name, call.arguments):
                out.append(ToolCall(uuid.uuid4().hex[:24], name, json.dumps(call.arguments, ensure_ascii=False)))
                self.calls += 1
                self._after_call = True
            elif cut and name in self.rules.schemas:
                out.append(ToolCall(uuid.uuid4().hex[:24], name, arguments.strip(), complete=False))
                self.calls += 1
            # else a call of a tool not on offer (a built-in one, python or the browser): left out
        self._header, self._recipient, self._channel, self._arguments = "", None, "", ""

    def _call(self, name: str, arguments: str) -> Optional[Call]:
        """The call a message to the tool ``name`` makes; None if its text is not one."""
        return named_call(name, arguments.strip() or "{}")


FORMAT = CallFormat(
    name="harmony",
    markers=("<|channel|>", "<|message|>"),
    opens=(" to=functions.",),  # where a call begins to be held to its tool's schema
    close=None,
    parse=lambda body, schemas: None,  # HarmonyReader reads the messages
    start="<|channel|>commentary to=functions.",
    head=lambda name: f"{name} <|constrain|>json<|message|>",
    tail="<|call|>",
    between="<|start|>assistant<|channel|>commentary to=functions.",
    tags=("<|channel|>", "<|message|>", "<|constrain|>", "<|end|>", "<|call|>", "<|return|>", "<|start|>"),
    reader=HarmonyReader,
)


# Muse Glimmer: Harmony's frame without channels. ``<|start|>assistant to=self<|message|>`` is its reasoning,
# ``to=user`` its answer, ``to=x`` a call of x, whose text is an ATEM block; ``<|eom|>`` ends a message (another
# follows), ``<|eot|>`` the turn. The prompt ends with the first ``<|start|>assistant``.
_ATEM = re.compile(r'\s*<atem:function_calls>\s*<atem:invoke name="([^"]+)">(.*?)</atem:invoke>\s*'
                   r'</atem:function_calls>\s*\Z', re.DOTALL)
_ATEM_PARAMETER = re.compile(r'\s*<atem:parameter name="([^"]+)">(.*?)</atem:parameter>', re.DOTALL)


class MuseReader(HarmonyReader):
    ends = ("<|eom|>", "<|eot|>")
    thinking_recipient = "self"
    streams_calls = False  # its calls are ATEM blocks: each comes whole

    def _call(self, name: str, arguments: str) -> Optional[Call]:
        block = _ATEM.match(arguments)
        if block is None or block.group(1) != name:
            return None
        properties = (self.rules.schemas.get(name) or {}).get("properties") or {}
        found, at, body = {}, 0, block.group(2)
        for parameter in _ATEM_PARAMETER.finditer(body):
            if parameter.start() != at:
                return None
            found[parameter.group(1)] = text_value(parameter.group(2), properties.get(parameter.group(1)))
            at = parameter.end()
        return Call(name, found) if not body[at:].strip() else None


MUSE = CallFormat(
    name="muse-atem",
    markers=("<atem:function_calls>", "to=self"),
    opens=(" to=",),
    close=None,
    parse=lambda body, schemas: None,  # MuseReader reads the messages
    start=" to=",
    head=lambda name: f'{name}<|message|><atem:function_calls>\n<atem:invoke name="{name}">\n',
    tail="</atem:invoke>\n</atem:function_calls>",
    between="<|eom|><|start|>assistant to=",
    xml=XmlArguments(lambda key, _kind: f'<atem:parameter name="{key}">', "</atem:parameter>\n"),
    tags=("<|start|>", "<|message|>", "<|eom|>", "<|eot|>"),
    reader=MuseReader,
)
