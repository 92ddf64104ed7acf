"""The MCP host: a process of its own, started by a worker, that keeps a session with each of the operator's MCP
servers and answers the worker's requests, one JSON object a line on stdin, one answer a line on stdout.

The official ``mcp`` package runs on asyncio, and a gevent worker cannot start processes from an asyncio loop
of its own: so the sessions live here, in plain asyncio, and the worker only writes and reads lines (see
client.py). Requests: ``{"id", "op": "tools"}`` answers ``{"id", "tools": [{server, name, description,
input_schema}], "failed": {server: why}}``; ``{"id", "op": "call", "server", "tool", "arguments"}`` answers
``{"id", "text", "is_error"}``, or ``{"id", "error"}`` when the server could not be asked or did not answer in
its ``timeout_ms``. With ``"url"`` and ``"headers"`` in place of ``"server"`` (a server a request names, that
the worker checked it may reach), ``{"op": "list"}`` and ``{"op": "call"}`` each talk to it in a session of
their own. The host ends when its stdin closes (its worker is gone).
"""

import asyncio
import contextlib
import json
import os
import sys
from typing import Any, Optional

import httpx2
from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError

CONFIG_VARIABLE = "KRONK_MCP_HOST_SERVERS"  # the validated servers, as JSON: {name: spec}
CONNECT_SECONDS = 10.0  # a server's start, handshake and listing, at most (llama-server's warm-up bound)
LINE_LIMIT = 64 * 1024 * 1024  # the longest request line taken
MOST_OUTPUT = 256 * 1024  # characters of a tool's result kept (cut here, before the worker reads it), the cut said


def _text(result: Any) -> str:
    """A tool result's text: its text parts on lines of their own, else its structured content as JSON; at most
    MOST_OUTPUT characters of it."""
    parts = [block.text for block in result.content if getattr(block, "type", None) == "text"]
    if not parts and getattr(result, "structured_content", None) is not None:
        text = json.dumps(result.structured_content)
    else:
        text = "\n".join(parts)
    if len(text) > MOST_OUTPUT:
        return text[:MOST_OUTPUT] + f"\n[cut: the result had {len(text)} characters, {MOST_OUTPUT} are kept]"
    return text


class Server:
    """One MCP server's session, started on demand and again after its process ended."""

    def __init__(self, name: str, spec: dict) -> None:
        self.name, self.spec = name, spec
        self.timeout = spec["timeout_ms"] / 1000
        self.session: Optional[ClientSession] = None
        self.tools: list[Any] = []
        self._stop: Optional[asyncio.Event] = None
        self._task: Optional[asyncio.Task] = None
        self._connecting = asyncio.Lock()

    def _transport(self, stack: contextlib.AsyncExitStack):
        spec = self.spec
        if spec.get("url"):
            client = httpx2.AsyncClient(headers=spec.get("headers") or {}, timeout=self.timeout)
            stack.push_async_callback(client.aclose)
            return streamable_http_client(spec["url"], http_client=client)
        return stdio_client(StdioServerParameters(command=spec["command"], args=spec.get("args") or [],
                                                  env=spec.get("env") or None, cwd=spec.get("cwd")))

    async def connect(self) -> None:
        """A new session (a new process, for a stdio server) and its tools; an exception if it cannot start."""
        async with self._connecting:
            await self.close()
            ready: asyncio.Future = asyncio.get_running_loop().create_future()
            self._stop = asyncio.Event()
            self._task = asyncio.create_task(self._run(ready, self._stop))
            await asyncio.wait_for(asyncio.shield(ready), CONNECT_SECONDS)

    async def _run(self, ready: asyncio.Future, stop: asyncio.Event) -> None:
        """The session's life, in one task (the transports' contexts must end where they began)."""
        try:
            async with contextlib.AsyncExitStack() as stack:
                read, write = await stack.enter_async_context(self._transport(stack))
                session = await stack.enter_async_context(ClientSession(read, write))
                await session.initialize()
                self.tools = (await session.list_tools()).tools
                self.session = session
                ready.set_result(None)
                await stop.wait()
        except BaseException as exc:  # an ExceptionGroup from the transport's tasks, too
            if not ready.done():
                ready.set_exception(exc if isinstance(exc, Exception) else RuntimeError(repr(exc)))
            if isinstance(exc, asyncio.CancelledError):
                raise
        finally:
            self.session = None

    async def close(self) -> None:
        if self._task is not None:
            self._stop.set()
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task
            self._task = None

    async def _alive(self) -> Optional[ClientSession]:
        """The session, if it still answers (a stdio server's process may have ended since its last call)."""
        session = self.session
        if session is None:
            return None
        if self.spec.get("url"):
            return session
        try:
            await asyncio.wait_for(session.send_ping(), self.timeout)
        except (MCPError, asyncio.TimeoutError, OSError):
            return None
        return session

    async def call(self, tool: str, arguments: dict) -> dict:
        try:
            session = await self._alive()
            if session is None:
                await self.connect()
                session = self.session
            result = await asyncio.wait_for(session.call_tool(tool, arguments), self.timeout)
        except asyncio.TimeoutError:
            return {"error": f"the MCP server {self.name!r} did not answer within {self.timeout:g} s"}
        except MCPError as exc:
            return {"error": exc.error.message}
        except Exception as exc:  # the server could not be started or reached
            return {"error": f"the MCP server {self.name!r} is unavailable: {_reason(exc)}"}
        return {"text": _text(result), "is_error": bool(result.is_error)}


