"""The Messages API's stream events and whole message."""

import hashlib
import json
from typing import Any, Iterator, Optional

from ....serving.events import (
    ArgumentsDelta, ChoiceEnd, Compacted, Compacting, Event, Failed, Finished, PromptCached, ReasoningDelta, ServerToolCall,
    ServerToolResult, TextDelta, ToolCall, ToolCallStart, ToolsListed, Usage,
)
from ...response import Encoder
from ...sse import sse
from .protocol import PROTOCOL, error_body


def _usage(usage: Usage) -> dict:
    """Anthropic's usage: the prompt's tokens read from a cache, those saved at its breakpoints, and the rest.

    The three input counts add up to the whole prompt.
    """
    return {
        "input_tokens": usage.prompt_tokens - usage.cached_tokens - usage.cache_written,
        "output_tokens": usage.completion_tokens, "cache_creation_input_tokens": usage.cache_written,
        "cache_read_input_tokens": usage.cached_tokens,
    }


def _stop_reason(event: ChoiceEnd) -> str:
    if event.stop_sequence is not None:
        return "stop_sequence"
    if event.reason == "length" and event.window_full:
        return "model_context_window_exceeded"
    return {"length": "max_tokens", "tool_calls": "tool_use", "compaction": "compaction"}.get(event.reason, "end_turn")


def _tool_use(call: ToolCall, input_: Any) -> dict:
    return {"type": "tool_use", "id": "toolu_" + call.id, "name": call.name, "input": input_}


def _mcp_tool_use(event: ServerToolCall, input_: Any) -> dict:
    return {"type": "mcp_tool_use", "id": "mcptoolu_" + event.call.id, "name": event.call.name,
            "server_name": event.server, "input": input_}


def _mcp_tool_result(event: ServerToolResult) -> dict:
    text = event.output if event.error is None else event.error
    return {"type": "mcp_tool_result", "tool_use_id": "mcptoolu_" + event.call.id, "is_error": event.error is not None,
            "content": [{"type": "text", "text": text}]}


def _tool_input(call: ToolCall) -> dict:
    """A call's input as an object; a call cut off by max_tokens has none yet that parses: {}."""
    try:
        return json.loads(call.arguments)
    except ValueError:
        return {}


def _signature(thinking: str) -> str:
    """A thinking block's signature: a digest of its text (clients hand it back; nothing here checks it)."""
    return hashlib.sha256(thinking.encode("utf-8", "surrogatepass")).hexdigest()


