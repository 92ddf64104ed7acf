"""What makes a protocol: its routes, its paths and their rules, how its streams are framed, the shape of its
errors, its headers.

Each API module defines one ``Protocol``; the registry (``protocols.py``)
lists them. The app mounts their blueprints and root routes, the request
hooks take each path's rules (open, admin, unknown), error shape and headers
from it, and the response path its framing. Nothing outside a protocol's
module names its paths.
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
    ``open_paths`` need no key (probes), nor does any of its paths unless
    ``needs_key`` (static pages that ask for a key themselves); paths that start with one of
    ``admin_paths`` need an admin key: every route that changes what the server holds (its models, their files,
    a slot's state), whichever protocol defines it. A route taking a method other than GET is either one of them
    or one the test of every route's key lists as an ordinary key's (tests/test_hardening_four.py): a new one
    fails that test until it is put on one side. Any other path under one of
    ``unknown_below`` is its 404 (or 405); ``root`` answers ``GET /``, where the
    app serves it.
    """

    name: str
    blueprint: Blueprint
    prefixes: tuple[str, ...] = ()
    error_body: Callable[[ApiError], dict] = openai_error_body
    framing: Framing = SSE
    headers: Optional[Callable[[Response, RequestRecord], None]] = None
    open_paths: tuple[str, ...] = ()
    needs_key: bool = True
    admin_paths: tuple[str, ...] = ()
    unknown_below: tuple[str, ...] = ()
    root: Optional[Callable[[], Response]] = None

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
    """The registry: every protocol, which one a path speaks (the longest prefix; else the first), and the paths'
    rules of them all."""

    def __init__(self, protocols: Sequence[Protocol]) -> None:
        self.all = tuple(protocols)
        self._by_prefix = sorted(((p, protocol) for protocol in self.all for p in protocol.prefixes),
                                 key=lambda item: -len(item[0]))
        self.open_paths = frozenset(path for protocol in self.all for path in protocol.open_paths)
        self.admin_paths = tuple(path for protocol in self.all for path in protocol.admin_paths)
        self.unknown_below = tuple(path for protocol in self.all for path in protocol.unknown_below)
        roots = [protocol.root for protocol in self.all if protocol.root is not None]
        if len(roots) > 1:
            raise ValueError("more than one protocol answers GET /")
        self.root = roots[0] if roots else None

    def for_path(self, path: str) -> Protocol:
        for prefix, protocol in self._by_prefix:
            if path.startswith(prefix):
                return protocol
        return self.all[0]
