"""Background responses through real gunicorn: answered after the POST returns, polled with GET, cancelled (by
any worker sharing the store), streamed to a client that may leave, and stored as cut when the server stops."""

import json
import time
from typing import Iterator

import openai
import pytest
import requests

from kronk_wsgi.testing.rawhttp import RawStream

from .conftest import faulty_env, metric, run_server

RESPONSES = "/v1/responses"


def poll(server, response_id: str, until, deadline: float = 60) -> dict:
    """GET the response until ``until(response)`` holds."""
    end = time.monotonic() + deadline
    while True:
        response = requests.get(f"{server.url}{RESPONSES}/{response_id}", timeout=30).json()
        if until(response):
            return response
        assert time.monotonic() < end, response
        time.sleep(0.1)


def ended(server, response_id: str) -> list[dict]:
    lines = [json.loads(line) for line in server.logs().splitlines() if line.startswith("{")]
    return [line for line in lines if line.get("event") == "background response ended"
            and line.get("response_id") == response_id]


@pytest.fixture(scope="module")
def two_servers(tiny_model, tmp_path_factory):
    """Two servers sharing one response store, each 0.2 s per token, no EOS, one slot and one place."""
    home = tmp_path_factory.mktemp("background")
    env = faulty_env(tiny_model, KRONK_TEST_STEP_DELAY=0.2, KRONK_TEST_NO_EOS=1, KRONK_QUEUE_DEPTH=1,
                     KRONK_ADMISSION_TIMEOUT=30)
    with run_server(home, env) as one, run_server(home, env) as other:
        yield one, other


