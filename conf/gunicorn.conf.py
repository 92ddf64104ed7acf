# gunicorn -c conf/gunicorn.conf.py 'kronk_wsgi:create_app()'
#
# The same server `kronk-wsgi serve` runs. kronk_wsgi's own settings come from
# KRONK_* variables or the TOML file named by KRONK_CONFIG (see the README).
import os

from kronk_wsgi import server
from kronk_wsgi.config import read_config, settings_from_config
from kronk_wsgi.server import GUNICORN_DEFAULTS, child_exit, on_exit, on_starting, post_worker_init  # noqa: F401

# Worker model and timeouts: the same as `kronk-wsgi serve` (gevent worker, no preload)
globals().update(GUNICORN_DEFAULTS)

# Server socket
bind = os.environ.get("KRONK_BIND", "127.0.0.1:8000")

# Worker processes: one per core at most (each runs its own models)
workers = int(os.environ.get("KRONK_WORKERS", "1"))

# Shutdown: streams may finish until KRONK_DRAIN_TIMEOUT; gunicorn waits a little longer
graceful_timeout = server.graceful_timeout(settings_from_config(read_config()).drain_timeout)

# Logging: kronk_wsgi writes structured request logs itself
accesslog = None
errorlog = "-"