def _tool(server: str, tool: Any) -> dict:
    annotations = getattr(tool, "annotations", None)
    return {"server": server, "name": tool.name, "description": tool.description or "",
            "input_schema": tool.input_schema if isinstance(tool.input_schema, dict) else {},
            "read_only": bool(getattr(annotations, "read_only_hint", False))}


def _reason(exc: BaseException) -> str:
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return f"{type(exc).__name__}: {exc}"[:500]


class Host:
    def __init__(self, servers: dict[str, dict]) -> None:
        self.servers = {name: Server(name, spec) for name, spec in servers.items()}
        self.failed: dict[str, str] = {}
        self._out = asyncio.Lock()

    async def warm_up(self) -> None:
        """Start every server at once; those that cannot start are named in the listing and tried again on call."""
        async def start(server: Server) -> None:
            try:
                await server.connect()
            except Exception as exc:
                self.failed[server.name] = _reason(exc)
                print(f"kronk_wsgi MCP host: {server.name} did not start: {_reason(exc)}", file=sys.stderr)

        await asyncio.gather(*(start(s) for s in self.servers.values()))

    @staticmethod
    async def _once(request: dict) -> dict:
        """A request's own server, asked once: its tools, or a call."""
        server = Server(request["url"], {"url": request["url"], "headers": request.get("headers") or {},
                                         "timeout_ms": request["timeout_ms"]})
        try:
            await server.connect()
        except Exception as exc:
            return {"error": f"the MCP server at {request['url']} is unavailable: {_reason(exc)}"}
        try:
            if request["op"] == "list":
                return {"tools": [_tool(server.name, t) for t in server.tools]}
            return await server.call(request["tool"], request.get("arguments") or {})
        finally:
            await server.close()

    def listing(self) -> dict:
        tools = [_tool(s.name, t) for s in self.servers.values() for t in s.tools]
        return {"tools": tools, "failed": self.failed}

    async def answer(self, line: bytes, writer: asyncio.StreamWriter) -> None:
        request = json.loads(line)
        try:
            answer = await self._answer(request)
        except Exception as exc:  # a request this host cannot read: said, so its caller does not wait for it
            answer = {"error": f"the MCP host could not answer: {_reason(exc)}"}
        async with self._out:
            writer.write((json.dumps({"id": request["id"], **answer}) + "\n").encode())
            await writer.drain()

    async def _answer(self, request: dict) -> dict:
        if "url" in request:
            return await self._once(request)
        if request["op"] == "tools":
            return self.listing()
        server = self.servers.get(request["server"])
        if server is None:
            return {"error": f"no MCP server is named {request['server']!r}"}
        return await server.call(request["tool"], request.get("arguments") or {})


async def main() -> None:
    host = Host(json.loads(os.environ[CONFIG_VARIABLE]))
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=LINE_LIMIT)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    transport, protocol = await loop.connect_write_pipe(asyncio.streams.FlowControlMixin, sys.stdout)
    writer = asyncio.StreamWriter(transport, protocol, reader, loop)
    await host.warm_up()
    writer.write(b'{"ready": true}\n')
    pending = set()
    while line := await reader.readline():
        task = asyncio.create_task(host.answer(line, writer))
        pending.add(task)
        task.add_done_callback(pending.discard)
    for server in host.servers.values():
        await server.close()


if __name__ == "__main__":
    asyncio.run(main())
