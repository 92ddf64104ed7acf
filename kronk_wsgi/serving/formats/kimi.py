"""Kimi K2: calls between ``<|tool_calls_section_begin|>`` and ``<|tool_calls_section_end|>``, each
``<|tool_call_begin|>functions.name:index<|tool_call_argument_begin|>{...}<|tool_call_end|>``; calls made
from the thinking have no section around them and may lack their ends.

Kimi K3: a reply of tagged sections, ``<|open|>name attributes<|sep|>`` ... ``<|close|>name<|sep|>``: its
thinking (see serving.reasoning), its ``response``, then its calls in ``tools``, each a ``call`` of an
``argument`` element per parameter (a string's text as it is, another value as JSON) or one ``json`` element
of them all.
"""

import re
from typing import Any, Optional

from .base import Call, CallFormat, CallReader, Schemas, Streaming, XmlArguments, named_call, xml_value

BEGIN, END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
_CALL = re.compile(r"\s*<\|tool_call_begin\|>\s*(?:functions\.)?([^\s:<]+?)(?::\d+)?\s*"
                   r"<\|tool_call_argument_begin\|>(.*?)(?:<\|tool_call_end\|>|(?=<\|tool_call_begin\|>)|\Z)", re.DOTALL)


def _calls(body: str, _schemas: Schemas) -> Optional[list[Call]]:
    calls, at = [], 0
    for match in _CALL.finditer(body):
        call = named_call(match.group(1), match.group(2)) if match.start() == at else None
        if call is None:
            return None
        calls.append(call)
        at = match.end()
    return calls if calls and not body[at:].strip() else None


class _K2Reader(CallReader):
    """Calls a reply ends in before the section's end (those made from the thinking) are read too, unless the
    token limit cut them."""

    def _reads_unclosed(self, cut: bool) -> bool:
        return not cut or super()._reads_unclosed(cut)


FORMAT = CallFormat(
    name="kimi-k2",
    markers=(BEGIN,),
    opens=(BEGIN,),
    kept=("<|tool_call_begin|>",),  # a call from the thinking has no section around it
    close=END,
    parse=_calls,
    start=BEGIN,
    head=lambda name: f"<|tool_call_begin|>functions.{name}:0<|tool_call_argument_begin|>",
    tail="<|tool_call_end|>",
    end=END,
    tags=(BEGIN, END, "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"),
    streaming=Streaming(re.compile(r"\s*(?:<\|tool_call_end\|>\s*)?<\|tool_call_begin\|>\s*(?:functions\.)?"
                                   r"(?P<name>[^\s:<]+?)(?::\d+)?\s*<\|tool_call_argument_begin\|>\s*")),
    reader=_K2Reader,
)


_K3_CALL = re.compile(r'\s*<\|open\|>call tool="([^"]*)"[^<]*<\|sep\|>(.*?)<\|close\|>call<\|sep\|>', re.DOTALL)
_K3_ARGUMENT = re.compile(r'\s*<\|open\|>argument key="([^"]*)"[^<]*<\|sep\|>(.*?)<\|close\|>argument<\|sep\|>',
                          re.DOTALL)
_K3_JSON = re.compile(r"\s*<\|open\|>json[^<]*<\|sep\|>(.*?)<\|close\|>json<\|sep\|>\s*\Z", re.DOTALL)


def _attribute(text: str) -> str:
    """An attribute's value, as the template escapes it."""
    return text.replace("&quot;", '"').replace("&amp;", "&")


def _type(kind: str) -> str:
    """An argument's type attribute, where its JSON type is known."""
    return f' type="{kind}"' if kind else ""


def _k3_value(text: str, schema: Any) -> Any:
    """An argument's value: text as it is for a string parameter (or one whose schema names no type), as
    llama.cpp reads it; another as JSON, else as text."""
    if not isinstance(schema, dict) or not isinstance(schema.get("type"), str):
        return text
    return xml_value(text, schema)


def _k3_arguments(body: str, schema: Any) -> Optional[dict]:
    block = _K3_JSON.match(body)
    if block is not None:
        call = named_call("", block.group(1))
        return call.arguments if call is not None else None
    properties = (schema or {}).get("properties") or {}
    arguments, at = {}, 0
    for argument in _K3_ARGUMENT.finditer(body):
        if argument.start() != at:
            return None
        key = _attribute(argument.group(1))
        arguments[key] = _k3_value(argument.group(2), properties.get(key))
        at = argument.end()
    return arguments if not body[at:].strip() else None


def _k3_calls(body: str, schemas: Schemas) -> Optional[list[Call]]:
    calls, at = [], 0
    for match in _K3_CALL.finditer(body):
        name = _attribute(match.group(1))
        arguments = _k3_arguments(match.group(2), schemas.get(name)) if match.start() == at else None
        if arguments is None:
            return None
        calls.append(Call(name, arguments))
        at = match.end()
    return calls if calls and not body[at:].strip() else None


K3 = CallFormat(
    name="kimi-k3",
    markers=("<|open|>", "open_tag('tools')"),  # the template writes its tags through macros
    opens=("<|open|>tools<|sep|>",),
    close="<|close|>tools<|sep|>",
    parse=_k3_calls,
    start="<|open|>tools<|sep|>",
    head=lambda name: f'<|open|>call tool="{name}" index="1"<|sep|>',
    tail="<|close|>call<|sep|>",
    end="<|close|>tools<|sep|>",
    xml=XmlArguments(lambda key, kind: f'<|open|>argument key="{key}"{_type(kind)}<|sep|>', "<|close|>argument<|sep|>",
                     text=r"([^<]|<[^|])*"),
    drops=("<|open|>response<|sep|>", "<|close|>response<|sep|>", "<|close|>message<|sep|>", "<|end_of_msg|>"),
    tags=("<|open|>", "<|sep|>", "<|close|>", "<|end_of_msg|>"),
)
