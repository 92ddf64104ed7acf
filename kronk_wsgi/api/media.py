"""Images and sounds in requests: read from the body (data URLs, base64), checked, and marked where they stand.

Each protocol reads its parts into ``MediaInput``s and writes ``marker(data)``
where each stands in a message's text, as llama-server does. The markers are
this process's own (a random nonce), so no client text can forge one; planning
finds them in the rendered prompt and puts each image's tokens in its place.
"""

import base64
import binascii
import dataclasses
import hashlib
import re
import secrets
from typing import Iterable, Optional, Sequence, Union

from .errors import invalid

MAX_MEDIA_BYTES = 20 * 1024 * 1024  # one image or sound, decoded (OpenAI's limit for an image)
MAX_MEDIA = 32  # images and sounds in one request

_NONCE = secrets.token_hex(8)
MARKER = re.compile(rf"<__media_{_NONCE}_([0-9a-f]{{32}})__>")
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
    return f"<__media_{_NONCE}_{key(data)}__>"


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


def decode_base64(text: str) -> bytes:
    """The bytes of base64 ``text``; ValueError if it is not base64 or is empty."""
    try:
        data = base64.b64decode(text.strip(), validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("it is not valid base64") from None
    if not data:
        raise ValueError("it is empty")
    return data


def data_url(url: str, kinds: tuple[str, ...] = ("image",)) -> bytes:
    """The bytes of a base64 data URL of one of ``kinds`` (MIME types' first parts); ValueError for anything else:
    a URL to fetch is not fetched here."""
    if not url.startswith("data:"):
        raise ValueError("this server fetches no URLs: send the file itself, as a base64 data URL "
                         "(data:image/png;base64,...)")
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
    for index, given in enumerate(found):
        if len(given.data) > MAX_MEDIA_BYTES:
            raise invalid(f"{given.param}: the file is {len(given.data)} bytes; one may be at most "
                          f"{MAX_MEDIA_BYTES}", param=given.param)
        if index >= MAX_MEDIA:
            raise invalid(f"{given.param}: one request may hold at most {MAX_MEDIA} images and sounds",
                          param=given.param)
        media.setdefault(key(given.data), given)
    return media


def first_param(media: dict[str, MediaInput]) -> Optional[str]:
    """Where the request gave its first medium."""
    return next(iter(media.values())).param if media else None
