"""llama-server's /tools: the operator's MCP servers' tools (the ``mcp_servers`` setting), listed and called by
name (``<server>_<tool>``). A tool's failure, its server's, or a timeout is the call's ``error``, with a 200, as
llama-server has it; an unknown tool is a 404."""

from typing import Any, Optional

from flask import jsonify

from ....mcp_servers.client import McpServers, McpUnavailable
from ...body import parse_body
from ...errors import ApiError
from ...schemas import Strict
from ...state import state
from .protocol import bp


class ToolCall(Strict):
    tool: str
    params: dict[str, Any] = {}
    stream: bool = False  # an MCP tool's result comes whole: there is nothing to stream


def _listed(mcp: McpServers) -> dict:
    """The servers' tools by name; 503 if the MCP host cannot be started."""
    try:
        return mcp.tools()
    except McpUnavailable as exc:
        raise ApiError(503, str(exc), code="mcp_unavailable") from None


@bp.get("/tools")
def list_tools():
    """Every MCP tool, as llama-server lists its tools."""
    mcp = state().mcp
    tools = _listed(mcp).values() if mcp.servers else ()
    return jsonify([{"display_name": t.name, "tool": t.name, "type": "mcp", "permissions": {"write": False},
                     "uses_cwd": False, "definition": t.definition()} for t in tools])


@bp.post("/tools")
def call_tool():
    """Call one tool with ``params``: ``{"plain_text_response": text}``, or ``{"error": why}``."""
    body = parse_body(ToolCall)
    mcp = state().mcp
    found: Optional[Any] = _listed(mcp).get(body.tool) if mcp.servers else None
    if found is None:
        raise ApiError(404, f"no tool is named {body.tool[:100]!r}", code="tool_not_found", param="tool")
    result = mcp.call(found, body.params)
    return jsonify({"error": result.error} if result.error is not None else {"plain_text_response": result.text})
