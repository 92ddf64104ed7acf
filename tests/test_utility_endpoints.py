"""Legacy completions, embeddings, tokenize and detokenize on the tiny real model."""

import base64

import numpy as np
import openai
import pytest
import requests

from kronk_wsgi.testing.rawhttp import RawStream, data_of

NO_EOS = {"logit_bias": {"2": -100}}


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_completions_create_and_stream(client):
    whole = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=7, seed=3, extra_body=NO_EOS)
    assert whole.object == "text_completion" and whole.id.startswith("cmpl-")
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 7
    chunks = list(client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=7, seed=3,
                                            stream=True, stream_options={"include_usage": True}, extra_body=NO_EOS))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_completions_prompt_as_token_ids_or_a_list_of_one(client, server):
    ids = server.post("/v1/tokenize", {"model": "tiny", "text": "Once upon a time"}).json()["tokens"]
    text = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=5, seed=3, extra_body=NO_EOS)
    for prompt in (ids, [ids], ["Once upon a time"]):
        same = client.completions.create(model="tiny", prompt=prompt, max_tokens=5, seed=3, extra_body=NO_EOS)
        assert same.choices[0].text == text.choices[0].text and same.usage.prompt_tokens == len(ids)
    mixed = server.post("/v1/completions", {"model": "tiny", "prompt": ["a", [1, 2]]})
    assert mixed.status_code == 400 and mixed.json()["error"]["param"].startswith("prompt")
    unknown = server.post("/v1/completions", {"model": "tiny", "prompt": [1, 99999]})
    assert unknown.status_code == 400 and "vocabulary" in unknown.json()["error"]["message"]


def test_completions_default_max_tokens_is_16(client):
    assert client.completions.create(model="tiny", prompt="Hi", extra_body=NO_EOS).usage.completion_tokens == 16


def test_completions_raw_stream_ends_with_done(server):
    raw = RawStream(server.host, server.port, "/v1/completions", {"model": "tiny", "prompt": "Hi", "max_tokens": 3, "stream": True})
    frames = [f for _, f in raw.frames()]
    raw.close()
    assert frames[-1] == "data: [DONE]"
    assert data_of(frames[0])["choices"][0]["text"] == ""  # the commit
    assert data_of(frames[-2])["choices"][0]["finish_reason"] in ("stop", "length")


@pytest.mark.parametrize("payload,param", [
    ({"model": "tiny", "prompt": "x", "echo": True}, "echo"),
    ({"model": "tiny", "prompt": "x", "suffix": "y"}, None),
    ({"model": "tiny", "prompt": []}, "prompt"),
    ({"model": "tiny", "prompt": "x", "best_of": 2}, "best_of"),
    ({"model": "tiny", "prompt": "x", "logprobs": 6}, "logprobs"),
    ({"model": "tiny", "prompt": "word " * 3000}, "prompt"),
    ({"model": "tiny"}, "prompt"),
])
def test_completions_bad_input(server, payload, param):
    response = server.post("/v1/completions", payload)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == param


def test_embeddings_float_and_base64(client, server):
    floats = client.embeddings.create(model="tiny", input=["hello", "world", "hello"], encoding_format="float")
    assert [d.index for d in floats.data] == [0, 1, 2]
    vectors = np.array([d.embedding for d in floats.data])
    assert vectors.shape == (3, 64)
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    assert np.allclose(vectors[0], vectors[2]) and not np.allclose(vectors[0], vectors[1])
    assert floats.usage.prompt_tokens == floats.usage.total_tokens > 3
    raw = server.post("/v1/embeddings", {"model": "tiny", "input": "hello", "encoding_format": "base64"}).json()
    decoded = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    assert np.allclose(decoded, vectors[0], atol=1e-6)
    single = client.embeddings.create(model="tiny", input="world")  # the openai package asks for base64 itself
    assert np.allclose(single.data[0].embedding, vectors[1], atol=1e-6)


