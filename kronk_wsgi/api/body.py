"""Reading a request body: its bytes within limits of size and time, strict JSON, then validation off the event loop."""

import json
import math
from typing import Any, Optional, Type, TypeVar

import gevent
import pydantic
from flask import request
from pydantic import BaseModel

from ..serving import offload
from .errors import ApiError, invalid
from .media import fetch, fetching
from .state import state

M = TypeVar("M", bound=BaseModel)


def _param(data: Any, loc: tuple, missing: bool) -> Optional[str]:
    """pydantic's error location as OpenAI's param string: messages[0].content.

    The location also names union members and tags; only the parts found in
    the request itself (or a missing field, at the end) are kept.
    """
    out = ""
    for position, part in enumerate(loc):
        last = position == len(loc) - 1
        if isinstance(part, int) and isinstance(data, list) and 0 <= part < len(data):
            out += f"[{part}]"
            data = data[part]
        elif isinstance(part, str) and ((isinstance(data, dict) and part in data) or (last and missing)):
            out += ("." if out else "") + part
            data = data.get(part) if isinstance(data, dict) else None
    return out or None


class _NotJSON(ValueError):
    """A value Python's json module takes but JSON does not have."""


def _non_finite(name: str) -> None:
    raise _NotJSON(f"{name} is not a JSON number")


def _finite(literal: str) -> float:
    """A JSON number with a fraction or exponent; one past a double's range (1e400) is refused as NaN is."""
    value = float(literal)
    if math.isinf(value):
        raise _NotJSON(f"the number {literal[:30]} is too large")
    return value


READ_CHUNK = 1 << 20


def _read_body() -> bytes:
    """The body's bytes; 413 past max_body_bytes, for a chunked body too."""
    stream = request.stream  # a declared length past the limit is a 413 here
    limit = request.max_content_length
    seconds = state().settings.body_timeout
    chunks, size = [], 0
    timer = gevent.Timeout.start_new(seconds)
    try:
        # A megabyte at a time, yielding in between: data already waiting in the socket would
        # otherwise be read in one go, with every other request of the worker kept waiting.
        while limit is None or size < limit:
            chunk = stream.read(READ_CHUNK if limit is None else min(READ_CHUNK, limit - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
            gevent.sleep(0)
    except gevent.Timeout as exc:
        if exc is not timer:
            raise
        raise ApiError(408, f"the body did not arrive within {seconds:g} s", code="request_timeout") from None
    finally:
        timer.cancel()
    body = b"".join(chunks)
    if request.content_length is None and limit is not None and len(body) >= limit:
        # A chunked body is cut at the limit: if more follows, it was too large. Up to 1 MB of the
        # rest is read, so that the client sees the 413 rather than a connection reset.
        if request.environ["wsgi.input"].read(1 << 20):
            raise ApiError(413, f"the body is larger than {limit} bytes", code="request_too_large")
    return body


def _loads(body: bytes) -> Any:
    """Strict JSON: NaN and Infinity are refused by name, deep nesting is a 400 too."""
    try:
        return json.loads(body, parse_constant=_non_finite, parse_float=_finite)
    except _NotJSON as exc:
        raise invalid(f"the body is not valid JSON: {exc}") from None
    except RecursionError:
        raise invalid("the body is not valid JSON: it is nested too deeply") from None
    except ValueError:
        raise invalid("the body is not valid JSON") from None


def _check_values(data: Any, limit: int) -> None:
    """413 if the body holds more than ``limit`` JSON values (validation time grows with their number); 400 naming
    the field if a string holds a lone surrogate ("\\ud800"), which JSON allows and text cannot hold."""
    pending: list[tuple[Any, Optional[tuple]]] = [(data, None)]  # each value with its place: (parent's, key)
    seen = 0
    while pending:
        value, place = pending.pop()
        seen += 1
        if seen > limit:
            raise ApiError(413, f"the body holds more than {limit} JSON values (max_body_values)",
                           code="request_too_large")
        if isinstance(value, dict):
            for key, item in value.items():
                _check_text(key, place, data)
                pending.append((item, (place, key)))
        elif isinstance(value, list):
            pending.extend((item, (place, index)) for index, item in enumerate(value))
        elif isinstance(value, str):
            _check_text(value, place, data)


def _check_text(text: str, place: Optional[tuple], data: Any) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        loc: tuple = ()
        while place is not None:
            place, key = place
            loc = (key, *loc)
        param = _param(data, loc, missing=False)
        raise invalid(f"{param or 'the body'}: a string holds a lone surrogate, which is not text",
                      param=param) from None


def _check_strings(body: bytes, limit: int) -> None:
    """413 if the body's text alone shows more than ``limit`` JSON values, before it is parsed: parsing holds the
    GIL throughout (100 ms for 4 MB), and the event loop waits for it.

    Every string (key or value) has two quotes; the quotes a backslash comes before (the escaped ones, and now and
    then a closing one) left out, half the rest is a floor on the strings. A value is at most one key's and at
    most one string, so the values are at least half the strings."""
    quotes = body.count(b'"') - body.count(b'\\"')
    if quotes // 4 > limit:
        raise ApiError(413, f"the body holds more than {limit} JSON values (max_body_values)",
                       code="request_too_large")


def _decode(schema: Type[M], body: bytes, max_values: int, media_allow: list[str]) -> tuple[M, list]:
    """Parse, bound and validate a body: CPU work, run in a worker thread, off the event loop. With it, the parts
    naming a file at a URL to fetch (see media.fetch)."""
    _check_strings(body, max_values)
    data = _loads(body)
    if not isinstance(data, dict):
        raise invalid("the body must be a JSON object")
    _check_values(data, max_values)
    try:
        with fetching(media_allow) as remote:
            return schema.model_validate(data), remote
    except pydantic.ValidationError as exc:
        # The deepest error: for a union (str or list of parts) the branch that got furthest;
        # at equal depth, a broken constraint says more than a wrong type.
        error = max(exc.errors(include_url=False), key=lambda e: (len(e["loc"]), not e["type"].endswith("_type")))
        param = _param(data, error["loc"], error["type"] == "missing")
        if error["type"] == "extra_forbidden":
            raise invalid(f"unrecognized request argument supplied: {param}", param=param) from None
        if error["type"] == "missing":
            raise invalid(f"missing required parameter: {param}", param=param) from None
        where = f"{param}: " if param else ""
        message = error["msg"].removeprefix("Value error, ")
        raise invalid(f"{where}{message}", param=param) from None


def parse_body(schema: Type[M], json_type: bool = True) -> M:
    """The JSON body as ``schema``; a 400 naming the offending param otherwise.

    With ``json_type`` false the body is JSON whatever its Content-Type says (Ollama's clients send none).
    """
    if json_type and not request.is_json:
        raise invalid("the body must be JSON, sent with Content-Type: application/json")
    body = _read_body()
    kronk = state()
    parsed, remote = offload.call(kronk.body_thread, _decode, schema, body, kronk.settings.max_body_values,
                                  kronk.settings.media_allow)
    fetch(remote)
    return parsed
