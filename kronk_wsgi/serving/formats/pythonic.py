"""Calls written as a Python list of function calls with keyword arguments, ``[name(key=value, ...)]``,
between ``<|tool_call_start|>`` and ``<|tool_call_end|>`` (LFM2). Values are Python or JSON literals."""

import ast
from typing import Any, Optional

from .base import Call, CallFormat, Schemas, XmlArguments

_NAMES = {"true": True, "false": False, "null": None, "True": True, "False": False, "None": None}


class _NotLiteral(ValueError):
    pass


def _literal(node: ast.AST) -> Any:
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name) and node.id in _NAMES:
        return _NAMES[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) and isinstance(node.operand, ast.Constant):
        return -node.operand.value
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(item) for item in node.elts]
    if isinstance(node, ast.Dict) and None not in node.keys:
        return {_literal(k): _literal(v) for k, v in zip(node.keys, node.values)}
    raise _NotLiteral()


def _name(node: ast.AST) -> Optional[str]:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute) and (base := _name(node.value)) is not None:
        return f"{base}.{node.attr}"
    return None


def _calls(body: str, _schemas: Schemas) -> Optional[list[Call]]:
    try:
        tree = ast.parse(body, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    items = tree.elts if isinstance(tree, ast.List) else [tree]
    calls = []
    for item in items:
        if not isinstance(item, ast.Call) or item.args or (name := _name(item.func)) is None:
            return None
        try:
            calls.append(Call(name, {k.arg: _literal(k.value) for k in item.keywords if k.arg is not None}))
        except (_NotLiteral, TypeError):
            return None
    return calls or None


FORMAT = CallFormat(
    name="pythonic",
    markers=("List of tools: ",),  # every LFM2 template's; not all of them write calls
    opens=("<|tool_call_start|>",),
    close="<|tool_call_end|>",
    parse=_calls,
    start="<|tool_call_start|>[",
    head=lambda name: f"{name}(",
    tail=")",
    between=", ",
    end="]<|tool_call_end|>",
    xml=XmlArguments(lambda key, _kind: f"{key}=", "", separator=", ", raw_strings=False),
    tags=("<|tool_call_start|>", "<|tool_call_end|>"),
)
