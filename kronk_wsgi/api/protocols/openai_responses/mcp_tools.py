"""A Responses request's ``mcp`` tools: each server's tools listed before the commit (one of the operator's
``mcp_servers`` by its ``server_label``, or a ``server_url`` the ``mcp_allow`` setting allows: a request can make
this server reach no other address and start no process), offered to the model by their own names, and the calls
the client approved run before the model goes on."""

from typing import Optional

from ....mcp_servers.client import McpTool, McpUnavailable
from ....serving.events import ToolCall, ToolsListed
from ...errors import invalid
from ...server_tools import MOST_CALLS, ServerTools, result_text, run_call, tools_at, unlisted
from ...state import state
from .schemas import McpApprovalRequestItem, McpApprovalResponseItem, McpServerTool, ResponsesRequest


def _listing(index: int, spec: McpServerTool) -> list[McpTool]:
    if spec.server_url is not None:
        return tools_at(spec.server_label, spec.server_url, spec.request_headers(), f"tools[{index}].server_url")
    mcp = state().mcp
    if spec.server_label not in mcp.servers:
        raise invalid(f"tools[{index}].server_label: this server has no MCP server named {spec.server_label!r} "
                      "(its mcp_servers); name a server_url the mcp_allow setting allows",
                      param=f"tools[{index}].server_label")
    try:
        return [t for t in mcp.tools().values() if t.server == spec.server_label]
    except McpUnavailable as exc:
        raise unlisted(f"tools[{index}]", str(exc)) from None


def server_tools(body: ResponsesRequest) -> Optional[ServerTools]:
    """The request's server-run tools (None if it names no mcp tool); 400 for a server it may not use or a tool
    name two tools share, 424 if a server's tools cannot be listed."""
    specs = [(i, t) for i, t in enumerate(body.tools or ()) if isinstance(t, McpServerTool)]
    if not specs:
        return None
    taken = {f.name for f in body.functions()}
    tools: dict[str, McpTool] = {}
    approval: set[str] = set()
    listed = []
    for index, spec in specs:
        kept = [t for t in _listing(index, spec) if spec.allowed(t.tool, t.read_only)]
        listed.append(ToolsListed(spec.server_label, tuple(
            {"name": t.tool, "description": t.description, "input_schema": t.parameters,
             "annotations": {"read_only": t.read_only}} for t in kept)))
        for tool in kept:
            if tool.tool in taken:
                raise invalid(f"tools[{index}]: the MCP tool {tool.tool!r} has the name of another tool; offer one "
                              "of them (allowed_tools)", param=f"tools[{index}]")
            taken.add(tool.tool)
            tools[tool.tool] = tool
            if spec.waits_for_approval(tool.tool, tool.read_only):
                approval.add(tool.tool)
    return ServerTools(tools, tuple(listed), frozenset(approval), min(MOST_CALLS, body.max_tool_calls or MOST_CALLS))


def run_approved(body: ResponsesRequest, tools: Optional[ServerTools], earlier: list[dict]) -> tuple:
    """Run each call the input approves (its request in the input, or in ``earlier``, the output of the response
    it continues), before the commit: their results, in order, each also what the model reads as its answer."""
    asked = {item["id"]: item for item in earlier if item["type"] == "mcp_approval_request"}
    asked.update({item.id: item.model_dump() for item in body.input_items()
                  if isinstance(item, McpApprovalRequestItem)})
    results = []
    for index, item in enumerate(body.input_items()):
        if not isinstance(item, McpApprovalResponseItem):
            continue
        request = asked.get(item.approval_request_id)
        if request is None:
            raise invalid(f"input[{index}].approval_request_id: no approval request of this conversation has the "
                          f"id {item.approval_request_id[:100]!r}", param=f"input[{index}].approval_request_id")
        if not item.approve:
            continue
        tool = tools.tools.get(request["name"]) if tools is not None else None
        if tool is None or tool.server != request["server_label"]:
            raise invalid(f"input[{index}]: the approved call's tool, {request['name']!r} of "
                          f"{request['server_label']!r}, is not among this request's mcp tools",
                          param=f"input[{index}]")
        result = run_call(state().mcp, tool, ToolCall(item.approval_request_id, request["name"],
                                                      request["arguments"]), approval=item.approval_request_id)
        item.answered(result_text(result))
        results.append(result)
    return tuple(results)
