"""Gemma 4: ``<|tool_call>call:name{key:value,...}<tool_call|>`` for each call, its arguments in Gemma's own
object notation: keys bare, strings between ``<|"|>`` marks, other values as in JSON."""

import json
import re
from typing import Any, Optional

from .base import Call, CallFormat, Schemas, XmlArguments

QUOTE = '<|"|>'
_HEAD = re.compile(r"\s*call:([^{\s]+)\{")
_KEY = re.compile(r"\s*([^:,{}\[\]\s]+)\s*:")
_SCALAR = re.compile(r"\s*(-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?|true|false|null)")


class _Notation:
    """A reader of Gemma's object notation; ValueError where the text is not in it."""

    def __init__(self, text: str) -> None:
        self.text, self.at = text, 0

    def skip(self, mark: str) -> bool:
        rest = self.text[self.at:]
        if rest.lstrip().startswith(mark):
            self.at += len(rest) - len(rest.lstrip()) + len(mark)
            return True
        return False

    def value(self, depth: int = 0) -> Any:
        if depth > 64:
            raise ValueError("nested too deeply")
        if self.skip(QUOTE):
            end = self.text.find(QUOTE, self.at)
            if end < 0:
                raise ValueError("unclosed string")
            value, self.at = self.text[self.at:end], end + len(QUOTE)
            return value
        if self.skip("{"):
            return self.members(depth + 1)
        if self.skip("["):
            items: list = []
            while not self.skip("]"):
                if items and not self.skip(","):
                    raise ValueError("expected a comma")
                if self.skip("]"):  # a trailing comma
                    break
                items.append(self.value(depth + 1))
            return items
        if self.skip('"'):  # a JSON string, as some replies write them
            value, end = json.JSONDecoder().raw_decode(self.text, self.at - 1)
            self.at = end
            return value
        scalar = _SCALAR.match(self.text, self.at)
        if scalar is None:
            raise ValueError("expected a value")
        self.at = scalar.end()
        return json.loads(scalar.group(1))

    def members(self, depth: int) -> dict:
        """The members of an object whose ``{`` has been read, up to its ``}``."""
        out: dict = {}
        while not self.skip("}"):
            if out and not self.skip(","):
                raise ValueError("expected a comma")
            if self.skip("}"):
                break
            key = _KEY.match(self.text, self.at)
            if key is None:
                raise ValueError("expected a key")
            self.at = key.end()
            out[key.group(1).strip('"')] = self.value(depth)
        return out


def _calls(body: str, _schemas: Schemas) -> Optional[list[Call]]:
    head = _HEAD.match(body)
    if head is None:
        return None
    reader = _Notation(body)
    reader.at = head.end()
    try:
        arguments = reader.members(0)
    except (ValueError, RecursionError):
        return None
    return [Call(head.group(1), arguments)] if not body[reader.at:].strip() else None


FORMAT = CallFormat(
    name="gemma4",
    markers=("<|tool_call>", "<tool_call|>"),
    opens=("<|tool_call>",),
    close="<tool_call|>",
    parse=_calls,
    start="<|tool_call>",
    head=lambda name: f"call:{name}{{",
    tail="}",
    between="<tool_call|><|tool_call>",
    end="<tool_call|>",
    xml=XmlArguments(lambda key, _kind: f"{key}:", "", separator=",", quote=QUOTE, text=r'([^<]|<[^|]|<\|[^"])*'),
    # Empty thought blocks and stray channel marks a model writes around its answer
    drops=("<|channel>thought\n<channel|>", "<channel|>", "<|channel>"),
    tags=("<|tool_call>", "<tool_call|>", QUOTE, "<|channel>", "<channel|>"),
)
