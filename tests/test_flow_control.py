"""Keep-alives, disconnects, overload and in-band errors, over real sockets.

These need slow or failing engine steps, so the servers here run the real
engine wrapped by kronk_wsgi.testing.faulty (delays and failures injected).
"""

import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import requests

from .conftest import faulty_env, metric, run_server
from kronk_wsgi.testing.rawhttp import RawStream, data_of

HELLO = [{"role": "user", "content": "Hello there"}]
CHAT = "/v1/chat/completions"


def until(condition, seconds=60.0):
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def stream(server, body):
    return RawStream(server.host, server.port, CHAT, {"model": "tiny", "messages": HELLO, "stream": True, **body})


@pytest.fixture(scope="module")
def slow_steps(tiny_model, tmp_path_factory):
    """Each decode step takes 0.4 s; keep-alive every 0.15 s; parallel 1."""
    env = faulty_env(tiny_model, KRONK_TEST_STEP_DELAY=0.4, KRONK_KEEPALIVE_INTERVAL=0.15)
    with run_server(tmp_path_factory.mktemp("slow"), env) as server:
        yield server


def test_keepalive_comments_between_slow_tokens(slow_steps):
    raw = stream(slow_steps, {"max_tokens": 3, "logit_bias": {"2": -100}})
    frames = [f for _, f in raw.frames()]
    raw.close()
    assert frames[-1] == "data: [DONE]"
    kinds = ["k" if f == ": keep-alive" else "d" for f in frames]
    assert kinds[0] == "d"  # the role chunk: the commit comes first
    # 0.4 s steps, 0.15 s interval: at least one keep-alive between two text chunks.
    text_positions = [i for i, f in enumerate(frames) if f.startswith("data: {") and '"content":"' in f and '"role"' not in f]
    assert len(text_positions) == 3
    between = kinds[text_positions[0] + 1 : text_positions[1]]
    assert "k" in between and set(between) == {"k"}


def test_disconnect_mid_stream_frees_the_slot(slow_steps):
    raw = stream(slow_steps, {"max_tokens": 500, "logit_bias": {"2": -100}})
    frames = raw.frames()
    next(frames)  # role chunk
    for _, frame in frames:
        if '"content":"' in frame:
            break
    raw.close()  # 500 x 0.4 s of generation left: only a stop frees the slot
    started = time.monotonic()
    response = slow_steps.post(CHAT, {"model": "tiny", "messages": HELLO, "max_tokens": 1})
    waited = time.monotonic() - started
    assert response.status_code == 200
    assert waited < 3.0, f"the next request waited {waited:.1f} s for the slot"
    until(lambda: '"outcome": "client_gone"' in slow_steps.logs())
    assert metric(slow_steps, "kronk_active_generations", model="tiny") == 0


def test_a_client_gone_while_its_conversation_is_compacted_frees_the_slot(slow_steps):
    body = {"model": "tiny", "input": "Hello there " * 10, "stream": True, "max_output_tokens": 500,
            "context_management": [{"type": "compaction", "compact_threshold": 5}]}
    raw = RawStream(slow_steps.host, slow_steps.port, "/v1/responses", body)
    frames = raw.frames()
    seen = []
    for _, frame in frames:  # the summary is written at 0.4 s a token: keep-alives go out meanwhile
        seen.append(frame)
        if frame == ": keep-alive" and any("response.compaction.compacting" in f for f in seen):
            break
    raw.close()
    started = time.monotonic()
    response = slow_steps.post(CHAT, {"model": "tiny", "messages": HELLO, "max_tokens": 1})
    assert response.status_code == 200
    assert time.monotonic() - started < 3.0  # the summary's generation stopped: the slot was free
    until(lambda: '"outcome": "client_gone"' in slow_steps.logs())
    assert metric(slow_steps, "kronk_active_generations", model="tiny") == 0


@pytest.fixture(scope="module")
def slow_prefill(tiny_model, tmp_path_factory):
    """Each 8-token prefill chunk takes 0.3 s: a ~60-token prompt is a silent ~2.4 s."""
    env = faulty_env(tiny_model, KRONK_TEST_PREFILL_DELAY=0.3, KRONK_KEEPALIVE_INTERVAL=0.2)
    with run_server(tmp_path_factory.mktemp("prefill"), env) as server:
        yield server


def test_keepalive_and_commit_during_prefill(slow_prefill):
    raw = stream(slow_prefill, {"max_tokens": 1, "messages": [{"role": "user", "content": "a new prompt " * 3}]})
    arrivals = list(raw.frames())
    raw.close()
    first_at, first = arrivals[0]
    assert '"role":"assistant"' in first
    content_at = next(t for t, f in arrivals[1:] if f.startswith("data: "))
    assert content_at - first_at > 1.0  # the role chunk went out long before prefill ended
    assert any(f == ": keep-alive" for _, f in arrivals)


