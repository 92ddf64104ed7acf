"""Every streaming protocol keeps the streaming core's promises, over real sockets.

Keep-alives in each protocol's form, disconnects that free the slot,
overload as a 429 in each protocol's error shape, and engine failures
in-band (or a 500 when not streaming). The engine is the real one wrapped
by kronk_wsgi.testing.faulty (delays, failures, no EOS).
"""

import json
import time

import pytest
import requests

from kronk_wsgi.testing.rawhttp import RawStream
from .conftest import faulty_env, metric, run_server

HELLO = [{"role": "user", "content": "Hello there"}]
PROTOCOLS = {
    "chat": ("/v1/chat/completions", lambda n: {"messages": HELLO, "max_tokens": n}),
    "completions": ("/v1/completions", lambda n: {"prompt": "Hello there", "max_tokens": n}),
    "messages": ("/v1/messages", lambda n: {"messages": HELLO, "max_tokens": n}),
    "responses": ("/v1/responses", lambda n: {"input": "Hello there", "max_output_tokens": n}),
}
ALL = list(PROTOCOLS)


def open_stream(server, protocol: str, tokens: int) -> RawStream:
    path, body = PROTOCOLS[protocol]
    return RawStream(server.host, server.port, path, {"model": "tiny", "stream": True, **body(tokens)})


def post(server, protocol: str, tokens: int) -> requests.Response:
    path, body = PROTOCOLS[protocol]
    return requests.post(server.url + path, json={"model": "tiny", **body(tokens)}, timeout=60)


def kind_of(protocol: str, frame: str) -> str:
    """"k" keep-alive, "t" text, "o" anything else."""
    if frame == (': keep-alive' if protocol != "messages" else 'event: ping\ndata: {"type":"ping"}'):
        return "k"
    text_markers = {"chat": '"content":"', "completions": '"text":"', "messages": "event: content_block_delta",
                    "responses": "event: response.output_text.delta"}
    is_text = text_markers[protocol] in frame and '"role":"assistant"' not in frame and '"text":""' not in frame
    return "t" if is_text else "o"


def payload(frame: str) -> dict:
    return json.loads(frame.split("data: ", 1)[1])


@pytest.mark.parametrize("protocol", ALL)
def test_keepalives_between_slow_tokens(slow, protocol):
    raw = open_stream(slow, protocol, 3)
    kinds = [kind_of(protocol, f) for _, f in raw.frames()]
    raw.close()
    assert kinds[0] == "o"  # the commit comes first
    texts = [i for i, k in enumerate(kinds) if k == "t"]
    assert len(texts) == 3
    between = kinds[texts[0] + 1 : texts[1]]
    assert between and set(between) == {"k"}


@pytest.mark.parametrize("protocol", ALL)
def test_disconnect_frees_the_slot_and_overload_is_429_in_shape(slow, protocol):
    raw = open_stream(slow, protocol, 500)  # 150 s of generation unless a disconnect stops it
    for _, frame in raw.frames():
        if kind_of(protocol, frame) == "t":
            break
    busy = post(slow, protocol, 1)  # the one place is taken: wait 1 s, then 429
    assert busy.status_code == 429 and int(busy.headers["Retry-After"]) >= 1
    error = busy.json()
    if protocol == "messages":
        assert error["type"] == "error" and error["error"]["type"] == "rate_limit_error"
    else:
        assert error["error"]["type"] == "rate_limit_error" and error["error"]["code"] == "model_busy"
    raw.close()
    started = time.monotonic()
    assert post(slow, protocol, 1).status_code == 200
    assert time.monotonic() - started < 3.0
    assert metric(slow, "kronk_active_generations", model="tiny") == 0


@pytest.mark.parametrize("protocol", ALL)
def test_engine_failure_is_in_band_in_each_protocol(failing, protocol):
    raw = open_stream(failing, protocol, 50)
    frames = [f for _, f in raw.frames()]
    raw.close()
    assert raw.status == 200
    assert sum(kind_of(protocol, f) == "t" for f in frames) >= 1
    last = frames[-1]
    if protocol == "messages":
        assert last.startswith("event: error\n")
        assert payload(last) == {"type": "error", "error": {
            "type": "api_error", "message": "the model failed while generating; the response is incomplete"}}
    elif protocol == "responses":
        assert last.startswith("event: response.failed\n")
        response = payload(last)["response"]
        assert response["status"] == "failed" and response["error"]["code"] == "server_error"
    else:
        assert payload(last)["error"]["code"] == "engine_error"
    assert "data: [DONE]" not in frames and "injected" not in "".join(frames)


@pytest.mark.parametrize("protocol", ALL)
def test_engine_failure_without_stream_is_500_in_shape(failing, protocol):
    response = post(failing, protocol, 50)
    assert response.status_code == 500
    error = response.json()
    if protocol == "messages":
        assert error["error"]["type"] == "api_error"
    else:
        assert error["error"]["code"] == "engine_error"
    assert "injected" not in response.text


@pytest.fixture(scope="module")
def expiring(tiny_model, tmp_path_factory):
    """0.2 s per token, no EOS, and a 1 s request timeout."""
    env = faulty_env(tiny_model, KRONK_TEST_STEP_DELAY=0.2, KRONK_TEST_NO_EOS=1, KRONK_REQUEST_TIMEOUT=1)
    with run_server(tmp_path_factory.mktemp("expiring"), env) as server:
        yield server


@pytest.mark.parametrize("protocol", ALL)
def test_request_timeout_in_each_protocol(expiring, protocol):
    raw = open_stream(expiring, protocol, 100)
    frames = [f for _, f in raw.frames()]
    raw.close()
    last = frames[-1]
    if protocol == "messages":
        assert payload(last)["error"]["type"] == "timeout_error"
    elif protocol == "responses":
        assert "request timeout" in payload(last)["response"]["error"]["message"]
    else:
        assert payload(last)["error"]["code"] == "timeout"
    response = post(expiring, protocol, 100)
    assert response.status_code == 504
    assert (response.json()["error"]["type"] == "timeout_error") == (protocol == "messages")
