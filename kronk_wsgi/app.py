"""The app factory and the Flask extension that embeds kronk_wsgi in any app."""

from pathlib import Path
from typing import Any, Mapping, Optional

import structlog
from flask import Blueprint, Flask, request
from flask_cors import CORS
from gevent.threadpool import ThreadPool
from werkzeug.exceptions import HTTPException
from werkzeug.middleware.proxy_fix import ProxyFix

from .api import hooks
from .api.errors import ApiError
from .api.protocols import PROTOCOLS
from .api.response_store import ResponseStore
from .api.sealing import Sealer
from .api.state import KronkState
from .config import LOOPBACK_HOSTS, FIELDS, Settings, cache_dir, config_key, read_config, settings_from_config
from .logs import configure_logging
from .mcp_servers.client import McpServers
from .metrics import Metrics
from .serving.pool import ModelPool

log = structlog.get_logger("kronk_wsgi.app")


class Kronk:
    """Registers kronk_wsgi's API on a Flask app: ``Kronk(app)`` or ``Kronk().init_app(app)``.

    Reads the KRONK_* keys of app.config (see the README's configuration
    table); state lives in ``app.extensions["kronk"]``, so several apps per
    process each get their own models. It registers and starts nothing: the
    default model loads when the server starts a worker, else on the app's
    first request to these routes (``KronkState.start``). The routes, their request hooks and
    their error handlers belong to one blueprint, mounted at ``url_prefix``
    (``/v1/...`` by default; ``"/llm"`` gives ``/llm/v1/...``).
    """

    def __init__(self, app: Optional[Flask] = None, url_prefix: str = "", serve_root: Optional[bool] = None) -> None:
        if app is not None:
            self.init_app(app, url_prefix, serve_root)

    def init_app(self, app: Flask, url_prefix: str = "", serve_root: Optional[bool] = None) -> None:
        """``serve_root``: answer ``GET /`` at the prefix's root as the protocol that has a root route says
        (Ollama's probe: "Ollama is running"); by default only below a url_prefix, so a host app's own ``/``
        stays its own."""
        if "kronk" in app.extensions:
            raise RuntimeError("kronk_wsgi is already initialized on this app; call init_app once per app")
        for name in FIELDS:
            field = Settings.model_fields[name]
            app.config.setdefault(config_key(name), field.get_default(call_default_factory=True))
        settings = settings_from_config(app.config)
        metrics = Metrics()
        pool = ModelPool(settings, metrics)
        # One thread parses bodies: the work holds the GIL, and two threads handing it to each other would
        # starve the event loop longer.
        body_thread = ThreadPool(1)
        prefix = url_prefix.rstrip("/")
        store = ResponseStore(Path(settings.responses_db or cache_dir() / "responses.sqlite3"), settings.responses_keep,
                              settings.responses_max_mb * 1_000_000)
        sealer = Sealer(cache_dir() / "reasoning.key")
        app.extensions["kronk"] = KronkState(settings, pool, metrics, body_thread, store, ThreadPool(1), sealer,
                                             PROTOCOLS, McpServers(settings.mcp_servers), prefix)
        api = Blueprint("kronk", __name__)
        for protocol in PROTOCOLS.all:
            api.register_blueprint(protocol.blueprint)
        if PROTOCOLS.root is not None and (serve_root if serve_root is not None else bool(prefix)):
            api.add_url_rule("/", "root", PROTOCOLS.root, methods=["GET", "HEAD"])
        hooks.install(api, PROTOCOLS)
        origins = settings.cors_origins if "*" in settings.cors_origins else [*settings.cors_origins, *hooks.LOCAL_ORIGINS]
        CORS(api, origins=origins, expose_headers=["X-Request-ID", "request-id"], max_age=600)
        app.register_blueprint(api, url_prefix=prefix or None)


def create_app(config: Optional[Mapping[str, Any]] = None) -> Flask:
    """The standalone app: settings from the TOML file and KRONK_* variables, then ``config``."""
    configure_logging()
    app = Flask("kronk_wsgi")
    app.config.update(read_config())
    app.config.update(config or {})
    settings = settings_from_config(app.config)
    if not settings.allowed_hosts and settings.loopback_bind():
        app.config[config_key("allowed_hosts")] = list(LOOPBACK_HOSTS)
    # A path with doubled slashes is not redirected to its single-slash twin (a redirect built from the Host
    # header the client chose): it is simply not an API path.
    app.url_map.merge_slashes = False
    Kronk(app, serve_root=True)
    if settings.proxy_hops:
        app.wsgi_app = ProxyFix(app.wsgi_app, x_for=settings.proxy_hops, x_proto=0)
    # The standalone server is all API: paths outside kronk_wsgi's routes answer in JSON too.
    app.register_error_handler(
        HTTPException, lambda exc: PROTOCOLS.for_path(request.path).error_response(ApiError.from_http(exc)))
    return app
