"""The Responses API's protocol: its blueprint and its paths."""

from flask import Blueprint

from ...protocol import Protocol

bp = Blueprint("openai_responses", __name__)
PROTOCOL = Protocol("openai_responses", bp, prefixes=("/v1/responses",))
