"""DeepSeek's calls between ``<｜tool▁calls▁begin｜>`` and ``<｜tool▁calls▁end｜>``, each
``<｜tool▁call▁begin｜>...<｜tool▁call▁end｜>``: R1 (and its distills) write
``function<｜tool▁sep｜>name`` then the arguments in a JSON code block, V3.1 writes
``name<｜tool▁sep｜>{...}``; V3.2 and V4 write DSML (below)."""

import json
import re
from typing import Optional

from .base import Call, CallFormat, Schemas, Streaming, XmlArguments, named_call

BEGIN, END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, SEP, CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
_CODE = re.compile(r"\s*([^\n]+?)\s*\n```(?:json)?\s*\n?(.*?)\s*```\s*\Z", re.DOTALL)


def _calls(body: str, _schemas: Schemas) -> Optional[list[Call]]:
    calls = []
    for part in body.split(CALL_BEGIN)[1:]:
        kind, sep, rest = part.partition(SEP)
        rest, closed, after = rest.partition(CALL_END)
        if not sep or not closed or after.strip():
            return None
        code = _CODE.match(rest) if kind.strip() == "function" else None
        call = named_call(code.group(1), code.group(2)) if code else named_call(kind.strip(), rest)
        if call is None:
            return None
        calls.append(call)
    return calls or None


_TAGS = (BEGIN, END, CALL_BEGIN, SEP, CALL_END)

R1 = CallFormat(
    name="deepseek-r1",
    markers=(SEP, "```json"),
    opens=(BEGIN,),
    close=END,
    parse=_calls,
    start=BEGIN,
    head=lambda name: f"{CALL_BEGIN}function{SEP}{name}\n```json\n",
    tail=f"\n```{CALL_END}",
    end=END,
    tags=_TAGS,
    streaming=Streaming(re.compile(
        rf"\s*(?:```\s*{CALL_END}\s*)?{CALL_BEGIN}function{SEP}(?P<name>[^\n]+?)\s*\n```(?:json)?\s*")),
)

V3_1 = CallFormat(
    name="deepseek-v3.1",
    markers=(SEP,),
    opens=(BEGIN,),
    close=END,
    parse=_calls,
    start=BEGIN,
    head=lambda name: f"{CALL_BEGIN}{name}{SEP}",
    tail=CALL_END,
    end=END,
    tags=_TAGS,
    streaming=Streaming(re.compile(rf"\s*(?:{CALL_END}\s*)?{CALL_BEGIN}(?P<name>[^<]+?){SEP}\s*")),
)


# V3.2 and V4 write DSML: ``<｜DSML｜function_calls>`` (V4: ``tool_calls``) around ``<｜DSML｜invoke name="...">`` elements, each
# with ``<｜DSML｜parameter name="..." string="true|false">value</｜DSML｜parameter>`` per parameter (a string's
# text as it is, another value as JSON).
DSML = "｜DSML｜"
_INVOKE = re.compile(rf'\s*<{DSML}invoke name="([^"]+)">(.*?)</{DSML}invoke>', re.DOTALL)
_PARAMETER = re.compile(rf'<{DSML}parameter name="([^"]+)"(?: string="(true|false)")?>(.*?)</{DSML}parameter>',
                        re.DOTALL)


def _dsml_calls(body: str, _schemas: Schemas) -> Optional[list[Call]]:
    calls, at = [], 0
    for invoke in _INVOKE.finditer(body):
        if invoke.start() != at:
            return None
        at = invoke.end()
        arguments = {}
        for key, string, value in _PARAMETER.findall(invoke.group(2)):
            try:
                arguments[key] = value if string != "false" else json.loads(value)
            except ValueError:
                arguments[key] = value
        calls.append(Call(invoke.group(1), arguments))
    return calls if calls and not body[at:].strip() else None


def _dsml(block: str) -> CallFormat:
    """DSML with its calls in ``block`` (V3.2: ``function_calls``, V4: ``tool_calls``)."""
    return CallFormat(
        name=f"deepseek-dsml-{block.replace('_', '-')}",
        markers=(DSML, f"{block}>"),
        opens=(f"<{DSML}{block}>",),
        close=f"</{DSML}{block}>",
        parse=_dsml_calls,
        start=f"<{DSML}{block}>\n",
        head=lambda name: f'<{DSML}invoke name="{name}">\n',
        tail=f"</{DSML}invoke>\n",
        end=f"</{DSML}{block}>",
        xml=XmlArguments(
            lambda key, kind: f'<{DSML}parameter name="{key}" string="{"true" if kind == "string" else "false"}">',
            f"</{DSML}parameter>\n"),
        streaming=Streaming(
            re.compile(rf'\s*<{DSML}invoke name="(?P<name>[^"]+)">'),
            re.compile(rf'\s*<{DSML}parameter name="(?P<key>[^"]+)"(?: string="(?P<string>true|false)")?>'),
            f"</{DSML}parameter>", call_end=re.compile(rf"\s*</{DSML}invoke>")),
    )


V3_2, V4 = _dsml("function_calls"), _dsml("tool_calls")
