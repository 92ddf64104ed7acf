# gunicorn -c conf/gunicorn.conf.py 'kronk_wsgi:create_app()'
#
# The same server `kronk-wsgi serve` runs. kronk_wsgi's own settings come from
# KRONK_* variables or the TOML file named by KRONK_CONFIG (see the README).
import os

from kronk_wsgi.server import GUNICORN_DEFAULTS, on_starting  # noqa: F401  (a gunicorn hook)

# Server socket
bind = os.environ.get("KRONK_BIND", "127.0.0.1:8000")

# Worker processes: gevent, one per core at most (each runs its own models)
workers = int(os.environ.get("KRONK_WORKERS", "1"))
worker_class = GUNICORN_DEFAULTS["worker_class"]
worker_connections = GUNICORN_DEFAULTS["worker_connections"]
timeout = GUNICORN_DEFAULTS["timeout"]
graceful_timeout = GUNICORN_DEFAULTS["graceful_timeout"]
keepalive = GUNICORN_DEFAULTS["keepalive"]
preload_app = GUNICORN_DEFAULTS["preload_app"]

# Logging: kronk_wsgi writes structured request logs itself
accesslog = None
errorlog = "-"
