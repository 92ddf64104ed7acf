"""Kimi K2: calls between ``<|tool_calls_section_begin|>`` and ``<|tool_calls_section_end|>``, each
``<|tool_call_begin|>functions.name:index<|tool_call_argument_begin|>{...}<|tool_call_end|>``; calls made
from the thinking have no section around them and may lack their ends."""

import re
from typing import Optional

from .base import Call, CallFormat, Schemas, named_call

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
    unclosed=True,
    tags=(BEGIN, END, "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"),
)
