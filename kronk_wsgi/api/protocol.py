"""What makes a protocol: its routes, how its streams are framed, the shape of its errors, its headers.

Each API module defines one ``Protocol``; the registry (``protocols.py``)
lists them. The app mounts their blueprints, the request hooks take each
path's error shape and headers from it, and the response path its framing.
"""

import dataclasses
from typing import Callable, Iterable, Optional, Sequence

from flask import Blueprint, Response, jsonify

from .errors import ApiError, openai_error_body
from .state import RequestRecord


@dataclasses.dataclass(frozen=True)
class Framing:
    """How a stream goes on the wire: its media type, and the frame sent after a keep-alive interval of silence."""

    media_type: str
    keepalive: str


SSE = Framing("text/event-stream", ": keep-alive\n\n")


@dataclasses.dataclass(frozen=True)
class Protocol:
    """One protocol's routes (``blueprint``) and the paths it answers for (``prefixes``, below the url_prefix).

    ``error_body`` shapes its errors, ``framing`` its streams, and ``headers``
    (if given) adds headers to each of its responses from the request's record.
    """

    name: str
    blueprint: Blueprint
    prefixes: tuple[str, ...] = ()
    error_body: Callable[[ApiError], dict] = openai_error_body
    framing: Framing = SSE
    headers: Optional[Callable[[Response, RequestRecord], None]] = None

    def error_response(self, error: ApiError) -> Response:
        """The error in this protocol's shape, with its status and headers."""
        response = jsonify(self.error_body(error))
        response.status_code = error.status
        response.headers.update(error.headers)
        return response

    def stream(self, frames: Iterable[str]) -> Response:
        """The commit: 200 with this protocol's media type, no caching, no proxy buffering."""
        response = Response(frames, status=200, mimetype=self.framing.media_type)
        response.headers["Cache-Control"] = "no-cache"
        response.headers["X-Accel-Buffering"] = "no"
        return response


class Protocols:
    """The registry: every protocol, and which one a path speaks (the longest prefix; else the first)."""

    def __init__(self, protocols: Sequence[Protocol]) -> None:
        self.all = tuple(protocols)
        self._by_prefix = sorted(((p, protocol) for protocol in self.all for p in protocol.prefixes),
                                 key=lambda item: -len(item[0]))

    def for_path(self, path: str) -> Protocol:
        for prefix, protocol in self._by_prefix:
            if path.startswith(prefix):
                return protocol
        return self.all[0]
