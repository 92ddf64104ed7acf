"""Anthropic's MCP connector: a request's ``mcp_servers`` (streamable HTTP URLs the mcp_allow setting allows) whose
tools this server lists before the commit, offers to the model by their own names (an ``mcp_toolset`` choosing
which; with none naming a server, its ``tool_configuration``) and runs for it, as ``mcp_tool_use`` and
``mcp_tool_result`` blocks of the assistant's message (see api/server_tools.py). The connector asks no approval."""

from typing import Optional

from ...errors import invalid
from ...server_tools import MOST_CALLS, ServerTools, tools_at
from .schemas import CountTokensRequest, McpServerDefinition


def _enabled(body: CountTokensRequest, server: McpServerDefinition, name: str) -> bool:
    toolsets = [t for t in body.toolsets() if t.mcp_server_name == server.name]
    if toolsets:
        return any(t.enabled(name) for t in toolsets)
    configuration = server.tool_configuration
    if configuration is None:
        return True
    return configuration.enabled is not False and (configuration.allowed_tools is None
                                                   or name in configuration.allowed_tools)


def connector_tools(body: CountTokensRequest) -> Optional[ServerTools]:
    """The request's servers' tools, offered through ``body`` too (None if it names no server); 400 for a server
    it may not reach or a tool name another tool has, 424 if a server's tools cannot be listed."""
    if not body.mcp_servers:
        return None
    taken = {t.name for t in body.offered_tools()}
    tools = {}
    for index, server in enumerate(body.mcp_servers):
        param = f"mcp_servers[{index}].url"
        for tool in tools_at(server.name, server.url, server.headers(), param):
            if not _enabled(body, server, tool.tool):
                continue
            if tool.tool in taken:
                raise invalid(f"mcp_servers[{index}]: its tool {tool.tool!r} has the name of another tool",
                              param=f"mcp_servers[{index}]")
            taken.add(tool.tool)
            tools[tool.tool] = tool
    served = ServerTools(tools, listed=(), most_calls=MOST_CALLS)
    body.serve(served.functions())
    return served
