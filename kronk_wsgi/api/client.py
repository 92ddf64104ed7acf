"""Whether the client is still there, before the first write can tell."""

import select
import socket
from typing import Callable


def client_watch(environ: dict) -> Callable[[], bool]:
    """A check that the client closed its connection, where the server exposes the socket.

    gunicorn puts the socket in the environ; a readable socket whose peek
    returns no bytes has been closed by the peer.
    """
    sock = environ.get("gunicorn.socket")
    if sock is None:
        return lambda: False

    def gone() -> bool:
        try:
            readable, _, _ = select.select([sock], [], [], 0)
            return bool(readable) and sock.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True

    return gone
