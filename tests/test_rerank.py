"""Reranking: llama-server's /rerank routes (Jina's and TEI's shapes), Cohere's /v2/rerank, Ollama's /api/rerank.

Two tiny rerankers with random weights (kronk_wsgi.testing.random_models: Qwen3-Reranker's layout, SmolLM2's
vocabulary), one with the Qwen3 rerank prompt in its file and one laid out by its tokenizer's BOS, EOS and SEP,
are served by this server (real gunicorn, the llama.cpp engine, two slots) and by llama-server built from the same
llama.cpp source (--reranking). The scores must agree to float precision, in the same order.
"""

import concurrent.futures
import json
import os

import pytest
import requests

from kronk_wsgi.testing import run_llama_server, run_server
from kronk_wsgi.testing.random_models import QWEN3_RERANK_TEMPLATE, write_reranker

BINARY = os.environ.get("KRONK_TEST_LLAMA_SERVER")
QUERY = "What is a giant panda?"
DOCUMENTS = [
    "hi",
    "It is a bear.",
    "The giant panda is a bear species endemic to China, known for its black and white coat.",
    "Paris, capitale de la France, est une grande ville européenne.",
    # Longer than one decode call (512 tokens): evaluated in two, as llama-server evaluates it.
    "Pandas eat bamboo. " * 130,
]


@pytest.fixture(scope="module")
def rerankers(smollm2, tmp_path_factory):
    folder = tmp_path_factory.mktemp("rerankers")
    return {"template": write_reranker(folder / "template.gguf", smollm2, QWEN3_RERANK_TEMPLATE),
            "pair": write_reranker(folder / "pair.gguf", smollm2)}


@pytest.fixture(scope="module")
def ours(rerankers, smollm2, tmp_path_factory):
    models = {name: {"path": str(path), "engine": "llama.cpp", "context_length": 2048}
              for name, path in rerankers.items()}
    models["smollm2"] = {"path": str(smollm2), "engine": "llama.cpp", "context_length": 2048}
    env = {"KRONK_MODELS": json.dumps(models), "KRONK_DEFAULT_MODEL": "template", "KRONK_PARALLEL": 2}
    with run_server(tmp_path_factory.mktemp("ours"), env) as server:
        yield server.url


@pytest.fixture(scope="module", params=["template", "pair"])
def pair_of_servers(request, rerankers, ours):
    """(our URL, llama-server's URL, the model's name), for each reranker."""
    if not BINARY:
        pytest.skip("llama-server is not built here (.ci/run builds it: KRONK_TEST_LLAMA_SERVER)")
    args = ["-c", "2048", "-np", "1", "-t", "1", "--no-webui", "--reranking"]
    with run_llama_server(BINARY, rerankers[request.param], args) as theirs:
        yield ours, theirs, request.param


def post(url: str, path: str, body: dict) -> dict:
    reply = requests.post(url + path, json=body, timeout=300)
    assert reply.status_code == 200, reply.text
    return reply.json()


def agree(mine: list[dict], reference: list[dict], score: str) -> None:
    assert [r["index"] for r in mine] == [r["index"] for r in reference]
    assert [r[score] for r in mine] == pytest.approx([r[score] for r in reference], rel=1e-5, abs=1e-12)


def test_scores_agree_with_llama_server(pair_of_servers):
    ours, theirs, name = pair_of_servers
    body = {"model": name, "query": QUERY, "documents": DOCUMENTS}
    mine, reference = post(ours, "/v1/rerank", body), post(theirs, "/v1/rerank", body)
    agree(mine["results"], reference["results"], "relevance_score")
    assert len({r["relevance_score"] for r in mine["results"]}) == len(DOCUMENTS)  # the documents do differ
    assert mine["usage"] == reference["usage"]
    assert mine["object"] == "list" and mine["model"] == name


def test_the_tei_shape_agrees_with_llama_server(pair_of_servers):
    ours, theirs, name = pair_of_servers
    body = {"model": name, "query": QUERY, "texts": DOCUMENTS[:4], "return_text": True, "top_n": 3}
    mine, reference = post(ours, "/rerank", body), post(theirs, "/rerank", body)
    agree(mine, reference, "score")
    assert [r["text"] for r in mine] == [r["text"] for r in reference]
    assert len(mine) == 3


def test_a_pair_scores_the_same_whatever_the_slot_held(ours):
    """Nothing is reused between documents: the same pair, alone or after others, scores exactly the same."""
    alone = post(ours, "/v1/rerank", {"query": QUERY, "documents": [DOCUMENTS[2]]})["results"][0]["relevance_score"]
    among = post(ours, "/v1/rerank", {"query": QUERY, "documents": DOCUMENTS})["results"]
    assert next(r["relevance_score"] for r in among if r["index"] == 2) == alone


