"""Per-app state (in app.extensions["kronk"]) and per-request records (in flask.g)."""

import dataclasses
import time
from typing import Optional

from flask import current_app, g
from gevent.threadpool import ThreadPool

from ..config import Settings
from ..metrics import Metrics
from ..serving.pool import ModelPool
from ..serving.session import GenerationStats
from .response_store import ResponseStore


@dataclasses.dataclass
class KronkState:
    """What one app's kronk_wsgi owns."""

    settings: Settings
    pool: ModelPool
    metrics: Metrics
    workers: ThreadPool  # work before the commit (parsing, validation, stored responses), off the event loop
    responses: ResponseStore
    url_prefix: str = ""  # where the API is mounted


@dataclasses.dataclass
class RequestRecord:
    """What the request log line and metrics need, filled in as the request goes."""

    request_id: str
    route: str
    started: float = dataclasses.field(default_factory=time.monotonic)
    model: Optional[str] = None
    response_id: Optional[str] = None  # the id of the completion, message or response made
    status: int = 0
    outcome: str = ""  # set by views that know better than the status
    stats: Optional[GenerationStats] = None


def state() -> KronkState:
    return current_app.extensions["kronk"]


def record() -> RequestRecord:
    return g.kronk_record