def test_embeddings_of_token_ids(client, server):
    """LangChain's OpenAIEmbeddings sends token arrays: int[] and int[][] are the texts they stand for."""
    ids = server.post("/v1/tokenize", {"model": "tiny", "text": "hello world"}).json()["tokens"]
    text = client.embeddings.create(model="tiny", input="hello world", encoding_format="float").data[0].embedding
    one = client.embeddings.create(model="tiny", input=ids, encoding_format="float")
    assert len(one.data) == 1 and np.allclose(one.data[0].embedding, text, atol=1e-6)
    assert one.usage.prompt_tokens == len(ids)
    two = client.embeddings.create(model="tiny", input=[ids, ids[:2]], encoding_format="float")
    assert [d.index for d in two.data] == [0, 1] and np.allclose(two.data[0].embedding, text, atol=1e-6)


@pytest.mark.parametrize("payload,param", [
    ({"model": "tiny", "input": ""}, "input"),
    ({"model": "tiny", "input": []}, "input"),
    ({"model": "tiny", "input": [1, 99999]}, "input"),
    ({"model": "tiny", "input": [[1, 2], []]}, "input[1]"),
    ({"model": "tiny", "input": "x", "encoding_format": "int8"}, "encoding_format"),
    ({"model": "tiny", "input": "x", "dimensions": 8}, None),
    ({"model": "tiny", "input": "word " * 3000}, "input"),
])
def test_embeddings_bad_input(server, payload, param):
    response = server.post("/v1/embeddings", payload)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == param


def test_tokenize_round_trip_and_chat_template(server):
    tokens = server.post("/v1/tokenize", {"model": "tiny", "text": "hello world"}).json()
    assert tokens["count"] == len(tokens["tokens"]) and tokens["tokens"][0] == 1  # BOS
    assert tokens["max_context_length"] == 2048
    bare = server.post("/v1/tokenize", {"model": "tiny", "text": "hello world", "add_special": False}).json()
    assert bare["tokens"] == tokens["tokens"][1:]
    text = server.post("/v1/detokenize", {"model": "tiny", "tokens": tokens["tokens"]}).json()["text"]
    assert text == "hello world"
    messages = [{"role": "user", "content": "Hello there"}]
    counted = server.post("/v1/tokenize", {"model": "tiny", "messages": messages}).json()["count"]
    used = server.post("/v1/chat/completions", {"model": "tiny", "messages": messages, "max_tokens": 1}).json()
    assert counted == used["usage"]["prompt_tokens"]


@pytest.mark.parametrize("path,payload,param", [
    ("/v1/tokenize", {"model": "tiny"}, None),
    ("/v1/tokenize", {"model": "tiny", "text": "a", "messages": [{"role": "user", "content": "b"}]}, None),
    ("/v1/tokenize", {"model": "tiny", "text": 5}, "text"),
    ("/v1/detokenize", {"model": "tiny", "tokens": [1, 99999]}, "tokens[1]"),
    ("/v1/detokenize", {"model": "tiny", "tokens": [-1]}, "tokens[0]"),
    ("/v1/detokenize", {"model": "tiny", "tokens": "abc"}, "tokens"),
])
def test_tokens_bad_input(server, path, payload, param):
    response = server.post(path, payload)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == param


def test_unknown_model_everywhere(server):
    for path, payload in [("/v1/completions", {"prompt": "x"}), ("/v1/embeddings", {"input": "x"}),
                          ("/v1/tokenize", {"text": "x"}), ("/v1/detokenize", {"tokens": [1]})]:
        response = requests.post(server.url + path, json={"model": "nope", **payload}, timeout=30)
        assert response.status_code == 404 and response.json()["error"]["code"] == "model_not_found"


def test_developer_messages_are_system_messages_to_the_template(server):
    def count(role):
        messages = [{"role": role, "content": "Be brief."}, {"role": "user", "content": "Hi"}]
        return server.post("/v1/tokenize", {"model": "tiny", "messages": messages}).json()["tokens"]

    assert count("developer") == count("system")
