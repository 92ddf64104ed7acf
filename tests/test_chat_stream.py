"""Chat completions through real gunicorn + gevent on the tiny real model."""

import openai
import pytest
import requests
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from kronk_wsgi.metrics import GapCounter

from .conftest import metric
from kronk_wsgi.testing.rawhttp import RawStream, data_of

HELLO = [{"role": "user", "content": "Hello there"}]


def stream_frames(server, body):
    raw = RawStream(server.host, server.port, "/v1/chat/completions", body)
    try:
        return raw, [frame for _, frame in raw.frames()]
    finally:
        raw.close()


def test_stream_framing_and_order(server):
    raw, frames = stream_frames(server, {"model": "tiny", "messages": HELLO, "max_tokens": 12, "stream": True, "seed": 1})
    assert raw.status == 200
    assert raw.headers["content-type"].startswith("text/event-stream")
    assert raw.headers["cache-control"] == "no-cache"
    assert raw.headers["x-accel-buffering"] == "no"
    assert raw.headers["x-request-id"]
    assert frames[-1] == "data: [DONE]"
    chunks = [data_of(f) for f in frames[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert len({c["id"] for c in chunks}) == 1
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == "tiny" for c in chunks)
    assert "usage" not in chunks[0]  # only with stream_options.include_usage
    middle = chunks[1:-1]
    assert middle and all(c["choices"][0]["finish_reason"] is None for c in middle)
    assert all("content" in c["choices"][0]["delta"] for c in middle)
    last = chunks[-1]["choices"][0]
    assert last["delta"] == {} and last["finish_reason"] in ("stop", "length")


def test_stream_include_usage(server):
    body = {"model": "tiny", "messages": HELLO, "max_tokens": 6, "stream": True,
            "stream_options": {"include_usage": True}, "logit_bias": {"2": -100}}
    _, frames = stream_frames(server, body)
    chunks = [data_of(f) for f in frames[:-1]]
    assert all(c["usage"] is None for c in chunks[:-1])
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == []
    usage = usage_chunk["usage"]
    assert usage["completion_tokens"] == 6
    assert usage["total_tokens"] == usage["prompt_tokens"] + 6
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"


def test_whole_response(server):
    response = server.post("/v1/chat/completions", {"model": "tiny", "messages": HELLO, "max_tokens": 5, "logit_bias": {"2": -100}})
    assert response.status_code == 200
    body = response.json()
    assert body["object"] == "chat.completion"
    assert body["id"].startswith("chatcmpl-")
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant"
    assert choice["message"]["content"]
    assert choice["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 5


def test_request_id_is_echoed(server):
    response = server.post("/v1/chat/completions", {"model": "tiny", "messages": HELLO, "max_tokens": 1},
                           headers={"X-Request-ID": "abc-123"})
    assert response.headers["X-Request-ID"] == "abc-123"
    assert '"request_id": "abc-123"' in server.logs()


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_openai_client_create(client):
    completion = client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=7, logit_bias={"2": -100})
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage.completion_tokens == 7
    assert completion.choices[0].message.content


def test_openai_client_stream(client):
    stream = client.chat.completions.create(
        model="tiny", messages=HELLO, max_tokens=7, stream=True, seed=5,
        stream_options={"include_usage": True}, logit_bias={"2": -100},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    assert chunks[-1].usage.completion_tokens == 7
    whole = client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=7, seed=5, logit_bias={"2": -100})
    assert whole.choices[0].message.content == text


def test_openai_client_errors(client):
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="nope", messages=HELLO)
    assert err.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError):  # a prompt that cannot fit (a max_tokens that cannot is clamped)
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "word " * 3000}])


def test_seeds(server):
    def text(**extra):
        body = {"model": "tiny", "messages": HELLO, "max_tokens": 20, "logit_bias": {"2": -100}, **extra}
        return server.post("/v1/chat/completions", body).json()["choices"][0]["message"]["content"]

    assert text(seed=42) == text(seed=42)
    assert text(seed=42) != text(seed=43)
    assert text(temperature=0) == text(temperature=0, seed=7)


