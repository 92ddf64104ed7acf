"""MiniMax M2: ``<minimax:tool_call>`` holding an ``<invoke name="...">`` element per call, each with a
``<parameter name="...">value</parameter>`` per parameter."""

import re
from typing import Any, Optional

from .base import Call, CallFormat, Schemas, Streaming, XmlArguments, allows_text, xml_value

_INVOKE = re.compile(r'\s*<invoke name="([^"]+)">(.*?)</invoke>', re.DOTALL)
_PARAMETER = re.compile(r'<parameter name="([^"]+)">(.*?)</parameter>', re.DOTALL)


def _calls(body: str, schemas: Schemas) -> Optional[list[Call]]:
    calls, at = [], 0
    for invoke in _INVOKE.finditer(body):
        if invoke.start() != at:
            return None
        at = invoke.end()
        properties = (schemas.get(invoke.group(1)) or {}).get("properties") or {}
        calls.append(Call(invoke.group(1), {
            key: xml_value(value, properties.get(key)) for key, value in _PARAMETER.findall(invoke.group(2))}))
    return calls if calls and not body[at:].strip() else None


FORMAT = CallFormat(
    name="minimax-xml",
    markers=("<minimax:tool_call>",),
    opens=("<minimax:tool_call>",),
    close="</minimax:tool_call>",
    parse=_calls,
    start="<minimax:tool_call>\n",
    head=lambda name: f'<invoke name="{name}">\n',
    tail="</invoke>\n",
    end="</minimax:tool_call>",
    xml=XmlArguments(lambda key, _kind: f'<parameter name="{key}">', "</parameter>\n"),
    tags=("<minimax:tool_call>", "</minimax:tool_call>"),
    streaming=Streaming(re.compile(r'\s*<invoke name="(?P<name>[^"]+)">'),
                        re.compile(r'\s*<parameter name="(?P<key>[^"]+)">'), "</parameter>",
                        call_end=re.compile(r"\s*</invoke>")),
)


# MiniMax M3 puts its separator token before each element: ``]<]minimax[>[<tool_call>``, then ``<invoke
# name="...">`` elements with a ``<key>value</key>`` element per parameter.
SEPARATOR = "]<]minimax[>["
_SEP = re.escape(SEPARATOR)
_M3_INVOKE = re.compile(rf'\s*(?:{_SEP})?<invoke name="([^"]+)">(.*?)(?:{_SEP})?</invoke>', re.DOTALL)
_M3_ELEMENT = re.compile(rf"\s*(?:{_SEP})?<([^<>/\s]+)>(.*?)(?:{_SEP})?</\1>", re.DOTALL)


def _m3_elements(text: str) -> Optional[list[tuple[str, str]]]:
    """The ``<key>value</key>`` elements ``text`` is made of; None if it is not only those."""
    elements, at = [], 0
    for element in _M3_ELEMENT.finditer(text):
        if element.start() != at:
            return None
        elements.append((element.group(1), element.group(2)))
        at = element.end()
    return elements if not text[at:].strip() else None


def _m3_value(text: str, schema: Any) -> Any:
    """A parameter's value: a string's text as it is; an array of ``<item>`` elements or an object of elements
    read as such; any other text as JSON, else as a string."""
    if allows_text(schema):  # even where the text looks like elements, as llama.cpp reads it
        return text
    elements = _m3_elements(text) if text.lstrip().startswith(("<", SEPARATOR)) else None
    if not elements:
        return xml_value(text, schema)
    schema = schema if isinstance(schema, dict) else {}
    if all(key == "item" for key, _ in elements) and schema.get("type") != "object":
        return [_m3_value(value, schema.get("items")) for _, value in elements]
    properties = schema.get("properties") or {}
    return {key: _m3_value(value, properties.get(key)) for key, value in elements}


def _m3_calls(body: str, schemas: Schemas) -> Optional[list[Call]]:
    calls, at = [], 0
    for invoke in _M3_INVOKE.finditer(body):
        if invoke.start() != at:
            return None
        at = invoke.end()
        elements = _m3_elements(invoke.group(2))
        if elements is None:
            return None
        properties = (schemas.get(invoke.group(1)) or {}).get("properties") or {}
        calls.append(Call(invoke.group(1), {key: _m3_value(value, properties.get(key)) for key, value in elements}))
    return calls if calls and not body[at:].strip() else None


M3 = CallFormat(
    name="minimax-m3",
    markers=(SEPARATOR, "<tool_call>"),
    opens=(SEPARATOR + "<tool_call>",),
    close=SEPARATOR + "</tool_call>",
    parse=_m3_calls,
    start=SEPARATOR + "<tool_call>\n",
    head=lambda name: f'{SEPARATOR}<invoke name="{name}">',
    tail=f"{SEPARATOR}</invoke>\n",
    end=SEPARATOR + "</tool_call>",
    xml=XmlArguments(lambda key, _kind: f"{SEPARATOR}<{key}>", SEPARATOR + "</{key}>",
                     text=r"([^\]]|\][^<])*"),  # a string's text: anything but the separator
    tags=(SEPARATOR,),
)
