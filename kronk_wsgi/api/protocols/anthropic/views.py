"""The Messages API's views: create a message, count a request's tokens."""

import uuid

from flask import jsonify

from ...body import parse_body
from ...cache_diagnostics import diagnose
from ...planning import render_chat
from ...response import respond
from ...schemas import template_variables
from ...sessions import start_generation, use_model
from ...state import record
from .encoder import MessagesEncoder
from .protocol import bp
from .schemas import CountTokensRequest, MessagesRequest


@bp.post("/v1/messages")
def messages():
    """Generate the assistant's next message."""
    body = parse_body(MessagesRequest)
    session = start_generation(body.generation_request())
    message_id = record().response_id = "msg_" + uuid.uuid4().hex
    shown = getattr(body.thinking, "display", None) != "omitted"
    encoder = MessagesEncoder(message_id, body.model, session.job.prompt_tokens, shown)
    if body.diagnostics is not None:
        encoder.head["diagnostics"] = diagnose(body, message_id)
    return respond(session, encoder, body.stream)


@bp.post("/v1/messages/count_tokens")
def count_tokens():
    """The number of prompt tokens the same request would use."""
    body = parse_body(CountTokensRequest)
    with use_model(body.model) as model:
        prompt = render_chat(model, body.template_messages(), body.template_tools(), body.thinking_switch(),
                             variables=template_variables(body.effort()))
        return jsonify({"input_tokens": len(model.tokenize(prompt.text, inert=prompt.inert))})
