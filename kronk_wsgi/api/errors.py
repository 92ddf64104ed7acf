"""API errors: raised anywhere before the commit, rendered in the route's protocol's error shape."""

from typing import Optional

from flask import Response, jsonify
from werkzeug.exceptions import HTTPException

# OpenAI's error types by status.
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "timeout",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    499: "client_closed_request",
    503: "service_unavailable",
    504: "timeout",
}


# Anthropic's error types by status.
_ANTHROPIC_TYPES = {
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

ANTHROPIC_PREFIX = "/v1/messages"


class ApiError(Exception):
    """A failure with its HTTP status, shown to the client as it is."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: Optional[str] = None,
        param: Optional[str] = None,
        headers: Optional[dict[str, str]] = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.headers = headers or {}

    @property
    def type(self) -> str:
        return _TYPES.get(self.status, "server_error")

    @property
    def anthropic_type(self) -> str:
        return _ANTHROPIC_TYPES.get(self.status, "api_error")

    @classmethod
    def from_http(cls, exc: HTTPException) -> "ApiError":
        """Werkzeug's routing and body errors (404, 405, 413, ...)."""
        status = exc.code or 500
        headers = {"Allow": ", ".join(exc.valid_methods)} if getattr(exc, "valid_methods", None) else None
        codes = {404: "unknown_url", 405: "method_not_allowed", 413: "request_too_large"}
        return cls(status, exc.description or exc.name, code=codes.get(status), headers=headers)


def invalid(message: str, param: Optional[str] = None, code: Optional[str] = None) -> ApiError:
    """A 400 for bad input."""
    return ApiError(400, message, param=param, code=code)


def model_not_found(model_id: str) -> ApiError:
    """A 404 for a model id that is not configured."""
    shown = model_id if len(model_id) <= 100 else model_id[:100] + "..."
    return ApiError(404, f"the model {shown!r} does not exist", code="model_not_found", param="model")


def openai_error_body(error: ApiError) -> dict:
    return {"error": {"message": error.message, "type": error.type, "code": error.code, "param": error.param}}


def anthropic_error_body(error_type: str, message: str) -> dict:
    return {"type": "error", "error": {"type": error_type, "message": message}}


def error_response(error: ApiError, path: str) -> Response:
    """The error in the shape of the protocol that ``path`` speaks."""
    if path.startswith(ANTHROPIC_PREFIX):
        response = jsonify(anthropic_error_body(error.anthropic_type, error.message))
    else:
        response = jsonify(openai_error_body(error))
    response.status_code = error.status
    response.headers.update(error.headers)
    return response