class MessagesEncoder(Encoder):
    """message_start (the commit), content blocks, message_delta, message_stop.

    The model's thinking is a ``thinking`` block before the text.
    """

    protocol = PROTOCOL

    def __init__(self, message_id: str, model: str, input_tokens: int, show_thinking: bool = True,
                 context_management: Optional[dict] = None) -> None:
        super().__init__()
        self.context_management = context_management  # the context edits applied, when the request asked for any
        self.show_thinking = show_thinking  # False: thinking blocks come with their text omitted
        self.head = {
            "id": message_id, "type": "message", "role": "assistant", "model": model,
            "content": [], "stop_reason": None, "stop_sequence": None, "usage": _usage(Usage(input_tokens, 0)),
        }
        self.blocks = 0
        self.open_block: Optional[str] = None  # "text", "thinking" or "tool_use": the block being written
        self.started: dict[str, int] = {}  # a started call's id: how much of its input was sent
        self.thinking: list[str] = []
        self.end = ChoiceEnd("stop")

    def _close_block(self) -> Iterator[str]:
        if self.open_block == "thinking":
            delta = {"type": "signature_delta", "signature": _signature("".join(self.thinking))}
            yield sse({"type": "content_block_delta", "index": self.blocks, "delta": delta}, "content_block_delta")
            self.thinking = []
        if self.open_block is not None:
            yield sse({"type": "content_block_stop", "index": self.blocks}, "content_block_stop")
            self.blocks += 1
            self.open_block = None

    def _delta(self, kind: str, delta: dict) -> Iterator[str]:
        """A delta of a ``kind`` block, opening one first if another kind is open."""
        if self.open_block != kind:
            yield from self._close_block()
            block = {"type": "text", "text": ""} if kind == "text" else {"type": "thinking", "thinking": "", "signature": ""}
            yield sse({"type": "content_block_start", "index": self.blocks, "content_block": block}, "content_block_start")
            self.open_block = kind
        yield sse({"type": "content_block_delta", "index": self.blocks, "delta": delta}, "content_block_delta")

    waits_for_prompt = True  # message_start carries the prompt's cache split, as the Messages API gives it

    def prompt_cached(self, event: PromptCached) -> None:
        self.head["usage"] = _usage(event.usage)

    def start(self) -> Iterator[str]:
        yield sse({"type": "message_start", "message": self.head}, "message_start")

    def text(self, event: TextDelta) -> Iterator[str]:
        yield from self._delta("text", {"type": "text_delta", "text": event.text})

    def reasoning(self, event: ReasoningDelta) -> Iterator[str]:
        self.thinking.append(event.text)
        shown = event.text if self.show_thinking else ""
        yield from self._delta("thinking", {"type": "thinking_delta", "thinking": shown})

    def call_start(self, event: ToolCallStart) -> Iterator[str]:
        yield from self._close_block()
        start = {"type": "content_block_start", "index": self.blocks,
                 "content_block": _tool_use(ToolCall(event.id, event.name, ""), {})}
        yield sse(start, "content_block_start")
        self.open_block, self.started[event.id] = "tool_use", 0

    def call_arguments(self, event: ArgumentsDelta) -> Iterator[str]:
        self.started[event.id] += len(event.text)
        yield self._input(event.text)

    def tool_call(self, event: ToolCall) -> Iterator[str]:
        sent = self.started.pop(event.id, None)
        if sent is None:
            yield from self._close_block()
            start = {"type": "content_block_start", "index": self.blocks, "content_block": _tool_use(event, {})}
            yield sse(start, "content_block_start")
            self.open_block = "tool_use"
        if event.arguments[sent or 0:] or sent is None:
            yield self._input(event.arguments[sent or 0:])
        yield from self._close_block()

    def compacting(self, event: Compacting) -> Iterator[str]:
        yield from self._close_block()
        start = {"type": "content_block_start", "index": self.blocks, "content_block": {"type": "compaction",
                                                                                         "content": None}}
        yield sse(start, "content_block_start")
        self.open_block = "compaction"

    def compacted(self, event: Compacted) -> Iterator[str]:
        delta = {"type": "compaction_delta", "content": event.summary}
        yield sse({"type": "content_block_delta", "index": self.blocks, "delta": delta}, "content_block_delta")
        yield from self._close_block()

    def tools_listed(self, event: ToolsListed) -> Iterator[str]:
        return iter(())  # the Messages API lists no connector's tools in the message

    def server_call(self, event: ServerToolCall) -> Iterator[str]:
        yield from self._close_block()
        start = {"type": "content_block_start", "index": self.blocks, "content_block": _mcp_tool_use(event, {})}
        yield sse(start, "content_block_start")
        self.open_block = "mcp_tool_use"
        yield self._input(event.call.arguments)
        yield from self._close_block()

    def server_result(self, event: ServerToolResult) -> Iterator[str]:
        start = {"type": "content_block_start", "index": self.blocks, "content_block": _mcp_tool_result(event)}
        yield sse(start, "content_block_start")
        self.open_block = "mcp_tool_result"
        yield from self._close_block()

    def _input(self, text: str) -> str:
        delta = {"type": "input_json_delta", "partial_json": text}
        return sse({"type": "content_block_delta", "index": self.blocks, "delta": delta}, "content_block_delta")

    def choice_end(self, event: ChoiceEnd) -> Iterator[str]:
        self.end = event
        yield from self._close_block()

    def finished(self, event: Finished) -> Iterator[str]:
        delta = {"stop_reason": _stop_reason(self.end), "stop_sequence": self.end.stop_sequence}
        usage = _usage(event.usage)
        managed = {"context_management": self.context_management} if self.context_management else {}
        yield sse({"type": "message_delta", "delta": delta, "usage": usage, **managed}, "message_delta")
        yield sse({"type": "message_stop"}, "message_stop")

    def failed(self, event: Failed) -> Iterator[str]:
        kind = "timeout_error" if event.code == "timeout" else "api_error"
        yield sse(error_body(kind, event.message), "error")

    def whole(self, output: list[Event], finished: Finished) -> dict:
        content: list[dict] = []
        for event in output:
            if isinstance(event, ToolCall):
                content.append(_tool_use(event, _tool_input(event)))
            elif isinstance(event, Compacted):
                content.append({"type": "compaction", "content": event.summary})
            elif isinstance(event, ServerToolCall):
                content.append(_mcp_tool_use(event, _tool_input(event.call)))
            elif isinstance(event, ServerToolResult):
                content.append(_mcp_tool_result(event))
            elif isinstance(event, TextDelta):
                content.append({"type": "text", "text": event.text})
            elif isinstance(event, ReasoningDelta):
                if content and content[-1]["type"] == "thinking":
                    content[-1]["thinking"] += event.text
                else:
                    content.append({"type": "thinking", "thinking": event.text})
        for block in content:
            if block["type"] == "thinking":
                block["signature"] = _signature(block["thinking"])
                if not self.show_thinking:
                    block["thinking"] = ""
        end = next(e for e in reversed(output) if isinstance(e, ChoiceEnd))
        return {
            **self.head, "content": content, "stop_reason": _stop_reason(end),
            "stop_sequence": end.stop_sequence, "usage": _usage(finished.usage),
            **({"context_management": self.context_management} if self.context_management else {}),
        }
