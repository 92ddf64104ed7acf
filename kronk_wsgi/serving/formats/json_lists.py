"""Formats that write a JSON list of calls between markers of their own.

Nemotron Nano v2 ``<TOOLCALL>[...]</TOOLCALL>``; Granite 3.3 ``<|tool_call|>[...]`` to the end of
the reply; firefunction v2 `` functools[...]``; Apertus ``<|tools_prefix|>[{"name": {...}}]<|tools_suffix|>``
(each call an object of one key, the tool's name); Command R7B
``<|START_ACTION|>[{"tool_call_id": ..., "tool_name": ..., "parameters": {...}}]<|END_ACTION|>`` (its
answers between ``<|START_RESPONSE|>`` and ``<|END_RESPONSE|>``, which are left out), Command R+ the same list
in a code block after ``Action:``; GigaChat 3, a JSON call after ``function call<|role_sep|>`` (3.1:
``<|function_call|>``) to the end of the reply; Apriel ``<tool_calls>[...]</tool_calls>`` (MiniMax M1: a call per line).
"""

import json
import re
from typing import Optional

from .base import JSON_HEAD, Call, CallFormat, Schemas, Streaming, json_calls, named_call


def _name_arguments(name: str) -> str:
    return f'{{"name": {json.dumps(name)}, "arguments": '


def _list_of_calls(body: str, schemas: Schemas) -> Optional[list[Call]]:
    return json_calls(body, schemas) if body.startswith("[") else None


def _objects(body: str) -> Optional[list]:
    try:
        value = json.loads(body)
    except ValueError:
        return None
    return value if isinstance(value, list) and value and all(isinstance(i, dict) for i in value) else None


def _apertus_calls(body: str, _schemas: Schemas) -> Optional[list[Call]]:
    items = _objects(body)
    if items is None or any(len(item) != 1 for item in items):
        return None
    calls = [named_call(*next(iter(item.items()))) for item in items]
    return None if None in calls else calls


def _command_r_calls(body: str, _schemas: Schemas) -> Optional[list[Call]]:
    items = _objects(body)
    if items is None or any(not isinstance(item.get("tool_name"), str) for item in items):
        return None
    calls = [named_call(item["tool_name"], item.get("parameters", {})) for item in items]
    return None if None in calls else calls


NEMOTRON = CallFormat(
    name="nemotron-v2",
    markers=("<TOOLCALL>",),
    opens=("<TOOLCALL>",),
    close="</TOOLCALL>",
    parse=_list_of_calls,
    start="<TOOLCALL>[",
    head=_name_arguments,
    tail="}",
    between=", ",
    end="]</TOOLCALL>",
    tags=("<TOOLCALL>", "</TOOLCALL>"),
    streaming=Streaming(JSON_HEAD),
)

GRANITE = CallFormat(
    name="granite-3",
    markers=("<|tool_call|>",),
    opens=("<|tool_call|>",),
    close=None,
    parse=_list_of_calls,
    start="<|tool_call|>[",
    head=_name_arguments,
    tail="}",
    between=", ",
    end="]",
    tags=("<|tool_call|>",),
    streaming=Streaming(JSON_HEAD),
)

FIREFUNCTION = CallFormat(
    name="firefunction-v2",
    markers=("functools[",),
    opens=("functools",),
    close=None,
    parse=_list_of_calls,
    start=" functools[",
    head=_name_arguments,
    tail="}",
    between=", ",
    end="]",
    streaming=Streaming(JSON_HEAD),
)

APERTUS = CallFormat(
    name="apertus",
    markers=("<|tools_prefix|>",),
    opens=("<|tools_prefix|>",),
    close="<|tools_suffix|>",
    parse=_apertus_calls,
    start="<|tools_prefix|>[",
    head=lambda name: f"{{{json.dumps(name)}: ",
    tail="}",
    between=", ",
    end="]<|tools_suffix|>",
    tags=("<|tools_prefix|>", "<|tools_suffix|>"),
    streaming=Streaming(re.compile(r'\s*(?:\}\s*,\s*)?\[?\s*\{\s*"(?P<name>[^"\\]+)"\s*:\s*')),
)

COMMAND_R7B = CallFormat(
    name="command-r7b",
    markers=("<|START_ACTION|>",),
    opens=("<|START_ACTION|>",),
    close="<|END_ACTION|>",
    parse=_command_r_calls,
    start="<|START_ACTION|>[\n    ",
    head=lambda name: f'{{"tool_call_id": "0", "tool_name": {json.dumps(name)}, "parameters": ',
    tail="}",
    between=",\n    ",
    end="\n]<|END_ACTION|>",
    drops=("<|START_RESPONSE|>", "<|END_RESPONSE|>", "<|START_TEXT|>", "<|END_TEXT|>"),
    tags=("<|START_ACTION|>", "<|END_ACTION|>", "<|START_RESPONSE|>", "<|END_RESPONSE|>", "<|START_TEXT|>",
          "<|END_TEXT|>"),
    streaming=Streaming(re.compile(r'\s*(?:\}\s*,\s*)?\[?\s*\{\s*"tool_call_id"\s*:\s*"[^"]*"\s*,\s*'
                                   r'"tool_name"\s*:\s*"(?P<name>[^"\\]+)"\s*,\s*"parameters"\s*:\s*')),
)

def _command_r_plus_calls(body: str, schemas: Schemas) -> Optional[list[Call]]:
    """A JSON list of actions in a code block; the ``directly-answer`` action is none."""
    body = body.strip().removeprefix("```json").removeprefix("```").removesuffix("```")
    calls = _command_r_calls(body.strip(), schemas)
    return [c for c in calls if c.name != "directly-answer"] or None if calls else None


COMMAND_R_PLUS = CallFormat(
    name="command-r-plus",
    markers=("Action:", "```json", "tool_name"),
    opens=("Action:",),
    close=None,
    parse=_command_r_plus_calls,
    start="Action:\n```json\n[\n    ",
    head=lambda name: f'{{"tool_name": {json.dumps(name)}, "parameters": ',
    tail="}",
    between=",\n    ",
    end="\n]\n```",
    drops=("<|CHATBOT_TOKEN|>", "<|END_OF_TURN_TOKEN|>"),
    tags=("<|CHATBOT_TOKEN|>", "<|END_OF_TURN_TOKEN|>"),
)

def _list_or_lines(body: str, schemas: Schemas) -> Optional[list[Call]]:
    """A JSON list of calls, or one call per line."""
    calls = json_calls(body, schemas)
    if calls is not None or "\n" not in body:
        return calls
    lines = [json_calls(line, schemas) for line in body.splitlines() if line.strip()]
    return None if None in lines else [call for line in lines for call in line]


TOOL_CALLS = CallFormat(
    name="tool-calls-json",
    markers=("<tool_calls>",),
    opens=("<tool_calls>",),
    close="</tool_calls>",
    parse=_list_or_lines,
    start="<tool_calls>[",
    head=_name_arguments,
    tail="}",
    between=", ",
    end="]</tool_calls>",
    streaming=Streaming(JSON_HEAD),
)

GIGACHAT = CallFormat(
    name="gigachat3",
    markers=("role_sep", "function"),
    opens=("function call<|role_sep|>", "<|function_call|>"),  # 3, 3.1
    close=None,
    parse=json_calls,
    start="function call<|role_sep|>\n",
    head=_name_arguments,
    tail="}",
    drops=("<|message_sep|>",),
    tags=("<|role_sep|>", "<|message_sep|>", "<|function_call|>"),
    streaming=Streaming(JSON_HEAD),
)