def test_a_rerank_beside_a_completion_changes_neither(ours):
    """Two slots: ranking while the same model generates on the other one (their calls share decodes)."""
    body = {"model": "pair", "prompt": "The giant panda", "n_predict": 64, "temperature": 0}
    alone_text = post(ours, "/completion", body)["content"]
    alone_scores = post(ours, "/v1/rerank", {"model": "pair", "query": QUERY, "documents": DOCUMENTS})["results"]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        text = pool.submit(post, ours, "/completion", body)
        scores = [pool.submit(post, ours, "/v1/rerank", {"model": "pair", "query": QUERY, "documents": DOCUMENTS})
                  for _ in range(2)]
        assert text.result()["content"] == alone_text
        for ranked in scores:
            agree(ranked.result()["results"], alone_scores, "relevance_score")


@pytest.mark.parametrize("top_n,expected", [(None, 5), (2, 2), (5, 5), (99, 5), (0, 0)])
def test_top_n_keeps_the_best(ours, top_n, expected):
    body = {"query": QUERY, "documents": DOCUMENTS, **({"top_n": top_n} if top_n is not None else {})}
    results = post(ours, "/rerank", body)["results"]
    everything = post(ours, "/rerank", {"query": QUERY, "documents": DOCUMENTS})["results"]
    assert results == everything[:expected]
    assert [r["relevance_score"] for r in everything] == sorted((r["relevance_score"] for r in everything),
                                                               reverse=True)


def test_documents_come_back_when_asked_for(ours):
    body = {"query": QUERY, "documents": [{"text": "It is a bear."}, "hi"], "return_documents": True}
    results = post(ours, "/v1/reranking", body)["results"]
    assert {r["index"]: r["document"]["text"] for r in results} == {0: "It is a bear.", 1: "hi"}


@pytest.mark.parametrize("documents", [[], None, 123, [1, 2, 3]])
def test_bad_documents_are_a_400_in_llama_servers_shape(ours, documents):
    reply = requests.post(ours + "/rerank", json={"query": QUERY, "documents": documents}, timeout=30)
    assert reply.status_code == 400
    assert reply.json()["error"]["type"] == "invalid_request_error"
    assert "documents" in reply.json()["error"]["message"]


def test_a_model_that_is_no_reranker_is_a_400_naming_it(ours):
    reply = requests.post(ours + "/v1/rerank", json={"model": "smollm2", "query": "q", "documents": ["d"]},
                          timeout=30)
    assert reply.status_code == 400
    assert "'smollm2' is not a reranker" in reply.json()["error"]["message"]
    embedding = requests.post(ours + "/v1/embeddings", json={"model": "pair", "input": "hi"}, timeout=30)
    assert embedding.status_code == 400
    assert embedding.json()["error"]["param"] == "model"
    assert "is a reranker" in embedding.json()["error"]["message"]


def test_a_pair_longer_than_the_context_is_refused_and_cohere_cuts_documents(ours):
    long_document = "bamboo " * 3000
    reply = requests.post(ours + "/v1/rerank", json={"query": QUERY, "documents": ["hi", long_document]}, timeout=60)
    assert reply.status_code == 400
    assert reply.json()["error"]["type"] == "exceed_context_size_error"
    assert "document 1" in reply.json()["error"]["message"]
    cut = post(ours, "/v2/rerank", {"model": "template", "query": QUERY, "documents": ["hi", long_document],
                                    "max_tokens_per_doc": 50})
    assert {r["index"] for r in cut["results"]} == {0, 1}
    assert cut["meta"]["tokens"]["input_tokens"] < 2 * 150  # two prompts of the template, each document cut to 50


def test_cohere_clients_rerank(ours):
    import cohere

    expected = post(ours, "/v1/rerank", {"query": QUERY, "documents": DOCUMENTS})["results"]
    answer = cohere.ClientV2(api_key="unused", base_url=ours).rerank(
        model="template", query=QUERY, documents=DOCUMENTS, top_n=3)
    assert [(r.index, r.relevance_score) for r in answer.results] == \
        [(r["index"], r["relevance_score"]) for r in expected[:3]]
    assert answer.meta.api_version.version == "2" and answer.id
    older = cohere.Client(api_key="unused", base_url=ours).rerank(
        model="template", query=QUERY, documents=DOCUMENTS[:2], return_documents=True)
    assert {r.index: r.document.text for r in older.results} == {0: DOCUMENTS[0], 1: DOCUMENTS[1]}
    with pytest.raises(cohere.errors.NotFoundError) as missing:
        cohere.ClientV2(api_key="unused", base_url=ours).rerank(model="nope", query="q", documents=["d"])
    assert "nope" in missing.value.body["message"]


def test_ollama_clients_rerank(ours):
    expected = post(ours, "/v1/rerank", {"query": QUERY, "documents": DOCUMENTS})["results"]
    answer = post(ours, "/api/rerank", {"model": "template", "query": QUERY, "documents": DOCUMENTS, "top_n": 2,
                                        "return_documents": True})
    assert [(r["index"], r["relevance_score"]) for r in answer["results"]] == \
        [(r["index"], r["relevance_score"]) for r in expected[:2]]
    assert answer["results"][0]["document"]["text"] == DOCUMENTS[answer["results"][0]["index"]]
    assert answer["model"] == "template" and answer["prompt_eval_count"] > 0
    missing = requests.post(ours + "/api/rerank", json={"model": "template", "query": QUERY}, timeout=30)
    assert missing.status_code == 400 and "documents" in missing.json()["error"]
