"""Tool calls parsed out of generated text, as the model's chat template asks for them.

Two conventions are understood: Hermes-style ``<tool_call>{json}</tool_call>``
(ChatML templates such as Qwen's and the built-in one) and Mistral's
``[TOOL_CALLS][{json}, ...]``, chosen by what the template itself contains.
Text that looks like a tool call but does not parse, or that the request's
tools do not accept (an unknown name, arguments against a strict schema),
stays plain text.

A tool whose input is text in a grammar of the client's (a Responses custom
tool with a Lark grammar) is called in a raw form, which only the Hermes
convention can delimit: ``<tool_call>\n{"name": "x"}\n`` then the input as it
is, then ``\n</tool_call>``; it is read as arguments ``{"input": text}``.
"""

import dataclasses
import json
import re
import uuid
from typing import Callable, Optional

from ..engine.generate import partial_tag
from ..engine.grammar import lark_grammar, lark_json, lark_string
from .events import TextDelta, ToolCall


@dataclasses.dataclass(frozen=True)
class ToolCallSyntax:
    """How a model writes tool calls: an opening tag, then JSON, then the closing tag (or the end)."""

    open: str
    close: Optional[str]


HERMES = ToolCallSyntax("<tool_call>", "</tool_call>")
MISTRAL = ToolCallSyntax("[TOOL_CALLS]", None)


def syntax_of(template_source: str) -> ToolCallSyntax:
    """The convention a chat template teaches its model."""
    return MISTRAL if "[TOOL_CALLS]" in template_source else HERMES


def _call_head(name: str) -> str:
    """A call's text up to its arguments."""
    return f'{{"name": {json.dumps(name)}, "arguments": '


def _raw_head(name: str) -> str:
    """A raw-input call's text up to its input."""
    return json.dumps({"name": name}) + "\n"


def forced_opening(syntax: ToolCallSyntax, name: Optional[str], raw_input: bool = False) -> str:
    """The start of a reply that must be a tool call (of the function ``name``, if given; in the raw form with
    ``raw_input``).

    Appended to the prompt, it makes the model continue inside a tool call.
    """
    opening = syntax.open + ("[" if syntax.close is None else "\n")
    return opening + ((_raw_head(name) if raw_input else _call_head(name)) if name else "")


def call_grammar(
    syntax: ToolCallSyntax, tools: list[dict], strict_tools: frozenset[str], control: dict[str, int],
    name: Optional[str] = None, forced: bool = True, raw_inputs: Optional[dict[str, str]] = None,
) -> str:
    """A Lark grammar for tool calls whose arguments follow the tools' schemas.

    ``forced``: for the rest of a reply that starts with ``forced_opening(syntax,
    name)``, one call to one of the ``tools`` (to ``name``, if given). Not
    ``forced``: for the text after the model opened a call itself (wrote the
    opening tag), that call and any more that follow it. Keywords the grammar
    cannot enforce are an error for the ``strict_tools`` and skipped for the
    others. ``control`` are the model's control tokens: a tag that is one is
    matched as that token. ``raw_inputs`` are the Lark grammars of the tools
    called in the raw form, by name (Hermes convention only).
    """
    raw_inputs = raw_inputs or {}
    inputs = {tool: f"input_{index}" for index, tool in enumerate(raw_inputs)}  # each its own grammar

    def tag(text: str) -> str:
        return f"<[{control[text]}]>" if text in control else lark_string(text)

    def arguments(tool: str) -> str:  # after the call's head, to the end of the call's text
        if tool in raw_inputs:
            return f"@{inputs[tool]}"
        function = next(t["function"] for t in tools if t["function"]["name"] == tool)
        return lark_json(function["parameters"], lenient=tool not in strict_tools) + ' "}"'

    def head(tool: str) -> str:
        return lark_string(_raw_head(tool) if tool in raw_inputs else _call_head(tool))

    if forced and name is not None:  # the opening ends with the call's head
        body = arguments(name)
    else:
        names = [t["function"]["name"] for t in tools]
        body = "(" + " | ".join(f"{head(tool)} {arguments(tool)}" for tool in names) + ")"
    if syntax.close is None:  # [TOOL_CALLS][{call}, {call}]
        if forced:
            return lark_grammar(f'start: {body} "]"\n')
        return lark_grammar(f'start: "[" {body} ("," " "? {body})* "]"\n')
    close = f'"\\n" {tag(syntax.close)}'
    if forced:
        main = f"start: {body} {close}\n"
    else:
        main = f'start: "\\n"? {body} {close} ("\\n" {tag(syntax.open)} "\\n"? {body} {close})*\n'
    if not raw_inputs:
        return lark_grammar(main)
    return json.dumps({"grammars": [{"lark_grammar": main}] + [
        {"name": inputs[tool], "lark_grammar": grammar} for tool, grammar in raw_inputs.items()]})


