"""Functionary v3.1: ``<function=name>{...}</function>`` for each call."""

import json
from typing import Optional

from .base import Call, CallFormat, Schemas, named_call


def _calls(body: str, _schemas: Schemas) -> Optional[list[Call]]:
    name, found, arguments = body.partition(">")
    if not found or not name.strip() or "\n" in name:
        return None
    try:
        value = json.loads(arguments)
    except ValueError:
        return None
    call = named_call(name.strip(), value)
    return [call] if call is not None else None


V3_1 = CallFormat(
    name="functionary-v3.1",
    markers=("<function=", "python_tag"),
    opens=("<function=",),
    close="</function>",
    parse=_calls,
    start="<function=",
    head=lambda name: f"{name}>",
    between="</function><function=",
    end="</function>",
)
