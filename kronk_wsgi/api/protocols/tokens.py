"""POST /v1/tokenize and /v1/detokenize: the model's own tokenizer, with or without its chat template."""

from typing import Annotated, Optional

import pydantic
from flask import Blueprint, jsonify
from pydantic import Field

from ...serving.pool import LoadedModel
from ..body import parse_body
from ..planning import known_ids, render_chat, tokenize_prompt
from ..protocol import Protocol
from ..schemas import ChatMessage, ChatTool, Strict, chat_media, template_tool
from ..sessions import use_model

bp = Blueprint("tokens", __name__)
PROTOCOL = Protocol("tokens", bp, prefixes=("/v1/tokenize", "/v1/detokenize"))


class TokenizeRequest(Strict):
    model: str
    text: Optional[str] = None
    messages: Optional[Annotated[list[ChatMessage], Field(min_length=1)]] = None
    tools: Optional[list[ChatTool]] = None
    add_special: bool = True  # BOS (and EOS) as the model asks
    parse_special: bool = True  # control-token text in ``text`` becomes control tokens

    @pydantic.model_validator(mode="after")
    def _checks(self) -> "TokenizeRequest":
        if (self.text is None) == (self.messages is None):
            raise ValueError("give text or messages, not both")
        if self.tools and self.messages is None:
            raise ValueError("tools go with messages")
        return self


class DetokenizeRequest(Strict):
    model: str
    tokens: list[Annotated[int, Field(ge=0)]]


@bp.post("/v1/tokenize")
def tokenize():
    """Tokens of a text, or of chat messages rendered by the model's chat template."""
    body = parse_body(TokenizeRequest)
    with use_model(body.model) as model:
        if body.messages is None:
            tokens = model.tokenize(body.text, add_special=body.add_special, parse_special=body.parse_special)
        else:
            tools = [template_tool(t.function.name, t.function.description, t.function.parameters)
                     for t in body.tools or ()]
            prompt = render_chat(model, [m.for_template() for m in body.messages], tools)
            media = chat_media(body.messages)
            tokens = tokenize_prompt(model, prompt, media) if media else \
                model.tokenize(prompt.text, add_special=body.add_special, inert=prompt.inert)
        return jsonify({"tokens": tokens, "count": len(tokens), "max_context_length": model.engine.context_length})


@bp.post("/v1/detokenize")
def detokenize():
    """The text some tokens stand for."""
    body = parse_body(DetokenizeRequest)
    with use_model(body.model) as model:
        return jsonify({"text": text_of(model, body.tokens)})


def text_of(model: LoadedModel, tokens: list[int]) -> str:
    """The text of ``tokens``; 400 naming the first that is not in the model's vocabulary."""
    return model.detokenize(known_ids(model.engine.tokenizer.vocab_size, tokens, "tokens")).decode("utf-8", "replace")
