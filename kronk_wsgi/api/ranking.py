"""Reranking, as each protocol's rerank route asks for it: documents scored against a query on a reranker model,
best first."""

import dataclasses
from typing import Annotated, Optional, Sequence, Union

from pydantic import Field

from .response import run_to_end
from .schemas import Strict
from .sessions import start_rerank


class TextDocument(Strict):
    """A document as an object (Jina's and Cohere's clients send these too)."""

    text: str


Document = Union[str, TextDocument]
Documents = Annotated[list[Document], Field(min_length=1, max_length=10_000)]


def document_text(document: Document) -> str:
    return document if isinstance(document, str) else document.text


@dataclasses.dataclass(frozen=True)
class Ranking:
    """The documents' indexes and scores, best first, and the prompt tokens read to score them."""

    results: list[tuple[int, float]]
    prompt_tokens: int

    def entries(self, texts: Sequence[str], documents: bool = False, score: str = "relevance_score",
                text: bool = False) -> list[dict]:
        """The results as the APIs list them: each document's index and ``score``, with ``documents`` the document
        as ``{"text"}``, with ``text`` its text."""
        entries = []
        for index, value in self.results:
            entry: dict = {"index": index, score: value}
            if text:
                entry["text"] = texts[index]
            if documents:
                entry["document"] = {"text": texts[index]}
            entries.append(entry)
        return entries


def rank(model_id: str, query: str, documents: Sequence[str], param: str, top_n: Optional[int] = None,
         max_document_tokens: Optional[int] = None) -> Ranking:
    """Score every document (see plan_rerank), sort them by score (ties in the documents' order), keep ``top_n``."""
    output, finished = run_to_end(start_rerank(model_id, query, documents, param, max_document_tokens))
    results = sorted(((event.index, float(event.vector[0])) for event in output), key=lambda result: -result[1])
    return Ranking(results[:top_n], finished.usage.prompt_tokens)
