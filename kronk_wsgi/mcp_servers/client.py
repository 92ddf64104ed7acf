"""The operator's MCP servers as one worker sees them: their tools, named ``<server>_<tool>`` as llama-server
names them, listed and called through the worker's MCP host process (host.py), started on first use and again
if it ends. The host ends with its worker: its stdin closes."""

import dataclasses
import itertools
import json
import os
import sys
from typing import Any, Optional

import gevent
import structlog
from gevent import subprocess
from gevent.event import AsyncResult
from gevent.lock import Semaphore

from ..config import McpServerSpec
from .host import CONFIG_VARIABLE, CONNECT_SECONDS

log = structlog.get_logger("kronk_wsgi.mcp")

ANSWER_MARGIN = 5.0  # seconds a call waits past its server's own timeout for the host's answer
REQUEST_SERVER_MS = 30_000  # a request's own server's time for each listing and call
EMPTY_SCHEMA = {"type": "object", "properties": {}}


class McpUnavailable(Exception):
    """The MCP host could not be started, or ended before it answered."""


@dataclasses.dataclass(frozen=True)
class McpTool:
    """One tool of one MCP server, under the name it is offered by: ``<server>_<tool>`` for the operator's servers;
    a request's own server (``url``, reached with ``headers``) names them as the request wants."""

    name: str
    server: str
    tool: str
    description: str
    parameters: dict
    read_only: bool = False  # annotated readOnlyHint by its server
    url: Optional[str] = None
    headers: tuple[tuple[str, str], ...] = ()

    def definition(self) -> dict:
        """The tool as a chat request's function."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


@dataclasses.dataclass(frozen=True)
class ToolResult:
    """What a call gave: the tool's text, or why there is none (``error``; ``by_tool``: the tool's own failure,
    else its server's, or the host's)."""

    text: str = ""
    error: Optional[str] = None
    by_tool: bool = False


class McpServers:
    """The configured servers' tools, through one host process for this worker."""

    def __init__(self, servers: dict[str, McpServerSpec]) -> None:
        self.servers = servers
        self._host: Optional[subprocess.Popen] = None
        self._answers: dict[int, AsyncResult] = {}  # the running host's callers waiting, by their request's id
        self._ids = itertools.count()
        self._starting = Semaphore()
        self._writing = Semaphore()
        self._tools: Optional[dict[str, McpTool]] = None

    def tools(self) -> dict[str, McpTool]:
        """Every server's tools by name, listed once (a name two servers would share goes to the first)."""
        if self._tools is None:
            listing = self._ask({"op": "tools"}, CONNECT_SECONDS * 2)
            tools: dict[str, McpTool] = {}
            for found in listing["tools"]:
                tool = McpTool(f"{found['server']}_{found['name']}", found["server"], found["name"],
                               found["description"], found["input_schema"] or EMPTY_SCHEMA, found["read_only"])
                if tool.name in tools:
                    log.warning("MCP tool name taken: left out", tool=tool.name, server=tool.server)
                    continue
                tools[tool.name] = tool
            if listing["failed"]:
                log.warning("MCP servers not started: their tools are not listed", failed=listing["failed"])
            self._tools = tools
        return self._tools

    def tools_at(self, label: str, url: str, headers: dict[str, str]) -> list[McpTool]:
        """The tools of a server a request names (checked against the mcp_allow setting), by their own names;
        McpUnavailable if it cannot be reached."""
        answer = self._ask({"op": "list", "url": url, "headers": headers, "timeout_ms": REQUEST_SERVER_MS},
                           REQUEST_SERVER_MS / 1000 + ANSWER_MARGIN)
        if "error" in answer:
            raise McpUnavailable(answer["error"])
        return [McpTool(t["name"], label, t["name"], t["description"], t["input_schema"] or EMPTY_SCHEMA,
                        t["read_only"], url, tuple(headers.items())) for t in answer["tools"]]

    def call(self, tool: McpTool, arguments: dict) -> ToolResult:
        """Call ``tool``; its error, the server's, or a timeout come back as the result's ``error``."""
        if tool.url is not None:
            ms = REQUEST_SERVER_MS
            where = {"url": tool.url, "headers": dict(tool.headers), "timeout_ms": ms}
        else:
            where, ms = {"server": tool.server}, self.servers[tool.server].timeout_ms
        try:
            answer = self._ask({"op": "call", **where, "tool": tool.tool, "arguments": arguments},
                               ms / 1000 + ANSWER_MARGIN)
        except McpUnavailable as exc:
            return ToolResult(error=str(exc))
        if "error" in answer:
            return ToolResult(error=answer["error"])
        text = answer["text"]
        if answer["is_error"]:
            return ToolResult(error=text or "the tool failed", by_tool=True)
        return ToolResult(text)

    def _ask(self, request: dict, timeout: float) -> dict:
        host, answers = self._running()
        number = next(self._ids)
        answer = answers[number] = AsyncResult()
        try:
            with self._writing:
                host.stdin.write((json.dumps({"id": number, **request}) + "\n").encode())
                host.stdin.flush()
            return answer.get(timeout=timeout)
        except gevent.Timeout:
            raise McpUnavailable(f"the MCP host did not answer within {timeout:g} s") from None
        except OSError as exc:
            raise McpUnavailable(f"the MCP host is gone: {exc}") from None
        finally:
            answers.pop(number, None)

    def _running(self) -> tuple[subprocess.Popen, dict[int, AsyncResult]]:
        """The host process, started (and warmed up: every server tried once) if it is not running; and its
        callers waiting."""
        with self._starting:
            if self._host is not None and self._host.poll() is None:
                return self._host, self._answers
            env = dict(os.environ, **{CONFIG_VARIABLE: json.dumps(
                {name: spec.model_dump() for name, spec in self.servers.items()})})
            host = subprocess.Popen([sys.executable, "-m", "kronk_wsgi.mcp_servers.host"], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, env=env)
            ready = gevent.with_timeout(CONNECT_SECONDS * 2, host.stdout.readline, timeout_value=b"")
            if json.loads(ready or "{}").get("ready") is not True:
                host.kill()
                raise McpUnavailable("the MCP host did not start (its reasons are in the server's log)")
            self._host, self._answers, self._tools = host, {}, None
            gevent.spawn(self._read, host, self._answers)
            log.info("MCP host started", pid=host.pid, servers=sorted(self.servers))
            return host, self._answers

    @staticmethod
    def _read(host: subprocess.Popen, answers: dict[int, AsyncResult]) -> None:
        """Hand each answer to its caller; once the host ends, every caller still waiting hears so."""
        for line in host.stdout:
            answer: dict[str, Any] = json.loads(line)
            waiting = answers.get(answer.pop("id"))
            if waiting is not None:
                waiting.set(answer)
        host.wait()
        log.warning("MCP host ended", pid=host.pid, returncode=host.returncode)
        for waiting in list(answers.values()):
            waiting.set_exception(McpUnavailable("the MCP host ended before it answered"))
