"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API.

Its parts: the protocol and its error shape (protocol.py), the request bodies (schemas.py), the views
(views.py), and the stream events and whole message (encoder.py).
"""

from . import views  # noqa: F401 (its routes join the blueprint)
from .protocol import PROTOCOL

__all__ = ["PROTOCOL"]
