"""The Responses API's events, numbered from 0, and its whole response object."""

import uuid
from typing import Any, Callable, Iterator, Optional

from ....serving.events import (
    ApprovalAsked, ArgumentsDelta, ChoiceEnd, Compacted, Compacting, Event, Failed, Finished, Logprobs,
    ReasoningDelta, ServerToolCall, ServerToolResult, TextDelta, ToolCall, ToolCallStart, ToolsListed,
    Usage,
)
from ....serving.formats import custom_input
from ...background import BackgroundEncoder
from ...errors import ApiError
from ...sse import sse
from ..openai_chat import logprob_content
from .protocol import PROTOCOL


def usage_object(usage: Usage) -> dict:
    return {
        "input_tokens": usage.prompt_tokens, "input_tokens_details": {"cached_tokens": usage.cached_tokens},
        "output_tokens": usage.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.total_tokens,
    }


def _message_item(item_id: str, text: str, status: str, logprobs: Optional[list[dict]] = None) -> dict:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}
    content = [] if status == "in_progress" else [part]
    return {"id": item_id, "type": "message", "status": status, "role": "assistant", "content": content}


def _call_item(call: ToolCall, arguments: str, status: str, namespace: Optional[str] = None) -> dict:
    item = {"id": "fc_" + call.id, "type": "function_call", "status": status, "call_id": "call_" + call.id,
            "name": call.name, "arguments": arguments}
    if namespace is not None:
        item["namespace"] = namespace
    return item


def _custom_call_item(call: ToolCall, status: str) -> dict:
    return {"id": "ctc_" + call.id, "type": "custom_tool_call", "status": status, "call_id": "call_" + call.id,
            "name": call.name, "input": custom_input(call.arguments, call.complete)}


def new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex


def _final(base: dict, output: list[dict], end: ChoiceEnd, event: Finished) -> dict:
    """The finished response object: completed, or incomplete at max_output_tokens."""
    incomplete = end.reason == "length"
    return {
        **base, "status": "incomplete" if incomplete else "completed", "output": output,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "usage": usage_object(event.usage),
    }


def _reasoning_item(item_id: str, text: str, status: str) -> dict:
    content = [] if status == "in_progress" else [{"type": "reasoning_text", "text": text}]
    return {"id": item_id, "type": "reasoning", "status": status, "summary": [], "content": content}


def _list_item(event: ToolsListed, item_id: str, done: bool) -> dict:
    return {"id": item_id, "type": "mcp_list_tools", "server_label": event.server,
            "tools": list(event.tools) if done else [], "error": event.error}


def _mcp_call_item(call: ToolCall, server: str, result: Optional[ServerToolResult] = None) -> dict:
    item = {"id": "mcp_" + call.id, "type": "mcp_call", "server_label": server, "name": call.name,
            "arguments": call.arguments, "output": None, "error": None, "status": "in_progress",
            "approval_request_id": None}
    if result is not None:
        error = None if result.error is None else \
            {"type": "mcp_tool_execution_error", "content": [{"type": "text", "text": result.error}]} \
            if result.by_tool else {"type": "mcp_protocol_error", "code": -32603, "message": result.error}
        item.update(output=None if result.error else result.output, error=error,
                    status="failed" if result.error else "completed", approval_request_id=result.approval)
    return item


def _approval_item(event: ApprovalAsked) -> dict:
    return {"id": "mcpr_" + event.call.id, "type": "mcp_approval_request", "server_label": event.server,
            "name": event.call.name, "arguments": event.call.arguments}


def compaction_item(item_id: str, sealed: str) -> dict:
    return {"id": item_id, "type": "compaction", "encrypted_content": sealed, "created_by": "kronk_wsgi"}


def _output_text(output: list[dict]) -> str:
    return "".join(part["text"] for item in output if item["type"] == "message" for part in item["content"])


