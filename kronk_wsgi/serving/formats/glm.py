"""GLM 4.5-4.7 (and Ling, Spark, Laguna): ``<tool_call>name`` then ``<arg_key>key</arg_key>`` and
``<arg_value>value</arg_value>`` for each parameter, then ``</tool_call>``."""

import re
from typing import Optional

from .base import Call, CallFormat, Schemas, Streaming, XmlArguments, xml_value

_PAIR = re.compile(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


def _calls(body: str, schemas: Schemas) -> Optional[list[Call]]:
    name, _, rest = body.partition("<arg_key>")
    name = name.strip()
    rest = "<arg_key>" + rest if _ else ""
    if not name or "\n" in name or "<" in name:
        return None
    properties = (schemas.get(name) or {}).get("properties") or {}
    arguments, at = {}, 0
    for pair in _PAIR.finditer(rest):
        if pair.start() != at:
            return None
        key = pair.group(1).strip()
        arguments[key] = xml_value(pair.group(2), properties.get(key))
        at = pair.end()
    return [Call(name, arguments)] if not rest[at:].strip() else None


FORMAT = CallFormat(
    name="glm-xml",
    markers=("<arg_key>",),
    opens=("<tool_call>",),
    close="</tool_call>",
    parse=_calls,
    start="<tool_call>",
    head=lambda name: f"{name}\n",
    between="</tool_call>\n<tool_call>",
    end="</tool_call>",
    xml=XmlArguments(lambda key, _kind: f"<arg_key>{key}</arg_key>\n<arg_value>", "</arg_value>\n"),
    tags=("<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"),
    streaming=Streaming(re.compile(r"\s*(?P<name>[^\s<]+)\s*(?=<arg_key>)"),
                        re.compile(r"\s*<arg_key>(?P<key>[^<]*)</arg_key>\s*<arg_value>"), "</arg_value>"),
)
