"""What every tool-call format is made of, and the reader that splits a streamed reply by one.

A format says where calls begin and end in a reply (``opens``, ``close``),
how the text between is read as calls (``parse``), and how a call is written
(``start``, ``head``, ``tail``, ``between``, ``end``): the start of a forced
call, and the grammar that holds a call to the tools' schemas. Arguments are
written as JSON, or as one tagged element per parameter (``XmlArguments``).

A tool whose input is text in a grammar of the client's (a Responses custom
tool with a Lark grammar) is called in a raw form, which only formats with
``raw_inputs`` can delimit (Hermes): ``<tool_call>\\n{"name": "x"}\\n`` then
the input as it is, then ``\\n</tool_call>``; it is read as arguments
``{"input": text}``.

A format with ``streaming`` has its calls followed as they are written: a call
starts once its tool is named, and its arguments go out piece by piece (as
JSON text) before the call ends. Calls of the other formats come whole, at
their close.
"""

import dataclasses
import json
import re
import uuid
from typing import Any, Callable, Mapping, Optional, Protocol, Union

from ...engine.generate import partial_tag
from ...engine.grammar import lark_json, lark_string, regex_literal
from ..events import ArgumentsDelta, ReasoningDelta, TextDelta, ToolCall, ToolCallStart


@dataclasses.dataclass(frozen=True)
class Call:
    """One call read out of a reply."""

    name: str
    arguments: dict


Schemas = Mapping[str, dict]  # each tool's parameters schema, by name
Parse = Callable[[str, Schemas], Optional[list[Call]]]


@dataclasses.dataclass(frozen=True)
class XmlArguments:
    """Arguments written one element per parameter: ``key_head(name, kind)``, the value (as JSON; with
    ``raw_strings`` a string's text as it is, between ``quote`` marks, matching ``text``), then ``key_tail``
    (with the name for ``{key}``); ``separator`` between two parameters. ``kind`` is the JSON type of the value
    written: "string" for text written as it is, "" where the schema does not say."""

    key_head: Callable[[str, str], str]
    key_tail: str
    separator: str = ""
    raw_strings: bool = True
    quote: str = ""
    text: str = r"([^<]|<[^\/])*"  # a regex: by default any text without "</"


class ArgumentsText(Protocol):
    """A call's arguments read into the JSON text of their object as they are written: ``read`` reads on from
    ``at`` in the growing ``body`` and says where it stopped and what text is new; ``text`` is all of it so far,
    ``ended`` whether the arguments have ended, and ``closed`` their whole text, if it can be told."""

    text: str
    ended: bool

    def read(self, body: str, at: int) -> tuple[int, str]: ...

    def closed(self) -> Optional[str]: ...


@dataclasses.dataclass(frozen=True)
class Streaming:
    """How a format's calls are followed as they are written. ``head`` matches a call's start (from the end of
    the last call, what separates two calls included), its group ``name`` the tool's; its arguments follow: one
    JSON object or, with ``element``, one element per parameter. ``element`` matches an element's start (group
    ``key``; group ``string``, where the element says whether its value is a string's text: "false" if not; else
    the schema says), ``element_end`` ends its value (``trim``: the newline before it is not part of the value), and
    ``call_end`` matches the end of the call after its last element (None: the call ends at the format's
    close). A format whose arguments are written otherwise reads them with ``arguments`` (given the tool's
    parameters' schemas), which reads as JsonObjectText does."""

    head: re.Pattern
    element: Optional[re.Pattern] = None
    element_end: str = ""
    trim: bool = False
    call_end: Optional[re.Pattern] = None
    arguments: Optional[Callable[[Mapping[str, Any]], ArgumentsText]] = None


# A call as a JSON object of its name and arguments, alone or in a list (``parameters``: Llama 3.x's name)
JSON_HEAD = re.compile(r'\s*(?:\}\s*[,;]?\s*)?\[?\s*\{\s*"name"\s*:\s*"(?P<name>[^"\\]+)"\s*,\s*'
                       r'"(?:arguments|parameters)"\s*:\s*')


def _is_text(schema: Any) -> bool:
    return isinstance(schema, dict) and schema.get("type") == "string"


def _kind_of(value: Any) -> str:
    """The JSON type of a value."""
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "integer" if isinstance(value, int) else "number"
    return {str: "string", dict: "object", list: "array", type(None): "null"}.get(type(value), "")


