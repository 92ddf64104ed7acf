"""An MCP server made with the mcp package's own MCPServer, for the tests: ``python -m tests.support.mcp_server
[stdio | http PORT]``. Its tools: echo, add, fail (a tool error), slow (sleeps), big (a long text) and pid (its process)."""

import asyncio
import os
import sys

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

server = MCPServer("kronk-test")


@server.tool()
def echo(message: str) -> str:
    """Echo back the message."""
    return f"echo: {message}"


@server.tool()
def add(a: float, b: float) -> str:
    """Add two numbers."""
    return str(a + b)


@server.tool()
def fail(reason: str = "it failed") -> str:
    """Always fails, with the reason."""
    raise ToolError(reason)


@server.tool()
async def slow(seconds: float) -> str:
    """Sleeps, then says so."""
    await asyncio.sleep(seconds)
    return f"slept {seconds}"


@server.tool()
def big(size: int) -> str:
    """A text of ``size`` characters."""
    return "x" * size


@server.tool()
def pid() -> str:
    """The server's process id."""
    return str(os.getpid())


if __name__ == "__main__":
    if sys.argv[1:2] == ["http"]:
        server.run("streamable-http", host="127.0.0.1", port=int(sys.argv[2]))
    else:
        server.run("stdio")