def test_stop_sequence(server):
    body = {"model": "tiny", "messages": HELLO, "max_tokens": 30, "seed": 9, "logit_bias": {"2": -100}}
    full = server.post("/v1/chat/completions", body).json()["choices"][0]["message"]["content"]
    stop = full[10:13]
    cut = full[: full.index(stop)]
    stopped = server.post("/v1/chat/completions", {**body, "stop": [stop, "never-seen"]}).json()
    assert stopped["choices"][0]["message"]["content"] == cut
    assert stopped["choices"][0]["finish_reason"] == "stop"
    _, frames = stream_frames(server, {**body, "stop": stop, "stream": True})
    chunks = [data_of(f) for f in frames[:-1]]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == cut
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_max_tokens_past_the_context_is_clamped_and_a_prompt_that_does_not_fit_is_400(server):
    """As llama-server and Ollama do: Claude Code asks for 32,000 tokens of a model whatever its context."""
    prompt = server.post("/v1/tokenize", {"model": "tiny", "messages": HELLO}).json()["count"]
    response = server.post("/v1/chat/completions", {"model": "tiny", "messages": HELLO, "max_tokens": 32_000,
                                                    "logit_bias": {"2": -100}})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["finish_reason"] == "length"
    assert response.json()["usage"]["completion_tokens"] == 2048 - prompt  # to the end of the context
    anthropic_reply = server.post("/v1/messages", {"model": "tiny", "messages": HELLO, "max_tokens": 32_000})
    assert anthropic_reply.status_code == 200  # not a 400: its stop reason is in tests/test_encoders.py
    long = [{"role": "user", "content": "word " * 3000}]
    response = server.post("/v1/chat/completions", {"model": "tiny", "messages": long})
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "context_length_exceeded"


def test_models_and_health(server):
    models = requests.get(server.url + "/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["tiny"]
    card = requests.get(server.url + "/v1/models/tiny").json()
    assert (card["context_length"], card["max_input_tokens"], card["max_tokens"]) == (2048, 2047, 2047)
    missing = requests.get(server.url + "/v1/models/other")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    live = requests.get(server.url + "/v1/liveness").json()
    assert live["status"] == "ok" and live["pid"] > 0 and live["version"]
    assert requests.get(server.url + "/v1/readiness").json()["status"] == "ready"


def test_metrics_count_outcomes(server):
    server.post("/v1/chat/completions", {"model": "tiny", "messages": HELLO, "max_tokens": 2})
    text = requests.get(server.url + "/metrics").text
    assert 'kronk_requests_total{model="tiny",outcome="ok",route="/v1/chat/completions",status="200"}' in text
    assert "kronk_time_to_first_token_seconds_count" in text
    assert 'kronk_tokens_total{kind="completion",model="tiny"}' in text


def test_inter_token_gaps_reach_the_metrics(server):
    before = metric(server, "kronk_inter_token_latency_seconds_count", model="tiny")
    body = {"model": "tiny", "messages": HELLO, "max_tokens": 6, "seed": 1, "logit_bias": {"2": -100}, "stream": True,
            "stream_options": {"include_usage": True}}
    _, frames = stream_frames(server, body)
    chunks = [data_of(frame) for frame in frames[:-1]]
    assert data_of(frames[-1]) == "[DONE]"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert chunks[-1]["usage"]["completion_tokens"] == 6 and len(text.split()) == 6
    # Six tokens, each with text (whether or not frames merged them): five gaps, written before [DONE] goes out.
    assert metric(server, "kronk_inter_token_latency_seconds_count", model="tiny") - before == 5


def samples(exposition: str) -> dict[str, str]:
    return dict(line.rsplit(" ", 1) for line in exposition.splitlines() if line and not line.startswith("#"))


def test_gap_counter_gives_what_observing_each_gap_gives():
    registry = CollectorRegistry()
    counted = Histogram("counted", "", ["model"], buckets=(0.001, 0.01, 0.1), registry=registry).labels("m")
    observed = Histogram("observed", "", ["model"], buckets=(0.001, 0.01, 0.1), registry=registry).labels("m")
    gaps = GapCounter(counted)
    for gap in (0.0005, 0.001, 0.002, 0.01, 0.05, 0.5, 0.003, 0.003):  # bounds themselves included
        gaps.observe(gap)
        observed.observe(gap)
    assert samples(generate_latest(registry).decode())['counted_count{model="m"}'] == "0.0"  # not flushed yet
    gaps.flush()
    values = samples(generate_latest(registry).decode())
    compared = [name for name in values if name.startswith("observed") and "_created" not in name]
    assert len(compared) == 6  # four buckets, count, sum
    for name in compared:
        assert values[name.replace("observed", "counted", 1)] == values[name], name