def xml_value(text: str, schema: Any) -> Any:
    """A parameter's value written as an element: a string parameter's text as it is, another's as JSON (text
    that is not JSON stays a string)."""
    if _is_text(schema):
        return text
    try:
        return json.loads(text)
    except ValueError:
        return text


def allows_text(schema: Any) -> bool:
    """Whether a schema takes a string: its type, or one of its ``anyOf`` or ``oneOf`` choices."""
    if not isinstance(schema, dict):
        return False
    kinds = schema.get("type")
    if kinds == "string" or (isinstance(kinds, list) and "string" in kinds):
        return True
    return any(allows_text(choice) for key in ("anyOf", "oneOf") if isinstance(schema.get(key), list)
               for choice in schema[key])


def text_value(text: str, schema: Any) -> Any:
    """A parameter's value written as an element, as llama.cpp reads one where a string may be: its text as it is
    if the schema takes a string (even where the text looks like JSON), else as JSON, else as text."""
    return text if allows_text(schema) else xml_value(text, schema)


def json_calls(body: str, _schemas: Schemas = None) -> Optional[list[Call]]:
    """The calls in a JSON object or list of objects with ``name`` and ``arguments`` (or ``parameters``);
    None if it is not one."""
    try:
        value = json.loads(body)
    except ValueError:
        return None
    calls = []
    for item in value if isinstance(value, list) else [value]:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        call = named_call(item["name"], item.get("arguments", item.get("parameters", {})))
        if call is None:
            return None
        calls.append(call)
    return calls or None


def named_call(name: str, arguments: Any) -> Optional[Call]:
    """A call of ``name``, its arguments an object or the JSON text of one (as some models write them)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            return None
    return Call(name, arguments) if isinstance(arguments, dict) else None


def _raw_head(name: str) -> str:
    """A raw-input call's text up to its input."""
    return json.dumps({"name": name}) + "\n"


def custom_arguments(text: str) -> dict:
    """A custom tool's input as the arguments of the function the tool is offered as (a raw-input call's, too;
    ``custom_input`` reads it back)."""
    return {"input": text}


def custom_input(arguments: str, complete: bool) -> str:
    """A custom tool's input, from its call's arguments: the string of the one argument (a cut-off call: the
    text so far)."""
    if not complete:
        return arguments
    value = json.loads(arguments).get("input", "")
    return value if isinstance(value, str) else json.dumps(value)


@dataclasses.dataclass(frozen=True)
class ToolCallRules:
    """What to read out of one reply: the model's format, and which calls the request's tools take."""

    format: "CallFormat"
    accept: Callable[[str, dict], bool]  # (name, arguments)
    schemas: Schemas = dataclasses.field(default_factory=dict)  # the tools' parameters, by name
    raw_inputs: frozenset[str] = frozenset()  # the tools called in the raw form
    max_calls: Optional[int] = None  # how many calls the reply may make; None: any

    def streams(self, name: Optional[str]) -> bool:
        """Whether a call of ``name`` can go out as it is written: a tool on offer, called with JSON arguments."""
        return name in self.schemas and name not in self.raw_inputs


Event = Union[TextDelta, ReasoningDelta, ToolCallStart, ArgumentsDelta, ToolCall]


class JsonObjectText:
    """A JSON object's text as it is written, from its ``{``: what of it is new, and whether it has ended."""

    def __init__(self) -> None:
        self.text = ""
        self.ended = False
        self._depth = 0
        self._string = False
        self._escaped = False

    def read(self, body: str, at: int) -> tuple[int, str]:
        """Reads ``body`` from ``at`` to the object's end, or the body's: where reading stopped, and the
        object's new text."""
        start = at
        while at < len(body) and not self.ended:
            char = body[at]
            if self._string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._string = False
            elif char == '"':
                self._string = True
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                self._depth -= 1
                self.ended = self._depth == 0
            at += 1
        new = body[start:at]
        self.text += new
        return at, new

    def closed(self) -> Optional[str]:
        """Its whole text, once the object has ended."""
        return self.text if self.ended else None


