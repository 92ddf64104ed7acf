"""The Responses API's views: create (now or in the background), count input tokens, get, cancel, delete."""

import dataclasses
import json
import re
import time
from typing import Any, Callable, Optional, Union

import flask
import gevent
import structlog
from flask import jsonify

from ....serving import offload
from ....serving.formats import custom_arguments
from ....serving.session import Session
from ...background import UNFINISHED, BackgroundRun, resumed
from ...body import parse_body
from ...compaction import CompactingSession, compacted, kept, plan_compaction, start_compaction, write_summary
from ...errors import ApiError, invalid
from ...planning import GenerationRequest
from ...response import respond, watched
from ...schemas import template_tool_call
from ...server_tools import ServerTools, ToolLoopSession
from ...sessions import count_prompt_tokens, start_generation, start_later
from ...state import record, state
from .encoder import ResponsesEncoder, compaction_item, new_id, usage_object
from .mcp_tools import run_approved, server_tools
from .protocol import PROTOCOL, bp
from .schemas import (
    CompactionItem, CompactRequest, ConversationBody, McpApprovalResponseItem, ReasoningItem, ResponsesRequest,
    mcp_call_answer,
)

log = structlog.get_logger("kronk_wsgi.responses")

STORE_WAIT_SECONDS = 2.0  # how long a finished response waits for its write before the client hears it is done


def _not_kept(response_id: str, param: Optional[str] = None) -> ApiError:
    return ApiError(404, f"no stored response has the id {response_id[:100]!r}", code="response_not_found", param=param)


def _stored(read: Callable[[str, str], Any], response_id: str, param: Optional[str] = None) -> Any:
    """What ``read`` (the store's get or conversation) finds of a response of this request's key, in the store
    thread; 404 if it is not (or no longer) kept."""
    found = offload.call(state().store_thread, read, response_id, record().owner)
    if found is None:
        raise _not_kept(response_id, param)
    return found


def _storer(response_id: str, previous: Optional[str], messages: list[dict],
            conversation: list[dict]) -> Callable[[dict], None]:
    """What stores a finished response (``messages`` its input, ``conversation`` all it continues): it waits up to
    STORE_WAIT_SECONDS for the write. A response that compacted its conversation starts a conversation anew: the
    compacted one.

    A failed write is an ApiError (500 ``store_failed``), in time for the client to hear of it; a write
    that takes longer goes on in the store thread, before any later read of this worker.
    """
    kronk, owner = state(), record().owner

    def write(final: dict) -> None:
        summary = next((kronk.sealer.open(item["encrypted_content"]) for item in final["output"]
                        if item["type"] == "compaction"), None)
        continues, added = (previous, messages) if summary is None else (None, compacted(conversation, summary))
        try:
            kronk.responses.put(final, owner, continues, added + _output_messages(final["output"]))
        except Exception as exc:  # sqlite3's and the file system's errors
            log.error("response not stored", response_id=response_id, error=f"{type(exc).__name__}: {exc}")
            raise

    def store_response(final: dict) -> None:
        try:
            with gevent.Timeout(STORE_WAIT_SECONDS):
                offload.call(kronk.store_thread, write, final)
        except gevent.Timeout:
            log.warning("response store slow: the write goes on", response_id=response_id)
        except Exception as exc:
            raise ApiError(500, f"the response could not be stored: {exc}", code="store_failed") from None

    return store_response


def _open_sealed(body: ConversationBody) -> None:
    """Open each compaction item's summary; 400 naming the item if it, or reasoning handed back sealed, was not
    sealed here, or was changed."""
    sealer = state().sealer
    for index, item in enumerate(body.input_items()):
        if isinstance(item, (ReasoningItem, CompactionItem)) and item.encrypted_content is not None:
            try:
                opened = sealer.open(item.encrypted_content)
            except ValueError as exc:
                raise invalid(f"input[{index}].encrypted_content: {exc}",
                              param=f"input[{index}].encrypted_content") from None
            if isinstance(item, CompactionItem):
                item.opened(opened)


