"""The Messages API's views: create a message, count a request's tokens."""

import dataclasses
import uuid
from typing import Optional

from flask import jsonify

from ...body import parse_body
from ...compaction import Plan, plan_compaction, start_compaction, summary_message
from ...errors import invalid
from ...planning import GenerationRequest
from ...cache_diagnostics import diagnose
from ...response import respond
from ...server_tools import ToolLoopSession
from ...sessions import start_generation, use_model
from ...state import record, state
from .connector import connector_tools
from .context_editing import edit_context, prompt_tokens
from .encoder import MessagesEncoder
from .protocol import bp
from .schemas import CountTokensRequest, MessagesRequest

DEFAULT_COMPACT_TRIGGER = 150_000  # input tokens, as Anthropic's compact_20260112 has it


@bp.post("/v1/messages")
def messages():
    """Generate the assistant's next message."""
    body = parse_body(MessagesRequest)
    served = connector_tools(body)
    edited = None
    if body.context_management is not None:
        with use_model(body.model) as model:
            edited = edit_context(model, body)
    request = body.generation_request(edited.messages if edited else None)
    compaction = _compaction(body, request, edited.tokens) if edited else None
    if compaction is not None and served is not None:
        raise invalid("context_management: compact_20260112 and mcp_servers are not served together here",
                      param="context_management")
    session = start_compaction(compaction) if compaction is not None else start_generation(request)
    input_tokens = session.stats.prompt_tokens
    if served is not None:
        session = ToolLoopSession(session, request, served, state().mcp)
    message_id = record().response_id = "msg_" + uuid.uuid4().hex
    shown = getattr(body.thinking, "display", None) != "omitted"
    managed = {"applied_edits": edited.applied} if edited else None
    encoder = MessagesEncoder(message_id, body.model, input_tokens, shown, managed)
    if body.diagnostics is not None:
        encoder.head["diagnostics"] = diagnose(body, message_id)
    return respond(session, encoder, body.stream)


def _compaction(body: MessagesRequest, request: GenerationRequest, tokens: int) -> Optional[Plan]:
    """How the request is compacted, if a compact_20260112 edit asks and its prompt reached the trigger: the
    model's summary stands for the whole conversation (the system prompt stays)."""
    edit = next((e for e in body.context_management.edits if e.type.startswith("compact")), None)
    if edit is None or tokens < (edit.trigger.value if edit.trigger else DEFAULT_COMPACT_TRIGGER):
        return None
    head = [m for m in request.messages[:1] if m["role"] == "system"]
    return plan_compaction(request, lambda summary: dataclasses.replace(
        request, messages=head + [summary_message(summary)], continue_final=False, cache_breaks=()),
        edit.instructions, bool(edit.pause_after_compaction))


@bp.post("/v1/messages/count_tokens")
def count_tokens():
    """The number of prompt tokens the same request would use."""
    body = parse_body(CountTokensRequest)
    connector_tools(body)
    with use_model(body.model) as model:
        if body.context_management is None:
            return jsonify({"input_tokens": prompt_tokens(model, body, body.template_messages())})
        edited = edit_context(model, body)
        return jsonify({"input_tokens": prompt_tokens(model, body, edited.messages),
                        "context_management": {"original_input_tokens": edited.original_tokens}})