class ParameterArguments:
    """What readers of arguments written a parameter at a time share (an ArgumentsText): the JSON object's text,
    opened at the first key, closed after the last, and recorded as it goes out. ``value_open`` says whether a
    value is being read."""

    def __init__(self) -> None:
        self.text = ""
        self.ended = False

    def key(self, name: str, new: list[str]) -> str:
        """The text of a parameter's key (``new``: the text read in this call so far)."""
        return (", " if self.text or new else "{") + json.dumps(name, ensure_ascii=False) + ": "

    def closing(self, new: list[str]) -> str:
        return "}" if self.text or new else "{}"

    def sent(self, at: int, new: list[str]) -> tuple[int, str]:
        """What ``read`` returns: where it stopped, and the ``new`` text, now recorded."""
        text = "".join(new)
        self.text += text
        return at, text

    def value_open(self) -> bool:
        raise NotImplementedError

    def closed(self) -> Optional[str]:
        """Their whole text, with the object closed where no value is left open."""
        if self.ended:
            return self.text
        return None if self.value_open() else self.text + self.closing([])


class ElementArguments(ParameterArguments):
    """Arguments written one element per parameter (see Streaming), as they are written: read into the JSON
    text of their object. A string parameter's text goes out as it comes; another value once its element
    ends."""

    def __init__(self, stream: Streaming, properties: Mapping[str, Any]) -> None:
        super().__init__()
        self.stream = stream
        self.properties = properties
        self._key: Optional[str] = None  # the parameter whose value is being read
        self._said: Optional[str] = None  # what its element says of it being a string, if it says

    def read(self, body: str, at: int) -> tuple[int, str]:
        new: list[str] = []
        stream = self.stream
        while not self.ended:
            if self._key is None:
                end = stream.call_end.match(body, at) if stream.call_end else None
                if end is not None:
                    new.append(self.closing(new))
                    self.ended, at = True, end.end()
                    break
                element = stream.element.match(body, at)
                if element is None or element.end() == len(body):
                    break
                self._key, self._said = element.group("key").strip(), element.groupdict().get("string")
                new.append(self.key(self._key, new) + ('"' if self._string() else ""))
                at = element.end()
                continue
            end = body.find(stream.element_end, at)
            if end < 0:
                if self._string():  # its text so far, but what may be the start of the value's end
                    held = partial_tag(body[at:], (("\n" if stream.trim else "") + stream.element_end,))
                    new.append(json.dumps(body[at:len(body) - held], ensure_ascii=False)[1:-1])
                    at = len(body) - held
                break
            value = body[at:end]
            if stream.trim:
                value = value.removesuffix("\n")
            if self._string():
                new.append(json.dumps(value, ensure_ascii=False)[1:-1] + '"')
            else:
                new.append(json.dumps(xml_value(value, None if self._said else self.properties.get(self._key)),
                                      ensure_ascii=False))
            self._key, at = None, end + len(stream.element_end)
        return self.sent(at, new)

    def value_open(self) -> bool:
        return self._key is not None

    def _string(self) -> bool:
        return self._said != "false" if self._said is not None else _is_text(self.properties.get(self._key))


class CallStream:
    """The calls of a held text followed as they are written (the format's ``streaming``): each call's start
    once its tool is named (one the request offers, in JSON form), its arguments as they come, and its end
    once its arguments end. What it cannot follow is left for the text's close."""

    def __init__(self, stream: Streaming, rules: ToolCallRules, room: Optional[int]) -> None:
        self.stream = stream
        self.rules = rules
        self.room = room  # how many calls may still start; None: any
        self.started = 0
        self._at = 0
        self._stopped = False
        self._call: Optional[tuple[str, str, ArgumentsText]] = None  # id, name, arguments

    def read(self, body: str) -> list[Event]:
        """The events of ``body`` (the text held so far, growing) since the last read."""
        out: list[Event] = []
        while not self._stopped:
            if self._call is None:
                if self.room is not None and self.started >= self.room:
                    break
                head = self.stream.head.match(body, self._at)
                if head is None or head.end() == len(body):
                    break
                name = head.group("name").strip()
                json_arguments = self.stream.element is None and self.stream.arguments is None
                if json_arguments and body[head.end()] != "{":
                    break  # not yet an object (or never: the call is read whole at the close)
                if not self.rules.streams(name):
                    self._stopped = True  # not a call to stream: it and any after it are read at the close
                    break
                properties = self.rules.schemas[name].get("properties") or {}
                arguments = JsonObjectText() if json_arguments else self.stream.arguments(properties) \
                    if self.stream.arguments else ElementArguments(self.stream, properties)
                self._call = (uuid.uuid4().hex[:24], name, arguments)
                self.started += 1
                self._at = head.end()
                out.append(ToolCallStart(self._call[0], name))
            call_id, name, arguments = self._call
            self._at, new = arguments.read(body, self._at)
            if new:
                out.append(ArgumentsDelta(call_id, new))
            if not arguments.ended:
                break
            out.append(ended_call(call_id, name, arguments))
            self._call = None
        return out

    def close(self, calls: Optional[list[Call]], cut: bool) -> list[Event]:
        """The end of the text: the end of a call still open (``calls``: the text read whole, None if it
        does not parse; ``cut``: by the token limit)."""
        if self._call is None:
            return []
        call_id, name, arguments = self._call
        self._call = None
        read = calls[self.started - 1] if calls is not None and len(calls) >= self.started else None
        return [ended_call(call_id, name, arguments, read if read is not None and read.name == name else None, cut)]


