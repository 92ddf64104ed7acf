"""Tools the server runs for a request (MCP tools the request names): the model's calls of them answered here and
the model asked again with their results, as one session's events, within limits.

The loop's events: the servers' listings (ToolsListed) first, then each generation's own events but its calls of
server-run tools and the ends of the turns they continue: for each such call ServerToolCall and then its
ServerToolResult (ApprovalAsked instead, and the answer ends, for a tool that waits for the client's approval),
and at the end one Finished whose usage is every generation's together. A call of the client's own functions
ends the loop after its turn, as it ends any answer. Each later generation is planned when the one before it
ends and takes over its admission place.
"""

import dataclasses
import json
import time
from typing import Generator, Iterator, Optional

import gevent

from ..mcp_servers.client import McpServers, McpTool, McpUnavailable, ToolResult
from ..serving.events import (
    ApprovalAsked, ArgumentsDelta, ChoiceEnd, Event, Failed, Finished, KEEPALIVE, ServerToolCall, ServerToolResult,
    ToolCall, ToolCallStart, ToolsListed, Usage,
)
from ..serving.scheduler import CLIENT_POLL_SECONDS
from ..serving.session import Session
from .errors import ApiError, invalid
from .planning import GenerationRequest
from .schemas import template_tool, template_tool_call
from .sessions import SessionChain
from .state import state

MOST_CALLS = 16  # server-run calls in one request at most, unless the request sets fewer (max_tool_calls)


@dataclasses.dataclass(frozen=True)
class ServerTools:
    """The server-run tools a request offers, by the name the model calls them by, and which wait for approval."""

    tools: dict[str, McpTool]
    listed: tuple[ToolsListed, ...]
    approval: frozenset[str] = frozenset()  # the names whose calls wait for the client's approval
    most_calls: int = MOST_CALLS
    answered: tuple[ServerToolResult, ...] = ()  # the calls the client approved, run before the model went on

    def functions(self) -> tuple[dict, ...]:
        """The tools as chat templates take functions."""
        return tuple(template_tool(name, t.description, t.parameters) for name, t in self.tools.items())


def tools_at(label: str, url: str, headers: dict[str, str], param: str) -> list[McpTool]:
    """The tools of a server a request names by its URL: a 400 naming ``param`` unless the mcp_allow setting
    allows the URL (no request may make this server reach another address), a 424 if they cannot be listed."""
    kronk = state()
    if not any(url.startswith(prefix) for prefix in kronk.settings.mcp_allow):
        raise invalid(f"{param}: this server may call only the MCP servers its mcp_allow setting allows, and that "
                      "is not one of them", param=param)
    try:
        return kronk.mcp.tools_at(label, url, headers)
    except McpUnavailable as exc:
        raise unlisted(param, str(exc)) from None


def unlisted(param: str, why: str) -> ApiError:
    """The answer when a server's tools cannot be listed: 424, the dependency failed (OpenAI's)."""
    return ApiError(424, f"{param}: the MCP server's tools could not be listed: {why}", code="mcp_unavailable",
                    param=param)


def tool_turn(call: ToolCall, result: ServerToolResult) -> list[dict]:
    """A server-run call and its result as the chat messages the model reads: its call, and the tool's answer."""
    return [{"role": "assistant", "content": "", "tool_calls": [template_tool_call(call.id, call.name,
                                                                                  _arguments(call))]},
            {"role": "tool", "content": result_text(result), "tool_call_id": call.id}]


def result_text(result: ServerToolResult) -> str:
    """What the model reads of a result: the tool's text, or its error said as one."""
    return result.output if result.error is None else f"Error: {result.error}"


def _arguments(call: ToolCall) -> object:
    try:
        return json.loads(call.arguments)
    except ValueError:
        return call.arguments


