"""kronk_wsgi: a local LLM model server on WSGI."""

__version__ = "0.1.0"

__all__ = ["Kronk", "create_app", "__version__"]


def __getattr__(name: str):
    """Kronk and create_app on first use: `kronk-wsgi serve` must not import the engine (and ssl) before
    gunicorn's gevent worker patches the standard library."""
    if name in ("Kronk", "create_app"):
        from . import app

        return getattr(app, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