class MessageCall:
    """A call whose message is its arguments' JSON (Harmony, Functionary v3.2): it starts once the JSON begins,
    and its arguments follow as they are written."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.id: Optional[str] = None  # None: not started
        self.arguments = JsonObjectText()
        self._at = 0

    def read(self, message: str) -> list[Event]:
        """The events of the ``message`` so far (growing) since the last read."""
        out: list[Event] = []
        if self.id is None:
            begun = message.lstrip()
            if not begun.startswith("{"):
                return out
            self.id, self._at = uuid.uuid4().hex[:24], len(message) - len(begun)
            out.append(ToolCallStart(self.id, self.name))
        self._at, new = self.arguments.read(message, self._at)
        if new:
            out.append(ArgumentsDelta(self.id, new))
        return out

    def end(self, read: Optional[Call], cut: bool) -> ToolCall:
        """The end of the started call (``read``: the message read whole, None if it does not parse)."""
        return ended_call(self.id, self.name, self.arguments, read, cut)


def ended_call(call_id: str, name: str, arguments: ArgumentsText,
               read: Optional[Call] = None, cut: bool = False) -> ToolCall:
    """The end of a started call: its arguments' whole text (its text read whole, where that goes on from the
    text sent), or the text sent, not ``complete``, where they never ended."""
    whole = arguments.closed()
    if read is not None and (whole is None or _value(whole) != read.arguments):
        text = json.dumps(read.arguments, ensure_ascii=False)
        whole = text if text.startswith(arguments.text) else whole
    if whole is None or cut and not arguments.ended or not isinstance(_value(whole), dict):
        return ToolCall(call_id, name, arguments.text, complete=False)
    return ToolCall(call_id, name, whole)


def _value(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


class CallReader:
    """Splits streamed text into text deltas and tool calls, by the rules' format.

    Text that could be the start of an opening is held back until it is known
    not to be one; what follows an opening is held until the format's close.
    Text that looks like a call but does not parse, or that the request's tools
    do not take (an unknown name, arguments against a strict schema), stays text.
    A format whose replies are read otherwise has a subclass of its own.
    """

    reads_reasoning = False  # it tells reasoning apart too, so it reads every reply
    frames_replies = False  # every reply is framed in its format's way, so it reads every reply, tools or not
    streams_calls = False  # its calls go out as they are written, whatever the format's ``streaming``

    def __init__(self, rules: ToolCallRules) -> None:
        self.rules = rules
        self.format = rules.format
        self.calls = 0
        self._pending = ""
        self._opened: Optional[str] = None  # the opening of the calls being read
        self._after_call = False
        self._space = ""  # trailing whitespace, held until text follows (not a call)
        self._stream: Optional[CallStream] = None  # the calls being followed as they are written

    def feed(self, text: str) -> list[Event]:
        self._pending += text
        out: list[Event] = []
        opens, close = self.format.opens, self.format.close
        while True:
            if self._opened is None:
                marks = opens + self.format.kept + self.format.drops
                found = [(at, o) for o in marks if (at := self._pending.find(o)) >= 0]
                if not found:
                    cut = len(self._pending) - partial_tag(self._pending, marks)
                    self._text(self._pending[:cut], out)
                    self._pending = self._pending[cut:]
                    return out
                at, opening = min(found, key=lambda f: (f[0], -len(f[1])))
                self._text(self._pending[:at], out)
                if any(len(m) > len(self._pending) - at and m.startswith(self._pending[at:]) for m in marks):
                    self._pending = self._pending[at:]  # still possibly a longer mark that begins with this one
                    return out
                if opening in self.format.drops:
                    self._pending = self._pending[at + len(opening):]
                    continue
                keep = len(opening) if opening in self.format.kept else 0
                self._pending = self._pending[at + len(opening) - keep:]
                self._opened = opening
            elif close is None:
                self._follow(self._pending, out)
                return out  # the calls run to the end of the text
            else:
                end = self._pending.find(close)
                if end < 0:
                    self._follow(self._pending, out)
                    return out
                body, self._pending = self._pending[:end], self._pending[end + len(close):]
                self._read(body, self._raw(body) + close, out)
                self._opened = None

    def flush(self, cut: bool = False) -> list[Event]:
        """What is held back when the text ends: calls that run to the end are read; a call ``cut`` off by the
        token limit ends as a partial call if it had started (its tool named), as OpenAI returns it."""
        out: list[Event] = []
        pending, self._pending = self._pending, ""
        if self._opened is None:
            self._text(pending, out)
        elif self.format.close is None or self._reads_unclosed(cut):
            self._read(pending, self._raw(pending), out, cut)
        else:
            self._text(self._raw(pending), out)
        self._opened = None
        if self._space and not self._after_call:
            out.append(TextDelta(self._space))
        self._space = ""
        return out

    def _reads_unclosed(self, cut: bool) -> bool:
        """Whether the calls a reply ends in before their close are read (else they stay text): those that have
        started to go out are."""
        return self._stream is not None and self._stream.started

    def _raw(self, body: str) -> str:
        """The reply's text of what the opening opened."""
        return ("" if self._opened in self.format.kept else self._opened) + body

    def _follow(self, body: str, out: list) -> None:
        """The calls' starts and argument deltas written since the last look at the held ``body``."""
        if self.format.streaming is None:
            return
        if self._stream is None:
            room = None if self.rules.max_calls is None else self.rules.max_calls - self.calls
            self._stream = CallStream(self.format.streaming, self.rules, room)
        self._calls(self._stream.read(body), out)

    def may_start(self, name: Optional[str]) -> bool:
        """Whether a call of ``name`` may start as it is written: a tool on offer, in JSON form, within the number
        of calls the reply may make."""
        room = self.rules.max_calls is None or self.calls < self.rules.max_calls
        return self.rules.streams(name) and room

    def _calls(self, events: list[Event], out: list) -> None:
        out.extend(events)
        self.calls += sum(isinstance(e, ToolCall) for e in events)
        if events:
            self._after_call = True
            self._space = ""

    def _read(self, body: str, raw: str, out: list, cut: bool = False) -> None:
        self._follow(body, out)
        stream, self._stream = self._stream, None
        calls = self.format.parse(body.strip(), self.rules.schemas)
        if stream is not None and stream.started:  # those it started end, the rest come whole
            rest = [c for c in (calls or [])[stream.started:] if self.rules.accept(c.name, c.arguments)]
            self._calls(stream.close(calls, cut) + [ToolCall(uuid.uuid4().hex[:24], c.name, json.dumps(
                c.arguments, ensure_ascii=False)) for c in rest], out)
            return
        found = None
        if calls is not None and all(self.rules.accept(c.name, c.arguments) for c in calls):
            found = [ToolCall(uuid.uuid4().hex[:24], c.name, json.dumps(c.arguments, ensure_ascii=False))
                     for c in calls]
        elif self.rules.raw_inputs:
            call = self._raw_call(body.removeprefix("\n"))
            found = [call] if call is not None else None
        if found is None:
            self._text(raw, out)
            return
        self._calls(found, out)

    def _raw_call(self, body: str) -> Optional[ToolCall]:
        """A raw-input call (its head line, then its input), if the body is one of a tool called so."""
        head, _, text = body.partition("\n")
        try:
            value = json.loads(head)
        except ValueError:
            return None
        if not isinstance(value, dict) or value.keys() != {"name"} or value["name"] not in self.rules.raw_inputs:
            return None
        arguments = custom_arguments(text.removesuffix("\n"))
        if not self.rules.accept(value["name"], arguments):
            return None
        return ToolCall(uuid.uuid4().hex[:24], value["name"], json.dumps(arguments, ensure_ascii=False))

    def _text(self, text: str, out: list) -> None:
        # The whitespace a model puts around its calls is not part of its reply.
        text = self._space + text
        if self._after_call:
            text = text.lstrip()
            self._after_call = not text
        body = text.rstrip()
        self._space = text[len(body):]
        if body:
            out.append(TextDelta(body))