def test_disconnect_mid_prefill_frees_the_slot(slow_prefill):
    raw = stream(slow_prefill, {"max_tokens": 1, "messages": [{"role": "user", "content": "long prompt " * 200}]})
    frames = raw.frames()
    next(frames)  # role chunk; prefill of ~2,500 tokens at 8 per 0.3 s would take ~90 s
    raw.close()
    until(lambda: '"outcome": "client_gone"' in slow_prefill.logs())  # the socket watch notices
    started = time.monotonic()
    response = slow_prefill.post(CHAT, {"model": "tiny", "messages": HELLO, "max_tokens": 1})
    assert response.status_code == 200
    assert time.monotonic() - started < 6.0  # its own ~60-token prefill is ~2.4 s
    assert '"outcome": "client_gone"' in slow_prefill.logs()


@pytest.fixture(scope="module")
def tight(tiny_model, tmp_path_factory):
    """Parallel 1, one place, 1 s admission timeout, 0.1 s per token."""
    env = faulty_env(tiny_model, KRONK_TEST_STEP_DELAY=0.1, KRONK_QUEUE_DEPTH=1, KRONK_ADMISSION_TIMEOUT=1)
    with run_server(tmp_path_factory.mktemp("tight"), env) as server:
        yield server


def test_overload_gives_exactly_the_extra_requests_429(tight):
    body = {"model": "tiny", "messages": HELLO, "logit_bias": {"2": -100}}
    rejected = metric(tight, "kronk_rejected_total", model="tiny")
    holder = stream(tight, {**body, "max_tokens": 200})  # 20 s of tokens: it holds the one place throughout
    next(holder.frames())  # committed: admitted, its place taken
    with ThreadPoolExecutor(3) as pool:
        responses = list(pool.map(lambda _: requests.post(tight.url + CHAT, json={**body, "max_tokens": 1}, timeout=60),
                                  range(3)))
    holder.close()
    assert [r.status_code for r in responses] == [429, 429, 429]
    for response in responses:
        assert int(response.headers["Retry-After"]) >= 1
        assert response.json()["error"]["type"] == "rate_limit_error"
    assert metric(tight, "kronk_rejected_total", model="tiny") - rejected == 3
    # Nothing leaked: once the hang-up is noticed, the place and the slot are free again.
    deadline = time.monotonic() + 30
    while (reply := tight.post(CHAT, {**body, "max_tokens": 1})).status_code == 429:
        assert time.monotonic() < deadline
    assert reply.status_code == 200


def test_admission_wait_ends_when_a_place_frees(tight):
    body = {"model": "tiny", "messages": HELLO, "logit_bias": {"2": -100}}
    holder = stream(tight, {**body, "max_tokens": 5})  # 0.5 s of tokens < the 1 s admission wait
    frames = holder.frames()
    next(frames)  # committed: it holds the one place
    second = requests.post(tight.url + CHAT, json={**body, "max_tokens": 1}, timeout=60)
    assert second.status_code == 200, second.text
    assert [frame for _, frame in frames][-1] == "data: [DONE]"


def test_engine_failure_is_an_in_band_error(failing):
    raw = stream(failing, {"max_tokens": 50, "logit_bias": {"2": -100}})
    frames = [f for _, f in raw.frames()]
    raw.close()
    assert raw.status == 200
    assert "data: [DONE]" not in frames
    error = data_of(frames[-1])["error"]
    assert error["code"] == "engine_error" and error["type"] == "server_error"
    assert "injected" not in error["message"]  # no internals
    assert sum('"content":"' in f for f in frames) >= 2
    logs = failing.logs()
    assert '"outcome": "error"' in logs and "injected engine failure" in logs


def test_engine_failure_without_stream_is_500(failing):
    response = failing.post(CHAT, {"model": "tiny", "messages": HELLO, "max_tokens": 50, "logit_bias": {"2": -100}})
    assert response.status_code == 500
    assert response.json()["error"]["code"] == "engine_error"


def test_openai_client_sees_in_band_error(failing):
    client = openai.OpenAI(base_url=failing.url + "/v1", api_key="unused", max_retries=0)
    chunks = client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=50, stream=True, logit_bias={"2": -100})
    with pytest.raises(openai.APIError):
        for _ in chunks:
            pass
    # The slot is free after the failure.
    assert failing.post(CHAT, {"model": "tiny", "messages": HELLO, "max_tokens": 2}).status_code == 200
