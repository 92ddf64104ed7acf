"""kronk_wsgi: a local LLM model server on WSGI."""

__version__ = "0.1.0"
