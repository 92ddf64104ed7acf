"""llama-server's protocol: its blueprint, its paths, and its error shape."""

from flask import Blueprint

from ...errors import ApiError
from ...protocol import Protocol

bp = Blueprint("llama_server", __name__)

# llama-server's error types by status.
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 501: "not_supported_error", 503: "unavailable_error"}


def error_body(error: ApiError) -> dict:
    """``{"error": {"code", "message", "type"}}``, as llama-server answers errors."""
    kind = "exceed_context_size_error" if error.code == "context_length_exceeded" else \
        ERROR_TYPES.get(error.status, "server_error")
    return {"error": {"code": error.status, "message": error.message, "type": kind}}


PROTOCOL = Protocol(
    "llama_server", bp, error_body=error_body,
    prefixes=("/completion", "/infill", "/tokenize", "/detokenize", "/apply-template", "/props", "/slots", "/health",
              "/v1/health", "/models", "/rerank", "/reranking", "/v1/rerank", "/v1/reranking"),
    open_paths=("/health", "/v1/health"),
    # Saving, restoring and erasing a slot's state; loading and unloading a model for everyone.
    admin_paths=("/slots/", "/models/load", "/models/unload"),
)
