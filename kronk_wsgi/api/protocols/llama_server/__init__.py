"""llama.cpp's llama-server API: its native routes, for the editors, front ends, proxies and dashboards written
for it (/completion, /infill, /tokenize, /detokenize, /apply-template, /props, /slots, /health, and the router's
/models).

Requests without ``model`` go to the default model. Fields follow llama-server's names and defaults;
docs/PROTOCOLS.rst says what each does here, and which values are refused and why.

Its parts: the protocol (protocol.py), the bodies (schemas.py), the routes (views.py), the stream and answer
objects (encoder.py), the router's model endpoints (router.py), the slot actions (slots.py), the MCP tools (tools.py).
"""

from . import router, slots, tools, views  # noqa: F401 (their routes join the blueprint)
from .protocol import PROTOCOL

__all__ = ["PROTOCOL"]