def _output_messages(output: list[dict]) -> list[dict]:
    """A response's output items as the chat messages of the conversation it continues: the assistant's text and
    calls, and the answers of the calls this server ran."""
    messages: list[dict] = []

    def assistant() -> dict:
        if not messages or messages[-1]["role"] != "assistant":
            messages.append({"role": "assistant", "content": ""})
        return messages[-1]

    for item in output:
        if item["type"] == "message":
            turn = assistant()
            turn["content"] += "".join(part["text"] for part in item["content"])
        elif item["type"] in ("function_call", "custom_tool_call", "mcp_call", "mcp_approval_request"):
            call_id = item["call_id"] if "call_id" in item else item["id"]
            assistant().setdefault("tool_calls", []).append(
                template_tool_call(call_id, item["name"], _call_arguments(item)))
            if item["type"] == "mcp_call":
                messages.append({"role": "tool", "content": mcp_call_answer(item["output"], item["error"]),
                                 "tool_call_id": call_id})
    return messages or [{"role": "assistant", "content": ""}]


def _call_arguments(item: dict) -> Any:
    """A call item's arguments as chat templates take them: an object, or the text of one cut off by the token
    limit, as it was written."""
    if item["type"] == "custom_tool_call":
        return custom_arguments(item["input"])
    try:
        return json.loads(item["arguments"])
    except ValueError:
        return item["arguments"]


@bp.post("/v1/responses")
def responses():
    """Generate a model response; with store (the default), keep it for previous_response_id and GET."""
    body = parse_body(ResponsesRequest)
    _open_sealed(body)
    served = _served(body)
    previous = [] if body.previous_response_id is None else _conversation(body.previous_response_id)
    conversation = previous + body.input_messages()
    request = body.generation_request(conversation, served.functions() if served else ())
    response_id = new_id("resp_")
    if served is not None:
        session = ToolLoopSession(start_generation(request), request, served, state().mcp)
    elif body.background:
        run = BackgroundRun(state(), response_id, record().owner)
        try:
            admit = start_later(request)
        except BaseException:
            run.forget()
            raise
    else:
        session = _compacted_if_due(body, request, start_generation(request), conversation)
    record().response_id = response_id
    choice = body.tool_choice
    store = body.store is not False  # OpenAI's default
    base = {
        "id": response_id, "object": "response", "created_at": int(time.time()),
        "status": "queued" if body.background else "in_progress", "background": body.background,
        "error": None, "incomplete_details": None, "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens, "model": body.model, "output": [],
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": body.previous_response_id, "store": store, "temperature": body.temperature,
        "text": {"format": body.text.format.model_dump(by_alias=True, exclude_none=True)
                 if body.text and body.text.format else {"type": "text"}},
        "tool_choice": choice.model_dump(exclude_none=True) if choice is not None and not isinstance(choice, str)
        else choice or "auto",
        "tools": [t.model_dump(exclude={"headers", "authorization"}) for t in body.tools or ()],
        "top_p": body.top_p,
        "truncation": body.truncation or "disabled", "max_tool_calls": body.max_tool_calls,
        "reasoning": body.reasoning.model_dump() if body.reasoning else {"effort": None, "summary": None},
        "prompt_cache_key": body.prompt_cache_key, "safety_identifier": body.safety_identifier,
        "top_logprobs": body.top_logprobs,
        "usage": None, "user": body.user, "metadata": body.metadata or {},
    }

    store_response = _storer(response_id, body.previous_response_id, body.input_messages(), conversation) \
        if store else None
    sealer = state().sealer
    seal = sealer.seal if "reasoning.encrypted_content" in (body.include or ()) else None
    encoder = ResponsesEncoder(base, store_response, seal, body.namespaces(), body.custom_tools(), sealer.seal)
    if body.background:
        return run.start(admit, encoder, store_response, body.stream)
    return respond(session, encoder, body.stream)


def _served(body: ResponsesRequest) -> Optional[ServerTools]:
    """The request's mcp tools, with the calls its input approves already run."""
    served = server_tools(body)
    if served is not None and (body.background or body.context_management):
        raise invalid("mcp tools run here in a foreground response, without context_management", param="tools")
    if any(isinstance(item, McpApprovalResponseItem) for item in body.input_items()):
        earlier = [] if body.previous_response_id is None else \
            _stored(state().responses.get, body.previous_response_id, "previous_response_id")["output"]
        answered = run_approved(body, served, earlier)
        if served is not None:
            served = dataclasses.replace(served, answered=answered)
    return served