def test_a_background_response_is_polled_until_it_is_done(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    queued = client.responses.create(model="tiny", input="Hello", background=True, max_output_tokens=12)
    assert queued.status == "queued" and queued.background and queued.output == []
    done = poll(server, queued.id, lambda r: r["status"] not in ("queued", "in_progress"))
    assert done["status"] in ("completed", "incomplete") and done["usage"]["output_tokens"] > 0
    assert done["output"][0]["content"][0]["text"]
    later = client.responses.create(model="tiny", input="And then?", previous_response_id=queued.id,
                                    max_output_tokens=4)
    assert later.usage.input_tokens > done["usage"]["input_tokens"]  # the background answer is its history
    deadline = time.monotonic() + 30
    while not ended(server, queued.id):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert ended(server, queued.id)[0]["status"] == done["status"]


def test_a_cancel_stops_it_before_the_next_token_and_frees_its_place(two_servers):
    one, other = two_servers
    client = openai.OpenAI(base_url=one.url + "/v1", api_key="unused", max_retries=0)
    started = client.responses.create(model="tiny", input="Hello", background=True, max_output_tokens=500)
    poll(one, started.id, lambda r: r["status"] == "in_progress")
    waiting = client.responses.create(model="tiny", input="Next", background=True, max_output_tokens=3)
    assert poll(one, waiting.id, lambda r: True)["status"] == "queued"  # one place: it waits for it
    previous = requests.post(one.url + RESPONSES, timeout=30, json={
        "model": "tiny", "input": "More", "previous_response_id": started.id})
    assert previous.status_code == 400 and previous.json()["error"]["param"] == "previous_response_id"
    cancelled = requests.post(f"{other.url}{RESPONSES}/{started.id}/cancel", timeout=30)  # another server's
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
    # The worker running it sees the cancel in the shared store, stops, and the next one gets the place.
    assert poll(one, waiting.id, lambda r: r["status"] == "incomplete")["usage"]["output_tokens"] == 3
    final = poll(one, started.id, lambda r: r["status"] == "cancelled" and ended(one, started.id))
    assert final["output"] == [] or final["output"][0]["status"] == "in_progress"
    assert ended(one, started.id)[0]["status"] == "cancelled"
    assert ended(one, started.id)[0]["completion_tokens"] < 100
    assert metric(one, "kronk_background_responses_total", model="tiny", status="cancelled") == 1
    again = requests.post(f"{one.url}{RESPONSES}/{started.id}/cancel", timeout=30)
    assert again.json()["status"] == "cancelled"  # cancelling twice is no error


def test_cancel_is_for_background_responses_of_ones_own(two_servers):
    one, _ = two_servers
    plain = requests.post(one.url + RESPONSES, json={"model": "tiny", "input": "Hi", "max_output_tokens": 2},
                          timeout=30).json()
    refused = requests.post(f"{one.url}{RESPONSES}/{plain['id']}/cancel", timeout=30)
    assert refused.status_code == 400 and "background" in refused.json()["error"]["message"]
    unknown = requests.post(f"{one.url}{RESPONSES}/resp_nothing/cancel", timeout=30)
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "response_not_found"


def events(frames) -> Iterator[dict]:
    return (json.loads(frame.partition("data: ")[2]) for _, frame in frames if "data: " in frame)


def test_a_background_stream_goes_on_when_its_client_leaves_and_is_resumed_anywhere(two_servers):
    one, other = two_servers
    raw = RawStream(one.host, one.port, RESPONSES, {"model": "tiny", "input": "Hello", "background": True,
                                                     "stream": True, "max_output_tokens": 12})
    assert raw.status == 200
    seen = []
    for event in events(raw.frames()):
        seen.append(event)
        if event["type"] == "response.output_text.delta":
            break
    raw.sock.close()  # the client leaves after the first token
    response_id = seen[0]["response"]["id"]
    assert poll(one, response_id, lambda r: True)["status"] == "in_progress"  # it goes on
    # Resumed on the other server (the store is shared), after the last event the client saw, while it runs.
    after = seen[-1]["sequence_number"]
    resumed = requests.get(f"{other.url}{RESPONSES}/{response_id}", params={"stream": "true", "starting_after": after},
                           stream=True, timeout=60)
    assert resumed.status_code == 200 and resumed.headers["Content-Type"].startswith("text/event-stream")
    rest = [json.loads(line[len("data: "):]) for line in resumed.iter_lines(decode_unicode=True)
            if line.startswith("data: ")]
    assert [e["sequence_number"] for e in rest] == list(range(after + 1, after + 1 + len(rest)))
    assert rest[-1]["type"] == "response.incomplete"
    text = "".join(e["delta"] for e in seen + rest if e["type"] == "response.output_text.delta")
    final = requests.get(f"{one.url}{RESPONSES}/{response_id}", timeout=30).json()
    assert final["usage"]["output_tokens"] == 12 and final["output"][0]["content"][0]["text"] == text
    whole = requests.get(f"{one.url}{RESPONSES}/{response_id}?stream=true", timeout=60).text  # from the start
    assert whole.count("response.output_text.delta") // 2 == len([e for e in seen + rest if "delta" in e])
    bad = requests.get(f"{one.url}{RESPONSES}/{response_id}?stream=true&starting_after=x", timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "starting_after"
    plain = requests.post(one.url + RESPONSES, json={"model": "tiny", "input": "Hi", "max_output_tokens": 2},
                          timeout=30).json()
    again = requests.get(f"{one.url}{RESPONSES}/{plain['id']}?stream=true", timeout=30)
    assert again.status_code == 400 and again.json()["error"]["param"] == "stream"


def test_a_stopping_server_stores_what_it_cuts(tiny_model, tmp_path):
    env = faulty_env(tiny_model, KRONK_TEST_STEP_DELAY=0.2, KRONK_TEST_NO_EOS=1, KRONK_DRAIN_TIMEOUT=1)
    with run_server(tmp_path, env) as server:
        started = requests.post(server.url + RESPONSES, timeout=30, json={
            "model": "tiny", "input": "Hello", "background": True, "max_output_tokens": 500}).json()
        poll(server, started["id"], lambda r: r["status"] == "in_progress")
        assert server.stop(graceful=True, timeout=60) == 0
        assert ended(server, started["id"])[0]["status"] == "failed"
    with run_server(tmp_path, env) as server:  # the same store
        final = requests.get(f"{server.url}{RESPONSES}/{started['id']}", timeout=30).json()
        assert final["status"] == "failed" and "shutting down" in final["error"]["message"]
