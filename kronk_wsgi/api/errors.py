"""API errors: raised anywhere before the commit, rendered in the shape of the route's protocol."""

from typing import Optional

from werkzeug.exceptions import HTTPException

# OpenAI's error types by status (the ``type`` every protocol that takes OpenAI's error shape shows).
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "timeout",
    413: "invalid_request_error",
    414: "invalid_request_error",
    415: "invalid_request_error",
    417: "invalid_request_error",
    429: "rate_limit_error",
    431: "invalid_request_error",
    499: "client_closed_request",
    503: "service_unavailable",
    504: "timeout",
}


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

    @classmethod
    def from_http(cls, exc: HTTPException) -> "ApiError":
        """Werkzeug's routing and body errors (404, 405, 413, ...)."""
        status = exc.code or 500
        headers = {"Allow": ", ".join(exc.valid_methods)} if getattr(exc, "valid_methods", None) else None
        codes = {404: "unknown_url", 405: "method_not_allowed", 413: "request_too_large"}
        return cls(status, exc.description or exc.name, code=codes.get(status), headers=headers)


def openai_error_body(error: ApiError) -> dict:
    return {"error": {"message": error.message, "type": error.type, "code": error.code, "param": error.param}}


def invalid(message: str, param: Optional[str] = None, code: Optional[str] = None) -> ApiError:
    """A 400 for bad input."""
    return ApiError(400, message, param=param, code=code)


class PromptTooLong(ApiError):
    """A 400 for a prompt that leaves no room in the context: ``tokens`` (at least) against the ``most`` a prompt
    may have, which agents read to compact their conversation."""

    def __init__(self, tokens: int, most: int, message: str, param: str) -> None:
        super().__init__(400, message, param=param, code="context_length_exceeded")
        self.tokens = tokens
        self.most = most


def model_not_found(model_id: str) -> ApiError:
    """A 404 for a model id that is not configured."""
    shown = model_id if len(model_id) <= 100 else model_id[:100] + "..."
    return ApiError(404, f"the model {shown!r} does not exist", code="model_not_found", param="model")
