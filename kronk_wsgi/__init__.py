"""kronk_wsgi: a local LLM model server on WSGI."""

__version__ = "0.1.0"

from .app import Kronk, create_app  # noqa: E402

__all__ = ["Kronk", "create_app", "__version__"]
