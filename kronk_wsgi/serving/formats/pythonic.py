"""Calls written as a Python list of function calls with keyword arguments, ``[name(key=value, ...)]``,
between ``<|tool_call_start|>`` and ``<|tool_call_end|>`` (LFM2). Values are Python or JSON literals."""

import ast
import json
import re
from typing import Any, Mapping, Optional

from .base import Call, CallFormat, ParameterArguments, Schemas, Streaming, XmlArguments

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


_KEY = re.compile(r"\s*,?\s*(?P<key>[A-Za-z_]\w*)\s*=\s*")
_END = re.compile(r"\s*,?\s*\)")
_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "b": "\b", "f": "\f", "v": "\v", "a": "\a", "0": "\0", "\\": "\\",
            "'": "'", '"': '"', "\n": ""}
_HEX = {"x": 2, "u": 4, "U": 8}


class KeywordArguments(ParameterArguments):
    """A call's keyword arguments as they are written, read into the JSON text of their object: a string's text
    goes out as it comes, another value once it ends."""

    def __init__(self, _properties: Mapping[str, Any]) -> None:
        super().__init__()
        self._quote: Optional[str] = None  # the quote of the string being read
        self._value = False  # whether a value that is not a string is being read

    def read(self, body: str, at: int) -> tuple[int, str]:
        new: list[str] = []
        while not self.ended:
            if self._quote is not None:
                at = self._string(body, at, new)
                if self._quote is not None:
                    break
            elif self._value:
                end = _value_end(body, at)
                if end is None:
                    break
                try:
                    value = _literal(ast.parse(body[at:end].strip(), mode="eval").body)
                except (SyntaxError, ValueError, _NotLiteral, RecursionError, MemoryError):
                    value = body[at:end].strip()
                new.append(json.dumps(value, ensure_ascii=False))
                self._value, at = False, end
            elif (end := _END.match(body, at)) is not None:
                new.append(self.closing(new))
                self.ended, at = True, end.end()
            elif (key := _KEY.match(body, at)) is not None and key.end() < len(body):
                new.append(self.key(key.group("key"), new))
                at = key.end()
                if body[at] in "\"'":
                    self._quote, at = body[at], at + 1
                    new.append('"')
                else:
                    self._value = True
            else:
                break
        return self.sent(at, new)

    def value_open(self) -> bool:
        return self._quote is not None or self._value

    def _string(self, body: str, at: int, new: list[str]) -> int:
        """Reads a string's text on from ``at`` to its closing quote, or to what may be an escape cut short."""
        out = []
        while at < len(body):
            char = body[at]
            if char == self._quote:
                self._quote = None
                at += 1
                break
            if char != "\\":
                out.append(char)
                at += 1
                continue
            if at + 1 >= len(body):
                break
            code = body[at + 1]
            if code in _HEX:
                digits = body[at + 2:at + 2 + _HEX[code]]
                if len(digits) < _HEX[code]:
                    break
                try:
                    out.append(chr(int(digits, 16)))
                except ValueError:
                    out.append(body[at:at + 2 + _HEX[code]])
                at += 2 + _HEX[code]
            else:
                out.append(_ESCAPES.get(code, "\\" + code))
                at += 2
        new.append(json.dumps("".join(out), ensure_ascii=False)[1:-1] + ('"' if self._quote is None else ""))
        return at


def _value_end(body: str, at: int) -> Optional[int]:
    """Where a value that is not a string ends (a comma or the call's closing parenthesis outside brackets and
    strings); None if it has not yet."""
    depth, quote = 0, None
    for index in range(at, len(body)):
        char = body[index]
        if quote is not None:
            if char == "\\":
                continue
            quote = None if char == quote and body[index - 1] != "\\" else quote
        elif char in "\"'":
            quote = char
        elif char in "([{":
            depth += 1
        elif char in ")]}":
            if depth == 0:
                return index
            depth -= 1
        elif char == "," and depth == 0:
            return index
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
    streaming=Streaming(re.compile(r"\s*,?\s*\[?\s*(?P<name>[A-Za-z_][\w.]*)\("), arguments=KeywordArguments),
)