class ResponsesEncoder(BackgroundEncoder):
    """Numbered events from 0: created and in_progress (the commit), output items, completed or incomplete.

    The model's thinking is a reasoning item (its text as reasoning_text) before the answer; with ``seal``,
    the item also carries its text sealed as ``encrypted_content``, for a client that keeps no state. A
    compaction's summary is a compaction item, first, sealed by ``seal_summary``; the tools this server runs give
    mcp_list_tools, mcp_call and mcp_approval_request items.
    """

    protocol = PROTOCOL

    def __init__(self, base: dict, store_response: Optional[Callable[[dict], None]] = None,
                 seal: Optional[Callable[[str], str]] = None, namespaces: Optional[dict[str, str]] = None,
                 custom_tools: frozenset[str] = frozenset(),
                 seal_summary: Optional[Callable[[str], str]] = None) -> None:
        super().__init__()
        self.seal_summary = seal_summary
        self.base = base
        self.namespaces = namespaces or {}  # a namespaced function's namespace, by its name
        self.custom_tools = custom_tools  # the names whose calls are custom_tool_call items
        self.store_response = store_response  # stores the finished response object, if the request asked for it
        self.seal = seal
        self.sequence = 0
        self.output: list[dict] = []
        self.message_id: Optional[str] = None  # the message item being written, if any
        self.texts: list[str] = []
        self.reasoning_id: Optional[str] = None  # the reasoning item being written, if any
        self.thoughts: list[str] = []
        self.listed: list[dict] = []  # log probabilities of the message so far (output text only)
        self.started: dict[str, int] = {}  # a started call's id: how much of its arguments was sent
        self.end = ChoiceEnd("stop")
        self.compaction_id = new_id("cmp_")

    def _event(self, kind: str, **fields: Any) -> str:
        frame = sse({"type": kind, "sequence_number": self.sequence, **fields}, kind)
        self.sequence += 1
        return frame

    def _sealed(self, item: dict) -> dict:
        if self.seal is not None:
            item["encrypted_content"] = self.seal(item["content"][0]["text"])
        return item

    def start(self) -> Iterator[str]:
        yield self._event("response.created", response=self.base)
        yield self._event("response.in_progress", response=self.base)

    def reasoning(self, event: ReasoningDelta) -> Iterator[str]:
        if self.reasoning_id is None:
            self.reasoning_id = new_id("rs_")
            yield self._event("response.output_item.added", output_index=len(self.output),
                              item=_reasoning_item(self.reasoning_id, "", "in_progress"))
        self.thoughts.append(event.text)
        yield self._event("response.reasoning_text.delta", item_id=self.reasoning_id, output_index=len(self.output),
                          content_index=0, delta=event.text)

    def _close_reasoning(self) -> Iterator[str]:
        if self.reasoning_id is None:
            return
        text, item_id = "".join(self.thoughts), self.reasoning_id
        yield self._event("response.reasoning_text.done", item_id=item_id, output_index=len(self.output),
                          content_index=0, text=text)
        item = self._sealed(_reasoning_item(item_id, text, "completed"))
        yield self._event("response.output_item.done", output_index=len(self.output), item=item)
        self.output.append(item)
        self.reasoning_id, self.thoughts = None, []

    def compacting(self, event: Compacting) -> Iterator[str]:
        where = {"output_index": len(self.output)}
        yield self._event("response.output_item.added", **where, item=compaction_item(self.compaction_id, ""))
        yield self._event("response.compaction.compacting", item_id=self.compaction_id, **where)

    def compacted(self, event: Compacted) -> Iterator[str]:
        item = self._compaction(event)
        yield self._event("response.output_item.done", output_index=len(self.output), item=item)
        self.output.append(item)

    def _compaction(self, event: Compacted) -> dict:
        assert self.seal_summary is not None, "a response that compacts seals its summary"
        return compaction_item(self.compaction_id, self.seal_summary(event.summary))

    def _close(self) -> Iterator[str]:
        yield from self._close_reasoning()
        yield from self._close_message("completed")

    def tools_listed(self, event: ToolsListed) -> Iterator[str]:
        yield from self._close()
        index, item_id = len(self.output), new_id("mcpl_")
        yield self._event("response.output_item.added", output_index=index, item=_list_item(event, item_id, False))
        yield self._event("response.mcp_list_tools.in_progress", item_id=item_id, output_index=index)
        kind = "failed" if event.error is not None else "completed"
        yield self._event(f"response.mcp_list_tools.{kind}", item_id=item_id, output_index=index)
        item = _list_item(event, item_id, True)
        yield self._event("response.output_item.done", output_index=index, item=item)
        self.output.append(item)

    def server_call(self, event: ServerToolCall) -> Iterator[str]:
        yield from self._close()
        self.take_logprobs()  # the call's own tokens: only output text lists its tokens
        index, item = len(self.output), _mcp_call_item(event.call, event.server)
        yield self._event("response.output_item.added", output_index=index, item={**item, "arguments": ""})
        yield self._event("response.mcp_call.in_progress", item_id=item["id"], output_index=index)
        yield self._event("response.mcp_call_arguments.delta", item_id=item["id"], output_index=index,
                          delta=event.call.arguments)
        yield self._event("response.mcp_call_arguments.done", item_id=item["id"], output_index=index,
                          arguments=event.call.arguments)

    def server_result(self, event: ServerToolResult) -> Iterator[str]:
        index, item = len(self.output), _mcp_call_item(event.call, event.server, event)
        yield self._event(f"response.mcp_call.{item['status']}", item_id=item["id"], output_index=index)
        yield self._event("response.output_item.done", output_index=index, item=item)
        self.output.append(item)

    def approval_asked(self, event: ApprovalAsked) -> Iterator[str]:
        yield from self._close()
        self.take_logprobs()
        index, item = len(self.output), _approval_item(event)
        yield self._event("response.output_item.added", output_index=index, item=item)
        yield self._event("response.output_item.done", output_index=index, item=item)
        self.output.append(item)

    def text(self, event: TextDelta) -> Iterator[str]:
        yield from self._close_reasoning()
        where = {"output_index": len(self.output), "content_index": 0}
        if self.message_id is None:
            self.message_id = new_id("msg_")
            yield self._event("response.output_item.added", output_index=len(self.output),
                              item=_message_item(self.message_id, "", "in_progress"))
            yield self._event("response.content_part.added", item_id=self.message_id, **where,
                              part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})
        self.texts.append(event.text)
        listed = logprob_content(self.take_logprobs())
        self.listed += listed
        yield self._event("response.output_text.delta", item_id=self.message_id, **where, delta=event.text,
                          logprobs=listed)

    def _close_message(self, status: str) -> Iterator[str]:
        if self.message_id is None:
            return
        text, item_id = "".join(self.texts), self.message_id
        where = {"item_id": item_id, "output_index": len(self.output), "content_index": 0}
        item = _message_item(item_id, text, status, self.listed)
        yield self._event("response.output_text.done", **where, text=text, logprobs=self.listed)
        yield self._event("response.content_part.done", **where, part=item["content"][0])
        yield self._event("response.output_item.done", output_index=len(self.output), item=item)
        self.output.append(item)
        self.message_id, self.texts, self.listed = None, [], []
        self.take_logprobs()  # tokens whose text never came out: only output text lists its tokens

    def call_start(self, event: ToolCallStart) -> Iterator[str]:
        # A function's call goes out as it is written (its item is the next output); a custom tool's input comes
        # whole, at its end.
        if event.name in self.custom_tools:
            return
        yield from self._close_reasoning()
        yield from self._close_message("completed")
        self.started[event.id] = 0
        added = _call_item(ToolCall(event.id, event.name, ""), "", "in_progress", self.namespaces.get(event.name))
        yield self._event("response.output_item.added", output_index=len(self.output), item=added)

    def call_arguments(self, event: ArgumentsDelta) -> Iterator[str]:
        if event.id in self.started:
            self.started[event.id] += len(event.text)
            yield self._event("response.function_call_arguments.delta", item_id="fc_" + event.id,
                              output_index=len(self.output), delta=event.text)

    def tool_call(self, event: ToolCall) -> Iterator[str]:
        yield from self._close_reasoning()
        yield from self._close_message("completed")
        self.take_logprobs()  # the call's own tokens: only output text lists its tokens
        if event.name in self.custom_tools:
            yield from self._custom_call(event)
            return
        index, item_id = len(self.output), "fc_" + event.id
        sent = self.started.pop(event.id, None)
        if sent is None:
            added = _call_item(event, "", "in_progress", self.namespaces.get(event.name))
            yield self._event("response.output_item.added", output_index=index, item=added)
        if event.arguments[sent or 0:]:
            yield self._event("response.function_call_arguments.delta", item_id=item_id, output_index=index,
                              delta=event.arguments[sent or 0:])
        yield self._event("response.function_call_arguments.done", item_id=item_id, output_index=index,
                          arguments=event.arguments)
        item = _call_item(event, event.arguments, "completed" if event.complete else "incomplete",
                          self.namespaces.get(event.name))
        yield self._event("response.output_item.done", output_index=index, item=item)
        self.output.append(item)

    def _custom_call(self, event: ToolCall) -> Iterator[str]:
        index, item = len(self.output), _custom_call_item(event, "completed" if event.complete else "incomplete")
        yield self._event("response.output_item.added", output_index=index, item={**item, "status": "in_progress",
                                                                                  "input": ""})
        yield self._event("response.custom_tool_call_input.delta", item_id=item["id"], output_index=index,
                          delta=item["input"])
        yield self._event("response.custom_tool_call_input.done", item_id=item["id"], output_index=index,
                          input=item["input"])
        yield self._event("response.output_item.done", output_index=index, item=item)
        self.output.append(item)

    def choice_end(self, event: ChoiceEnd) -> Iterator[str]:
        self.end = event
        yield from self._close_reasoning()
        yield from self._close_message("incomplete" if event.reason == "length" else "completed")

    def finished(self, event: Finished) -> Iterator[str]:
        final = _final(self.base, self.output, self.end, event)
        if self.store_response:
            try:
                # before the client hears it is done: it may continue the conversation at once
                self.store_response(final)
            except ApiError as exc:
                error = {"code": exc.code, "message": exc.message}
                yield self._event("response.failed", response={**final, "status": "failed", "error": error})
                return
        kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        yield self._event(kind, response=final)

    def failed(self, event: Failed) -> Iterator[str]:
        error = {"code": "server_error", "message": event.message}
        yield self._event("response.failed", response={**self.base, "status": "failed", "error": error,
                                                         "output": self.output})

    def whole(self, output: list[Event], finished: Finished) -> dict:
        end = next(e for e in reversed(output) if isinstance(e, ChoiceEnd))
        answer = [e for e in output if isinstance(e, (TextDelta, ToolCall))]
        listed = {id(text): logprob_content(tokens.tokens) for tokens, text in zip(output, output[1:])
                  if isinstance(tokens, Logprobs) and isinstance(text, TextDelta)}
        items: list[dict] = []
        thoughts: list[str] = []

        def close_thinking() -> None:
            if thoughts:
                items.append(self._sealed(_reasoning_item(new_id("rs_"), "".join(thoughts), "completed")))
                thoughts.clear()

        for event in output:
            if isinstance(event, ReasoningDelta):
                thoughts.append(event.text)
                continue
            if isinstance(event, (Compacted, ToolsListed, ServerToolResult, ApprovalAsked, ToolCall, TextDelta)):
                close_thinking()
            if isinstance(event, Compacted):
                items.append(self._compaction(event))
            elif isinstance(event, ToolsListed):
                items.append(_list_item(event, new_id("mcpl_"), True))
            elif isinstance(event, ServerToolResult):
                items.append(_mcp_call_item(event.call, event.server, event))
            elif isinstance(event, ApprovalAsked):
                items.append(_approval_item(event))
            elif isinstance(event, ToolCall):
                status = "completed" if event.complete else "incomplete"
                items.append(_custom_call_item(event, status) if event.name in self.custom_tools
                             else _call_item(event, event.arguments, status, self.namespaces.get(event.name)))
            elif isinstance(event, TextDelta):
                cut_short = event is answer[-1] and end.reason == "length"
                status = "incomplete" if cut_short else "completed"
                items.append(_message_item(new_id("msg_"), event.text, status, listed.get(id(event))))
        close_thinking()
        return {**_final(self.base, items, end, finished), "output_text": _output_text(items)}

    def store_whole(self, answer: dict) -> None:
        if self.store_response:
            self.store_response({key: value for key, value in answer.items() if key != "output_text"})