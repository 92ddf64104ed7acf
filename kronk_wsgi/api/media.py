"""Images and sounds in requests: read from the body (data URLs, base64), checked, and marked where they stand.

Each protocol reads its parts into ``MediaInput``s and writes ``marker(data)``
where each stands in a message's text, as llama-server does. Planning finds the
markers in the rendered prompt and puts each image's tokens in its place; a
marker of an image the request does not hold is text like any other (a client
that writes one gets nothing it did not send). A stored conversation keeps its
messages' images beside them (``stored``), so a later turn holds them too.
"""

import base64
import binascii
import contextlib
import contextvars
import dataclasses
import hashlib
import os
import re
from typing import Any, Iterable, Iterator, Optional, Sequence, Union

import gevent
import requests

from .errors import invalid

MAX_MEDIA_BYTES = 20 * 1024 * 1024  # one image or sound, decoded (OpenAI's limit for an image)
MAX_MEDIA = 32  # images and sounds in one request
FETCH_SECONDS = 10.0  # the longest a URL the media_allow setting allows may take to give its file

MARKER = re.compile(r"<__media_([0-9a-f]{32})__>")
# Where a file of multimodal_data goes in a llama-server prompt_string (/props says it): llama.cpp's own marker,
# or the one LLAMA_MEDIA_MARKER names, as llama-server reads it.
MEDIA_MARKER = os.environ.get("LLAMA_MEDIA_MARKER") or "<__media__>"
DATA_URL = re.compile(r"data:(?P<type>[\w.+-]+/[\w.+-]+)?(?P<params>(;[^,;]*)*?);base64,(?P<data>.*)", re.DOTALL)


@dataclasses.dataclass(frozen=True)
class MediaInput:
    """One image or sound of a request, and the body's name for where it was given."""

    data: bytes
    param: str


def key(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:32]


def marker(data: bytes) -> str:
    """What stands for ``data`` in a message's text until its tokens take its place."""
    return f"<__media_{key(data)}__>"


def joined(parts: Sequence[Union[str, bytes]]) -> str:
    """A message's content parts (texts, and media as their bytes) as one text for its template: the texts run
    together; with a medium among them, joined by newlines, each medium's marker in its place with no newline
    beside it, as llama-server joins them."""
    if not any(isinstance(part, bytes) for part in parts):
        return "".join(parts)
    text, after_media = "", False
    for part in parts:
        if isinstance(part, bytes):
            text += marker(part)
            after_media = True
            continue
        if text and not after_media:
            text += "\n"
        text += part
        after_media = False
    return text


def stored(message: dict, parts: Sequence[Union[str, bytes]]) -> dict:
    """A template message that keeps the media among its ``parts`` (base64, by key) for the conversation store."""
    media = {key(part): base64.b64encode(part).decode() for part in parts if isinstance(part, bytes)}
    return {**message, "media": media} if media else message


def from_store(messages: Iterable[dict], param: str) -> list[MediaInput]:
    """The media stored template messages keep, as given by ``param`` (previous_response_id)."""
    return [MediaInput(base64.b64decode(data), param) for message in messages
            for data in message.get("media", {}).values()]


def decode_base64(text: str) -> bytes:
    """The bytes of base64 ``text``; ValueError if it is not base64 or is empty."""
    try:
        data = base64.b64decode(text.strip(), validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("it is not valid base64") from None
    if not data:
        raise ValueError("it is empty")
    return data


# While a body is validated (in its thread): the URL prefixes the media_allow setting allows, and the parts that
# name such a URL, each with the URL, to be fetched once the body is valid.
_FETCHING: contextvars.ContextVar[Optional[tuple[tuple[str, ...], list]]] = contextvars.ContextVar("fetching",
                                                                                                   default=None)


@contextlib.contextmanager
def fetching(allowed: Sequence[str]) -> Iterator[list]:
    """Validate a body in this block: the parts whose URLs ``allowed`` lets this server fetch are collected, as
    (url, part), for ``fetch``."""
    found: list = []
    token = _FETCHING.set((tuple(allowed), found))
    try:
        yield found
    finally:
        _FETCHING.reset(token)


def media_url(url: str, part: Any, kinds: tuple[str, ...] = ("image",)) -> bytes:
    """The bytes of a base64 data URL of one of ``kinds`` (MIME types' first parts); for an http(s) URL under the
    media_allow setting's prefixes, none yet (``part`` is fetched for, its ``_data`` set by ``fetch``); ValueError
    for any other URL: no request makes this server reach an address the operator did not allow."""
    if url.startswith(("http://", "https://")):
        allowed, found = _FETCHING.get() or ((), [])
        if any(url.startswith(prefix) for prefix in allowed):
            found.append((url, part))
            return b""
    return data_url(url, kinds)


def fetch(found: Sequence[tuple[str, Any]]) -> None:
    """Fetch each (url, part)'s file into its part (on the event loop: gevent's sockets wait cooperatively), no
    redirect followed, each within FETCH_SECONDS and MAX_MEDIA_BYTES; a 400 naming the URL if one cannot be."""
    for url, part in found:
        try:
            with gevent.Timeout(FETCH_SECONDS, TimeoutError(f"no file within {FETCH_SECONDS:g} s")), \
                    requests.get(url, stream=True, timeout=FETCH_SECONDS, allow_redirects=False) as reply:
                if reply.status_code != 200:
                    raise ValueError(f"it answered {reply.status_code}")
                data = b""
                for piece in reply.iter_content(1 << 16):
                    data += piece
                    if len(data) > MAX_MEDIA_BYTES:
                        raise ValueError(f"its file is more than {MAX_MEDIA_BYTES} bytes")
        except (requests.RequestException, ValueError, TimeoutError) as exc:
            raise invalid(f"the file at {url[:200]} could not be fetched: {exc}") from None
        if not data:
            raise invalid(f"the file at {url[:200]} is empty")
        part._data = data


def data_url(url: str, kinds: tuple[str, ...] = ("image",)) -> bytes:
    """The bytes of a base64 data URL of one of ``kinds`` (MIME types' first parts); ValueError for anything else."""
    if not url.startswith("data:"):
        raise ValueError("this server fetches only the URLs its media_allow setting allows (none by default): send "
                         "the file itself, as a base64 data URL (data:image/png;base64,...)")
    found = DATA_URL.fullmatch(url)
    if found is None:
        raise ValueError("a data URL here is base64: data:<type>;base64,<data>")
    media_type = found["type"] or ""
    if media_type.split("/")[0] not in kinds:
        raise ValueError(f"a data URL of type {media_type or 'text/plain'!r} is no {' or '.join(kinds)}")
    return decode_base64(found["data"])


def inputs(found: Iterable[MediaInput]) -> dict[str, MediaInput]:
    """A request's media by key, each checked against the limits; 400 naming the first that is over one."""
    media: dict[str, MediaInput] = {}
    for given in found:
        if len(given.data) > MAX_MEDIA_BYTES:
            raise invalid(f"{given.param}: the file is {len(given.data)} bytes; one may be at most "
                          f"{MAX_MEDIA_BYTES}", param=given.param)
        media.setdefault(key(given.data), given)
        if len(media) > MAX_MEDIA:
            raise invalid(f"{given.param}: one request may hold at most {MAX_MEDIA} images and sounds",
                          param=given.param)
    return media


def first_param(media: dict[str, MediaInput]) -> Optional[str]:
    """Where the request gave its first medium."""
    return next(iter(media.values())).param if media else None