def _compacted_if_due(body: ResponsesRequest, request: GenerationRequest, session: Session,
                      conversation: list[dict]) -> Union[Session, CompactingSession]:
    """``session`` (``request``'s), or, if the request asks to be compacted and its planned prompt is past its
    threshold, the compaction's in its place (``session`` given back unstarted)."""
    threshold = body.compact_threshold(session.model.engine.context_length)
    tokens = session.job.prompt_tokens
    if threshold is None or tokens <= threshold:
        return session
    session.close()
    log.info("conversation to compact", prompt_tokens=tokens, compact_threshold=threshold)
    return start_compaction(plan_compaction(request, lambda summary: dataclasses.replace(
        body.generation_request(compacted(conversation, summary)), cache_breaks=())))


@bp.post("/v1/responses/compact")
def compact():
    """The conversation compacted: its user, system and developer messages, then the model's summary of it all
    as a compaction item (sealed), to send as the input of the requests that follow."""
    body = parse_body(CompactRequest)
    _open_sealed(body)
    previous = [] if body.previous_response_id is None else _conversation(body.previous_response_id)
    conversation = previous + body.input_messages()
    request = body.generation_request(conversation)
    plan = plan_compaction(request, lambda summary: dataclasses.replace(
        request, messages=body.instruction_messages() + compacted(conversation, summary)))
    summary, finished = write_summary(plan)
    output = [_kept_item(message) for message in conversation if kept(message)]
    output.append(compaction_item(new_id("cmp_"), state().sealer.seal(summary)))
    return jsonify({"id": new_id("cmp_"), "object": "response.compaction", "created_at": int(time.time()),
                    "output": output, "usage": usage_object(finished.usage)})


def _kept_item(message: dict) -> dict:
    return {"id": new_id("msg_"), "type": "message", "status": "completed", "role": message["role"],
            "content": [{"type": "input_text", "text": message["content"]}]}


@bp.post("/v1/responses/input_tokens")
def input_tokens():
    """The input tokens the same response request would take (previous_response_id's conversation included)."""
    body = parse_body(ResponsesRequest)
    _open_sealed(body)
    previous = [] if body.previous_response_id is None else _conversation(body.previous_response_id)
    count = count_prompt_tokens(body.generation_request(previous + body.input_messages()))
    return jsonify({"object": "response.input_tokens", "input_tokens": count})


def _conversation(response_id: str) -> list[dict]:
    """The conversation a request continues; 400 if that response is not done yet (a background one)."""
    earlier = _stored(state().responses.get, response_id, "previous_response_id")
    if earlier["status"] in UNFINISHED:
        raise invalid(f"response {response_id[:100]!r} is {earlier['status']}: continue it once it is done",
                      param="previous_response_id")
    return _stored(state().responses.conversation, response_id, "previous_response_id")


@bp.get("/v1/responses/<response_id>")
def get_response(response_id: str):
    """A stored response; with ``stream=true``, a background response's stream again, from the event after
    ``starting_after`` (its sequence number) on."""
    kronk = state()
    found = _stored(kronk.responses.get, response_id)
    if flask.request.args.get("stream", "false").lower() not in ("true", "1"):
        return jsonify(found)
    if not found.get("background"):
        raise invalid("only a background response's stream can be read again", param="stream")
    after = flask.request.args.get("starting_after", "-1")
    if not re.fullmatch(r"-?[0-9]{1,15}", after):
        raise invalid(f"starting_after must be an event's sequence number, not {after[:50]!r}",
                      param="starting_after")
    frames = resumed(kronk, record().owner, response_id, int(after), kronk.settings.keepalive_interval,
                     PROTOCOL.framing.keepalive)
    return PROTOCOL.stream(watched(frames))


@bp.post("/v1/responses/<response_id>/cancel")
def cancel_response(response_id: str):
    """Cancel a background response: it stops before its next token. The response as it is then (one that
    ended first is returned as it ended)."""
    kronk = state()
    if not _stored(kronk.responses.get, response_id).get("background"):
        raise invalid("only background responses can be cancelled")
    cancelled = _stored(kronk.responses.cancel, response_id)
    run = kronk.background.get(response_id)
    if run is not None:
        run.cancelled_here = True
    return jsonify(cancelled)


@bp.delete("/v1/responses/<response_id>")
def delete_response(response_id: str):
    """Forget a stored response."""
    kronk = state()
    if not offload.call(kronk.store_thread, kronk.responses.delete, response_id, record().owner):
        raise _not_kept(response_id)
    return jsonify({"id": response_id, "object": "response", "deleted": True})


