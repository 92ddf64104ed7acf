"""Per-app state (in app.extensions["kronk"]) and per-request records (in flask.g)."""

import dataclasses
import time
import weakref
from typing import TYPE_CHECKING, Optional

import gevent
import structlog
from flask import current_app, g, request
from gevent.threadpool import ThreadPool

from ..config import Settings
from ..mcp_servers.client import McpServers, McpUnavailable
from ..metrics import Metrics
from ..model_registry import ModelRegistry
from ..serving.pool import ModelPool, ModelUnavailable
from ..serving.session import GenerationStats, Session
from .response_store import ResponseStore
from .sealing import Sealer

if TYPE_CHECKING:
    from .background import BackgroundRun
    from .protocol import Protocols

log = structlog.get_logger("kronk_wsgi.state")


@dataclasses.dataclass
class KronkState:
    """What one app's kronk_wsgi owns."""

    settings: Settings
    pool: ModelPool
    metrics: Metrics
    body_thread: ThreadPool  # work before the commit (parsing, validation), off the event loop
    responses: ResponseStore
    store_thread: ThreadPool  # every call to the Responses store, one at a time
    sealer: Sealer  # seals the reasoning a Responses client keeps
    protocols: "Protocols"
    mcp: McpServers  # the operator's MCP servers' tools
    url_prefix: str = ""  # where the API is mounted
    # The requests begun and not yet logged as completed: what a dying worker cuts.
    open_requests: "weakref.WeakSet[RequestRecord]" = dataclasses.field(default_factory=weakref.WeakSet)
    background: "dict[str, BackgroundRun]" = dataclasses.field(default_factory=dict)  # running here, by response id
    beating: bool = False  # a greenlet stores this worker's heartbeat for its background runs
    started: bool = False  # the default model's load has begun (start)

    def start(self) -> None:
        """Begin loading the default model, once: as the server starts each worker (post_worker_init), or with an
        embedded app's first request to these routes (the request hooks), or when the host app asks."""
        if not self.started:
            self.started = True
            gevent.spawn(self._load_default)
            if self.mcp.servers:
                gevent.spawn(self._list_tools)

    def _list_tools(self) -> None:
        """Start the MCP servers and list their tools, as llama-server does at its start."""
        try:
            self.mcp.tools()
        except McpUnavailable as exc:
            log.warning("MCP tools not listed", error=str(exc))  # listed again on the next ask

    def _load_default(self) -> None:
        try:
            with self.pool.use(self.settings.default_model):
                pass
        except ModelUnavailable:
            pass  # logged by the pool; readiness reports it

    @property
    def models(self) -> ModelRegistry:
        """The models it answers for (the pool's registry)."""
        return self.pool.models


@dataclasses.dataclass(eq=False)  # each record is itself: kept in a WeakSet
class RequestRecord:
    """What the request log line and metrics need, filled in as the request goes."""

    request_id: str
    route: str
    started: float = dataclasses.field(default_factory=time.monotonic)
    model: Optional[str] = None
    response_id: Optional[str] = None  # the id of the completion, message or response made
    owner: str = ""  # whose stored responses the request may see (response_store.owner_of its API key)
    admin: bool = False  # its key is an admin key (or the server has no keys)
    not_offered: tuple[str, ...] = ()  # hosted tools the request named that this server cannot run
    error: Optional[str] = None  # what an error response said, for the request's log line
    status: int = 0
    outcome: str = ""  # set by views that know better than the status
    stats: Optional[GenerationStats] = None
    load_seconds: float = 0.0  # spent getting the model: its load, or waiting for another request's
    session: Optional[Session] = None  # a session started for the request that no response has taken over yet


def state() -> KronkState:
    return current_app.extensions["kronk"]


def api_path() -> str:
    """The request's path below kronk_wsgi's url_prefix."""
    return request.path.removeprefix(state().url_prefix)


def record() -> RequestRecord:
    return g.kronk_record
