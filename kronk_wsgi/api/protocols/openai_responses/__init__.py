"""/v1/responses: OpenAI's Responses API, streamed or whole; responses kept for GET and previous_response_id.

Its parts: the protocol (protocol.py), the request body (schemas.py), the views and the response store's
use (views.py), and the numbered stream events and whole response (encoder.py).
"""

from . import views  # noqa: F401 (its routes join the blueprint)
from .protocol import PROTOCOL

__all__ = ["PROTOCOL"]
