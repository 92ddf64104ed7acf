"""Calls as XML elements, a parameter each: Qwen3-Coder's ``<tool_call>\\n<function=name>\\n<parameter=key>\\n
value\\n</parameter>\\n</function>\\n</tool_call>`` (Qwen3-Coder, Qwen3.5, Nemotron 3, Step 3.5), and Seed-OSS's
the same inside ``<seed:tool_call>``. A string parameter's value is its text, another's is JSON."""

import re
from typing import Optional

from .base import Call, CallFormat, Schemas, Streaming, XmlArguments, xml_value

_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.DOTALL)
# Qwen3-Coder puts its values on lines of their own; Seed-OSS writes them as they are.
_LINED = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)
_INLINE = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)
_FUNCTION_END = re.compile(r"\s*</function>")


def _calls(body: str, schemas: Schemas, parameter: re.Pattern = _LINED) -> Optional[list[Call]]:
    calls = []
    at = 0
    for function in _FUNCTION.finditer(body):
        if body[at:function.start()].strip() not in ("", "</tool_call>\n<tool_call>", "</tool_call><tool_call>"):
            return None
        at = function.end()
        name = function.group(1).strip()
        properties = (schemas.get(name) or {}).get("properties") or {}
        arguments = {key.strip(): xml_value(value, properties.get(key.strip()))
                     for key, value in parameter.findall(function.group(2))}
        calls.append(Call(name, arguments))
    return calls if calls and not body[at:].strip() else None


QWEN3_CODER = CallFormat(
    name="qwen3-coder-xml",
    markers=("<function=", "<parameter=", "<tool_call>"),
    opens=("<tool_call>",),
    kept=("<function=",),  # some models leave out the first <tool_call>
    close="</tool_call>",
    parse=_calls,
    start="<tool_call>\n",
    head=lambda name: f"<function={name}>\n",
    tail="</function>\n",
    between="</tool_call>\n<tool_call>\n",
    end="</tool_call>",
    xml=XmlArguments(lambda key, _kind: f"<parameter={key}>\n", "\n</parameter>\n"),
    tags=("<tool_call>", "</tool_call>"),
    streaming=Streaming(re.compile(r"\s*(?:</tool_call>\s*<tool_call>\s*)?<function=(?P<name>[^>\n]+)>\n?"),
                        re.compile(r"\s*<parameter=(?P<key>[^>\n]+)>\n?"), "</parameter>", trim=True,
                        call_end=_FUNCTION_END),
)

SEED_OSS = CallFormat(
    name="seed-oss-xml",
    markers=("<seed:tool_call>",),
    opens=("<seed:tool_call>",),
    close="</seed:tool_call>",
    parse=lambda body, schemas: _calls(body, schemas, _INLINE),
    start="<seed:tool_call>\n",
    head=lambda name: f"<function={name}>\n",
    tail="</function>\n",
    between="</seed:tool_call>\n<seed:tool_call>\n",
    end="</seed:tool_call>",
    xml=XmlArguments(lambda key, _kind: f"<parameter={key}>", "</parameter>\n"),
    tags=("<seed:tool_call>", "</seed:tool_call>"),
    streaming=Streaming(
        re.compile(r"\s*(?:</seed:tool_call>\s*<seed:tool_call>\s*)?<function=(?P<name>[^>\n]+)>\n?"),
        re.compile(r"\s*<parameter=(?P<key>[^>\n]+)>"), "</parameter>", call_end=_FUNCTION_END),
)