@dataclasses.dataclass(frozen=True)
class ToolCallRules:
    """What to parse out of one reply: the template's syntax, and which calls the request's tools take."""

    syntax: ToolCallSyntax
    accept: Callable[[str, dict], bool]  # (name, arguments)
    names: frozenset[str] = frozenset()  # the tools' names: a call to one of them cut off by the limit is kept
    raw_inputs: frozenset[str] = frozenset()  # the tools called in the raw form


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


def _raw_call(body: str, rules: ToolCallRules) -> Optional[ToolCall]:
    """A raw-input call (its head line, then its input), if the body is one of a tool called so."""
    head, _, text = body.partition("\n")
    try:
        value = json.loads(head)
    except ValueError:
        return None
    if not isinstance(value, dict) or value.keys() != {"name"} or value["name"] not in rules.raw_inputs:
        return None
    arguments = custom_arguments(text.removesuffix("\n"))
    if not rules.accept(value["name"], arguments):
        return None
    return ToolCall(uuid.uuid4().hex[:24], value["name"], json.dumps(arguments, ensure_ascii=False))


def _parse_calls(body: str, accept: Callable[[str, dict], bool]) -> Optional[list[ToolCall]]:
    """The calls in one tool-call body (an object or a list of them); None if it is not one."""
    try:
        value = json.loads(body)
    except ValueError:
        return None
    calls = []
    for item in value if isinstance(value, list) else [value]:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        arguments = item.get("arguments", item.get("parameters", {}))
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except ValueError:
                return None
        if not isinstance(arguments, dict) or not accept(item["name"], arguments):
            return None
        calls.append(ToolCall(uuid.uuid4().hex[:24], item["name"], json.dumps(arguments, ensure_ascii=False)))
    return calls or None


_PARTIAL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"([^"\\]+)"\s*,\s*"arguments"\s*:\s*')


def _partial_call(body: str, names: frozenset[str]) -> Optional[ToolCall]:
    """A call cut off in its arguments, if it has named one of the tools."""
    head = _PARTIAL_HEAD.match(body)
    if head is None or head.group(1) not in names:
        return None
    return ToolCall(uuid.uuid4().hex[:24], head.group(1), body[head.end():].rstrip(), complete=False)


class ToolCallParser:
    """Splits streamed text into text deltas and tool calls.

    Text that could be the start of an opening tag is held back until it is
    known not to be one; the body of a call is held until its closing tag.
    """

    def __init__(self, rules: ToolCallRules) -> None:
        self.rules = rules
        self.syntax = rules.syntax
        self.accept = rules.accept
        self.calls = 0
        self._pending = ""
        self._inside = False
        self._after_call = False
        self._space = ""  # trailing whitespace, held until text follows (not a call)

    def feed(self, text: str) -> list[TextDelta | ToolCall]:
        self._pending += text
        out: list[TextDelta | ToolCall] = []
        opening, closing = self.syntax.open, self.syntax.close
        while True:
            if not self._inside:
                at = self._pending.find(opening)
                if at < 0:
                    cut = len(self._pending) - partial_tag(self._pending, (opening,))
                    self._text(self._pending[:cut], out)
                    self._pending = self._pending[cut:]
                    return out
                self._text(self._pending[:at], out)
                self._pending = self._pending[at + len(opening):]
                self._inside = True
            elif closing is None:
                return out  # the body runs to the end of the text
            else:
                end = self._pending.find(closing)
                if end < 0:
                    return out
                body, self._pending = self._pending[:end], self._pending[end + len(closing):]
                self._inside = False
                self._body(body, opening + body + closing, out)

    def flush(self, cut: bool = False) -> list[TextDelta | ToolCall]:
        """What is held back when the text ends: an unclosed call is parsed if its syntax has no closing tag;
        one ``cut`` off by the token limit is a partial call if it has named one of the tools, as OpenAI
        returns it."""
        out: list[TextDelta | ToolCall] = []
        pending, self._pending = self._pending, ""
        partial = _partial_call(pending, self.rules.names) if self._inside and cut else None
        if not self._inside:
            self._text(pending, out)
        elif self.syntax.close is None:
            self._body(pending, self.syntax.open + pending, out)
        elif partial is not None:
            out.append(partial)
            self.calls += 1
        else:
            self._text(self.syntax.open + pending, out)
        self._inside = False
        if self._space and not self._after_call:
            out.append(TextDelta(self._space))
        self._space = ""
        return out

    def _body(self, body: str, raw: str, out: list) -> None:
        calls = _parse_calls(body.strip(), self.accept)
        if calls is None and self.rules.raw_inputs:
            call = _raw_call(body.removeprefix("\n"), self.rules)
            calls = [call] if call is not None else None
        if calls is None:
            self._text(raw, out)
            return
        out.extend(calls)
        self.calls += len(calls)
        self._after_call = True
        self._space = ""

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