def run_call(mcp: McpServers, tool: McpTool, call: ToolCall, approval: Optional[str] = None) -> ServerToolResult:
    """Call the tool with the model's arguments (they are not an object: the tool's error, uncalled)."""
    arguments = _arguments(call)
    result = mcp.call(tool, arguments) if isinstance(arguments, dict) else \
        ToolResult(error="the arguments are not a JSON object", by_tool=True)
    return ServerToolResult(call, tool.server, tool.tool, result.text, result.error, result.by_tool, approval)


class ToolLoopSession(SessionChain):
    """The request's generations, as many as its server-run tools take (see the module's docstring)."""

    def __init__(self, first: Session, request: GenerationRequest, tools: ServerTools, mcp: McpServers) -> None:
        super().__init__(first)
        self.request, self.tools, self.mcp = request, tools, mcp
        self._served_ids: set[str] = set()  # the calls of server-run tools being written

    def _steps(self) -> Iterator[Event]:
        yield from self.tools.listed
        for result in self.tools.answered:
            yield ServerToolCall(result.call, result.server, result.tool)
            yield result
        request, session, calls = self.request, self.first, 0
        usage = Usage(0, 0)
        while True:
            held: list[ToolCall] = []
            client_calls = False
            end: Optional[ChoiceEnd] = None
            for event in session:
                if isinstance(event, (ToolCallStart, ArgumentsDelta)) and self._served(event):
                    continue
                if isinstance(event, ToolCall):
                    if event.name in self.tools.tools:
                        held.append(event)
                        continue
                    client_calls = True
                if isinstance(event, ChoiceEnd):
                    end = event
                    continue
                if isinstance(event, Finished):
                    usage = _added(usage, event.usage)
                    break
                yield event
                if isinstance(event, Failed):
                    return
            else:
                return  # the client left, or the request's time ran out: the session said so
            turn: list[dict] = []
            for call in held:
                tool = self.tools.tools[call.name]
                if call.name in self.tools.approval:
                    yield ApprovalAsked(call, tool.server, tool.tool)
                    client_calls = True
                    continue
                yield ServerToolCall(call, tool.server, tool.tool)
                result = yield from self._call(tool, call)
                if result is None:
                    self.stats.outcome = "client_gone"
                    return
                yield result
                turn += tool_turn(call, result)
                calls += 1
            if not held or client_calls:
                yield end or ChoiceEnd("stop")
                yield Finished(usage)
                return
            request = dataclasses.replace(request, messages=request.messages + turn, cache_breaks=(),
                                          continue_final=False)
            if calls >= self.tools.most_calls:  # the last turn answers with what it has
                request = dataclasses.replace(request, tools=request.tools and dataclasses.replace(
                    request.tools, choice="none", name=None, allowed=None))
            try:
                session = self.follow(request)
            except ApiError as exc:
                yield Failed(exc.code or "invalid_request_error", exc.message)
                return

    def _served(self, event: ToolCallStart | ArgumentsDelta) -> bool:
        """Whether a call being written is of a server-run tool (its start names it; its deltas follow)."""
        if isinstance(event, ToolCallStart) and event.name in self.tools.tools:
            self._served_ids.add(event.id)
        return event.id in self._served_ids

    def _call(self, tool: McpTool, call: ToolCall) -> Generator[Event, None, Optional[ServerToolResult]]:
        """Run the call in a greenlet of its own, keeping the stream alive and minding the client meanwhile: its
        result, or None if the client left (the call is left to end in the host)."""
        running = gevent.spawn(run_call, self.mcp, tool, call)
        session = self._sessions[-1]
        quiet_since = time.monotonic()
        try:
            while not running.ready():
                running.join(timeout=CLIENT_POLL_SECONDS)
                if running.ready():
                    break
                if session.client_gone():
                    return None
                if time.monotonic() - quiet_since >= session.keepalive:
                    yield KEEPALIVE
                    quiet_since = time.monotonic()
            return running.get()
        finally:
            running.kill(block=False)


def _added(total: Usage, more: Usage) -> Usage:
    return Usage(total.prompt_tokens + more.prompt_tokens, total.completion_tokens + more.completion_tokens,
                 total.cached_tokens + more.cached_tokens, total.cache_written + more.cache_written)