@dataclasses.dataclass(frozen=True)
class CallFormat:
    """How one family of models writes tool calls (see the module's docstring)."""

    name: str
    markers: tuple[str, ...]  # a chat template that has all of them teaches this format
    opens: tuple[str, ...]  # texts that open calls in a reply (the first is the one written)
    close: Optional[str]  # what ends them; None: the calls run to the end of the reply
    parse: Parse
    start: str  # written before the first call
    head: Callable[[str], str]  # a call of the named tool, up to its arguments
    tail: str = ""  # after a call's arguments
    between: str = ""  # between two calls
    end: str = ""  # after the last call
    xml: Optional[XmlArguments] = None  # None: the arguments are one JSON object
    raw_inputs: bool = False  # whether calls with raw text input can be delimited
    kept: tuple[str, ...] = ()  # texts that open calls too, and are part of what is parsed
    drops: tuple[str, ...] = ()  # markers around its answers, left out of the text
    tags: tuple[str, ...] = ()  # its markers that a vocabulary may have as control tokens
    streaming: Optional[Streaming] = None  # None: each call comes whole, at its close
    # Reads its replies: CallReader reads calls between ``opens`` and ``close`` with ``parse``; a subclass reads
    # replies otherwise (framed as messages, a bare JSON reply, calls left open)
    reader: type[CallReader] = CallReader

    @property
    def streams_calls(self) -> bool:
        """Whether its calls go out as they are written (by ``streaming``, or by its own reader)."""
        return self.streaming is not None or self.reader.streams_calls

    def recognises(self, template_source: str) -> bool:
        return all(marker in template_source for marker in self.markers)

    def opening(self, name: Optional[str], raw_input: bool = False) -> str:
        """The start of a reply that must be a call (of the tool ``name``, if given); appended to the prompt,
        it makes the model continue inside a call."""
        if name is None:
            return self.start
        return self.start + (_raw_head(name) if raw_input else self.head(name))

    def written(self, calls: list[Call], schemas: Schemas) -> str:
        """The text of ``calls`` in this format, as a forced call's grammar has it written."""
        return self.start + self.between.join(self.head(c.name) + self._arguments(c, schemas) + self.tail
                                              for c in calls) + self.end

    def _arguments(self, call: Call, schemas: Schemas) -> str:
        if self.xml is None:
            return json.dumps(call.arguments, ensure_ascii=False)
        properties = (schemas.get(call.name) or {}).get("properties") or {}
        out = []
        for key, value in call.arguments.items():
            raw = self.xml.raw_strings and _is_text(properties.get(key)) and isinstance(value, str)
            text = f"{self.xml.quote}{value}{self.xml.quote}" if raw else json.dumps(value, ensure_ascii=False)
            kind = "string" if raw else _kind_of(value)
            out.append(self.xml.key_head(key, kind) + text + self.xml.key_tail.format(key=key))
        return self.xml.separator.join(out)

    def teaching(self, tools: list[dict]) -> str:
        """System text that offers ``tools`` and shows how to call one in this format."""
        arguments = '{"<parameter>": <value>}' if self.xml is None else \
            self.xml.key_head("<parameter>", "") + "<value>" + self.xml.key_tail.format(key="<parameter>")
        example = self.opening("<function-name>") + arguments + self.tail + self.end
        signatures = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
        return (f"# Tools\n\nYou may call one or more functions to assist with the user query. Their "
                f"signatures:\n{signatures}\n\nTo call a function, write:\n{example}")

    def grammar(self, tools: list[dict], strict: frozenset[str], control: dict[str, int],
                name: Optional[str] = None, forced: bool = True, raw_inputs: Optional[dict[str, str]] = None) -> str:
        """A Lark grammar for calls whose arguments follow the tools' schemas: one rule, ``start``, unless tools
        take raw input (then llguidance's JSON of several grammars).

        ``forced``: for the rest of a reply that starts with ``opening(name)``,
        one call to one of the ``tools`` (to ``name``, if given). Not
        ``forced``: for the text after the model wrote ``opens[0]`` itself, that
        call and any more that follow. Keywords the grammar cannot enforce are
        an error for the ``strict`` tools and skipped for the others.
        ``control`` are the model's control tokens: a marker that is one is
        matched as that token. ``raw_inputs`` are the Lark grammars of the tools
        called in the raw form, by name.
        """
        raw_inputs = raw_inputs or {}
        inputs = {tool: f"input_{index}" for index, tool in enumerate(raw_inputs)}  # each its own grammar

        def text(literal: str) -> str:
            return self._literal(literal, control)

        def arguments(tool: str) -> str:  # after the call's head, to the end of the call
            if tool in raw_inputs:
                return f"@{inputs[tool]}"
            function = next(t["function"] for t in tools if t["function"]["name"] == tool)
            lenient = tool not in strict
            body = lark_json(function["parameters"], lenient=lenient) if self.xml is None \
                else self._xml_arguments(function["parameters"], lenient, text)
            return f"{body} {text(self.tail)}"

        def head(tool: str) -> str:
            return text(_raw_head(tool) if tool in raw_inputs else self.head(tool))

        if forced and name is not None:  # the opening ends with the call's head
            body = arguments(name)
        else:
            body = "(" + " | ".join(f"{head(t['function']['name'])} {arguments(t['function']['name'])}"
                                    for t in tools) + ")"
        if forced:
            main = f"start: {body} {text(self.end)}"
        else:
            rest = self.start.partition(self.opens[0])[2] if self.opens[0] in self.start else self.start
            main = f"start: {text(rest)} {body} ({text(self.between)} {body})* {text(self.end)}"
        main = (main if main.removeprefix("start:").strip() else 'start: ""') + "\n"
        if not raw_inputs:
            return main
        return json.dumps({"grammars": [{"lark_grammar": main}] + [
            {"name": inputs[tool], "lark_grammar": grammar} for tool, grammar in raw_inputs.items()]})

    def _text_value(self, tail: str, text: Callable[[str], str]) -> str:
        """A string parameter's text, its closing quote and the element's tail: one regex where none of them is a
        control token, so the text ends where the tail begins (a lexeme of its own would take the tail's first
        character when the text may hold it)."""
        quote = text(self.xml.quote) if self.xml.quote else ""
        closing = self.xml.quote + tail
        if text(closing) != lark_string(closing):  # a control token in it: matched as that token
            return f"{quote} /{self.xml.text}/ {quote} {text(tail)}"
        return f"{quote} /{self.xml.text}{regex_literal(closing)}/"

    def _literal(self, text: str, control: dict[str, int]) -> str:
        """``text`` as Lark, its markers that are control tokens matched as those tokens."""
        tags = [t for t in self.tags if t in control and t in text]
        if not text:
            return ""  # nothing: an empty literal repeated in a grammar confuses its lexer
        if not tags:
            return lark_string(text)
        parts = re.split("(" + "|".join(map(re.escape, tags)) + ")", text)
        return " ".join(f"<[{control[p]}]>" if p in control and p in tags else lark_string(p) for p in parts if p)

    def _xml_arguments(self, schema: dict, lenient: bool, text: Callable[[str], str]) -> str:
        """The parameters of ``schema`` one element each, in its order, the optional ones optional."""
        required = set(schema.get("required", ()))
        items: dict[str, str] = {}
        for key, value_schema in (schema.get("properties") or {}).items():
            tail = self.xml.key_tail.format(key=key)
            raw = self.xml.raw_strings and _is_text(value_schema)
            if raw:
                value = self._text_value(tail, text)
            else:
                value = f"{lark_json(value_schema, lenient=lenient)} {text(tail)}"
            kind = "string" if raw else value_schema.get("type") if isinstance(value_schema, dict) else None
            items[key] = f"{text(self.xml.key_head(key, kind if isinstance(kind, str) else ''))} {value}"
        if not items:
            return ""
        if not self.xml.separator:
            return " ".join(item if key in required else f"({item})?" for key, item in items.items())
        sep = text(self.xml.separator)
        first = [item for key, item in items.items() if key in required]
        if not first:  # none required: any of them, in any order
            return "(" + "(" + " | ".join(items.values()) + f") ({sep} (" + " | ".join(items.values()) + "))*)?"
        return f" {sep} ".join(first) + "".join(
            f" ({sep} {item})?" for key, item in items.items() if key not in required)
