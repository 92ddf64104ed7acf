"""POST /v2/rerank: Cohere's Rerank API, for the RAG stacks and SDKs that call it, on a reranker model."""

import uuid
from typing import Annotated, Optional

from flask import Blueprint, jsonify
from pydantic import Field

from ..body import parse_body
from ..protocol import Protocol
from ..ranking import Documents, document_text, rank
from ..schemas import Strict

bp = Blueprint("cohere", __name__)
PROTOCOL = Protocol("cohere", bp, prefixes=("/v2/rerank",), error_body=lambda error: {"message": error.message})


class RerankBody(Strict):
    """Cohere's v2 body; ``return_documents`` is its v1 field, which its clients still send."""

    model: str
    query: str
    documents: Documents
    top_n: Optional[Annotated[int, Field(ge=1)]] = None
    max_tokens_per_doc: Annotated[int, Field(ge=1)] = 4096
    return_documents: bool = False


@bp.post("/v2/rerank")
def rerank():
    """The documents scored against the query, best first; each cut to ``max_tokens_per_doc`` tokens first."""
    body = parse_body(RerankBody)
    texts = [document_text(d) for d in body.documents]
    ranking = rank(body.model, body.query, texts, "documents", body.top_n, body.max_tokens_per_doc)
    results = ranking.entries(texts, body.return_documents)
    meta = {"api_version": {"version": "2"}, "billed_units": {"search_units": 1},
            "tokens": {"input_tokens": ranking.prompt_tokens, "output_tokens": 0}}
    return jsonify({"id": str(uuid.uuid4()), "results": results, "meta": meta})
