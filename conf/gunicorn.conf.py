# gunicorn -c conf/gunicorn.conf.py 'kronk_wsgi:create_app()'
#
# The same server `kronk-wsgi serve` runs. kronk_wsgi's own settings come from
# KRONK_* variables or the TOML file named by KRONK_CONFIG (see the README).
import os

from kronk_wsgi.server import GUNICORN_DEFAULTS, on_starting  # noqa: F401  (a gunicorn hook)

# Worker model and timeouts: the same as `kronk-wsgi serve` (gevent worker, no preload)
globals().update(GUNICORN_DEFAULTS)

# Server socket
bind = os.environ.get("KRONK_BIND", "127.0.0.1:8000")

# Worker processes: one per core at most (each runs its own models)
workers = int(os.environ.get("KRONK_WORKERS", "1"))

# Logging: kronk_wsgi writes structured request logs itself
accesslog = None
errorlog = "-"
