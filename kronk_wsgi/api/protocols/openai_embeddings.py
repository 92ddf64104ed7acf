"""POST /v1/embeddings: OpenAI's embeddings, as floats or base64."""

import base64
from typing import Annotated, Literal, Optional, Union

import numpy as np
import pydantic
from flask import Blueprint, jsonify
from pydantic import Field

from ..body import parse_body
from ..protocol import Protocol
from ..response import run_to_end
from ..schemas import Strict
from ..sessions import start_embedding

bp = Blueprint("openai_embeddings", __name__)
PROTOCOL = Protocol("openai_embeddings", bp, prefixes=("/v1/embeddings",))

NonEmpty = Annotated[str, Field(min_length=1)]
Tokens = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]


class EmbeddingRequest(Strict):
    """``input`` in every form OpenAI defines: a text, texts, token ids, or lists of token ids."""

    model: str
    input: Union[
        NonEmpty, Annotated[list[NonEmpty], Field(min_length=1, max_length=2048)],
        Tokens, Annotated[list[Tokens], Field(min_length=1, max_length=2048)],
    ]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[int] = None
    user: Optional[str] = None

    @pydantic.model_validator(mode="after")
    def _checks(self) -> "EmbeddingRequest":
        if self.dimensions is not None:
            raise ValueError("dimensions is not supported: these models give vectors of one size")
        return self


def _encode(vector: np.ndarray, encoding: str):
    if encoding == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return vector.astype(float).tolist()


@bp.post("/v1/embeddings")
def embeddings():
    """Embed one text or a list of texts."""
    body = parse_body(EmbeddingRequest)
    single = isinstance(body.input, str) or isinstance(body.input[0], int)
    inputs = [body.input] if single else body.input
    output, finished = run_to_end(start_embedding(body.model, inputs, param="input"))
    data = [
        {"object": "embedding", "index": e.index, "embedding": _encode(e.vector, body.encoding_format)} for e in output
    ]
    usage = {"prompt_tokens": finished.usage.prompt_tokens, "total_tokens": finished.usage.prompt_tokens}
    return jsonify({"object": "list", "data": data, "model": body.model, "usage": usage})
