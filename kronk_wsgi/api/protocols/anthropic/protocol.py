"""Anthropic's Messages API protocol: its blueprint, its error shape and types, its request-id headers and its
ping keep-alive."""

from flask import Blueprint, Response

from ...errors import ApiError, PromptTooLong
from ...protocol import Framing, Protocol
from ...sse import sse
from ...state import RequestRecord

bp = Blueprint("anthropic", __name__)

# Anthropic's error types by status.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "request_too_large",
    415: "invalid_request_error",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
}


def error_body(error_type: str, message: str) -> dict:
    return {"type": "error", "error": {"type": error_type, "message": message}}


def api_error_body(error: ApiError) -> dict:
    """An error in Anthropic's shape; a prompt too long in Anthropic's words, which Claude Code reads to compact."""
    message = f"prompt is too long: {error.tokens} tokens > {error.most} maximum" \
        if isinstance(error, PromptTooLong) else error.message
    return error_body(ERROR_TYPES.get(error.status, "api_error"), message)


def _request_ids(response: Response, rec: RequestRecord) -> None:
    """Anthropic's clients read the id here: the message's id once there is one."""
    response.headers["request-id"] = response.headers["anthropic-request-id"] = rec.response_id or rec.request_id


PROTOCOL = Protocol(
    "anthropic", bp, prefixes=("/v1/messages",),
    error_body=api_error_body,
    framing=Framing("text/event-stream", sse({"type": "ping"}, "ping")), headers=_request_ids,
)
