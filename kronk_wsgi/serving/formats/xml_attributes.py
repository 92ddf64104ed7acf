"""MiniCPM 5: ``<function name="...">`` with a ``<param name="...">value</param>`` per parameter, for each
call (a string's value as it is, or in a CDATA section; another as JSON)."""

import re
from typing import Optional

from .base import Call, CallFormat, Schemas, XmlArguments, xml_value

_PARAM = re.compile(r'<param name="([^"]+)">(?:<!\[CDATA\[(.*?)\]\]>|(.*?))</param>', re.DOTALL)


def _calls(body: str, schemas: Schemas) -> Optional[list[Call]]:
    name, found, rest = body.partition('">')
    if not found or not name or '"' in name or "\n" in name:
        return None
    properties = (schemas.get(name) or {}).get("properties") or {}
    arguments = {key: data if data else xml_value(value, properties.get(key))
                 for key, data, value in _PARAM.findall(rest)}
    return [Call(name, arguments)] if not _PARAM.sub("", rest).strip() else None


MINICPM5 = CallFormat(
    name="minicpm5-xml",
    markers=('<function name=', '<param name='),
    opens=('<function name="',),
    close="</function>",
    parse=_calls,
    start='<function name="',
    head=lambda name: f'{name}">',
    between='</function><function name="',
    end="</function>",
    xml=XmlArguments(lambda key, _kind: f'<param name="{key}">', "</param>"),
)
