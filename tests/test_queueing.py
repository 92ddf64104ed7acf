"""One queue per model, through real gunicorn: first come first served, caps that refuse at once, background
runs under the same caps and owned by a live worker, and a second model that waits for the first to be free."""

import os
import signal
import threading
import time

import requests

from kronk_wsgi.testing import model_row, wait_until
from kronk_wsgi.testing.rawhttp import RawStream

from .conftest import faulty_env, metric, run_server
from .test_background import poll

CHAT = "/v1/chat/completions"
RESPONSES = "/v1/responses"
HELLO = [{"role": "user", "content": "Hello there"}]


def chat(server, **body) -> requests.Response:
    return server.post(CHAT, {"model": "tiny", "messages": HELLO, "max_tokens": 2, **body}, timeout=120)


def test_requests_on_one_slot_end_in_the_order_they_came(tiny_model, tmp_path):
    env = faulty_env(tiny_model, KRONK_TEST_STEP_DELAY=0.1, KRONK_TEST_NO_EOS=1)  # one slot, two places
    with run_server(tmp_path, env) as server:
        ended: list[tuple[int, int]] = []

        def ask(i: int) -> None:
            ended.append((i, chat(server, max_tokens=3).status_code))

        threads = []
        for i in range(8):
            threads.append(threading.Thread(target=ask, args=(i,)))
            threads[-1].start()
            time.sleep(0.11)
        for thread in threads:
            thread.join(120)
        assert ended == [(i, 200) for i in range(8)]
        assert metric(server, "kronk_requests_waiting", model="tiny") == 0


def test_a_full_line_is_a_429_at_once(tiny_model, tmp_path):
    env = faulty_env(tiny_model, KRONK_TEST_STEP_DELAY=0.2, KRONK_TEST_NO_EOS=1, KRONK_QUEUE_DEPTH=1,
                     KRONK_MAX_WAITING=1, KRONK_KEEPALIVE_INTERVAL=0.2)
    with run_server(tmp_path, env) as server:
        holder = RawStream(server.host, server.port, CHAT, {"model": "tiny", "messages": HELLO, "stream": True,
                                                           "max_tokens": 200})
        next(holder.frames())  # committed: the one place is taken
        waiter = threading.Thread(target=chat, args=(server,))
        waiter.start()
        deadline = time.monotonic() + 30
        while metric(server, "kronk_requests_waiting", model="tiny") < 1:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        started = time.monotonic()
        refused = chat(server)
        assert refused.status_code == 429 and time.monotonic() - started < 5  # not after the admission wait
        assert refused.headers["Retry-After"] and refused.json()["error"]["code"] == "model_busy"
        assert "wait for it already" in refused.json()["error"]["message"]
        rows = requests.get(server.url + "/admin/models", timeout=30).json()["data"]
        assert rows[0]["slot_states"] == ["generating"] and rows[0]["waiting"] == 1
        assert metric(server, "kronk_slots", model="tiny", state="generating") == 1
        holder.close()
        waiter.join(60)


def test_background_runs_are_capped_per_key_and_a_chat_still_gets_its_turn(tiny_model, tmp_path):
    env = faulty_env(tiny_model, KRONK_TEST_STEP_DELAY=0.05, KRONK_TEST_NO_EOS=1, KRONK_MAX_KEY_BACKGROUND=3)
    with run_server(tmp_path, env) as server:
        answers = [server.post(RESPONSES, {"model": "tiny", "input": "Hello", "background": True,
                                           "max_output_tokens": 20}) for _ in range(6)]
        statuses = [answer.status_code for answer in answers]
        assert statuses == [200] * 3 + [429] * 3, statuses
        refused = answers[-1]
        assert refused.json()["error"]["code"] == "rate_limit_exceeded" and refused.headers["Retry-After"]
        started = time.monotonic()
        assert chat(server).status_code == 200  # in line behind the three, not behind a flood
        assert time.monotonic() - started < 60
        for answer in answers[:3]:
            poll(server, answer.json()["id"], lambda r: r["status"] == "incomplete")
        again = server.post(RESPONSES, {"model": "tiny", "input": "Hello", "background": True,
                                        "max_output_tokens": 2})
        assert again.status_code == 200  # the finished ones gave their places back


def test_a_background_run_whose_worker_died_is_failed_and_its_stream_ends(tiny_model, tmp_path):
    env = faulty_env(tiny_model, KRONK_TEST_STEP_DELAY=0.2, KRONK_TEST_NO_EOS=1)
    with run_server(tmp_path, env) as server:
        run = server.post(RESPONSES, {"model": "tiny", "input": "Hello", "background": True,
                                      "max_output_tokens": 1000}).json()
        poll(server, run["id"], lambda r: r["status"] == "in_progress")
        pid = requests.get(server.url + "/v1/liveness", timeout=10).json()["pid"]
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        deadline = killed + 60
        while True:  # the master starts another worker
            try:
                if requests.get(server.url + "/v1/liveness", timeout=10).json()["pid"] != pid:
                    break
            except requests.ConnectionError:
                pass
            assert time.monotonic() < deadline
            time.sleep(0.2)
        failed = poll(server, run["id"], lambda r: r["status"] == "failed")
        assert time.monotonic() - killed < 20
        assert "stopped before it was done" in failed["error"]["message"]
        resumed = requests.get(f"{server.url}{RESPONSES}/{run['id']}?stream=true", timeout=30, stream=True)
        assert resumed.status_code == 200
        ends = time.monotonic() + 30
        for _ in resumed.iter_lines():  # the events kept so far, then its end: not keep-alives for ever
            assert time.monotonic() < ends
        resumed.close()


def test_another_model_right_after_an_answer_waits_for_the_first_instead_of_a_503(tiny_model, tmp_path):
    models = '{"a": {"path": "%s"}, "b": {"path": "%s"}}' % (tiny_model, tiny_model)
    env = {"KRONK_MODELS": models, "KRONK_MAX_LOADED_MODELS": 1, "KRONK_DEFAULT_MODEL": "a"}
    with run_server(tmp_path, env) as server:
        results: list[int] = []

        def ask(model: str) -> None:
            results.append(server.post(CHAT, {"model": model, "messages": HELLO, "max_tokens": 8},
                                       timeout=120).status_code)

        for _ in range(3):
            answered = len(results)
            first = threading.Thread(target=ask, args=("a",))
            first.start()
            wait_until(lambda: model_row(server, "a").get("busy_slots") or len(results) > answered)  # b's requests find a busy
            seconds = [threading.Thread(target=ask, args=("b",)) for _ in range(4)]
            for thread in seconds:
                thread.start()
            for thread in [first, *seconds]:
                thread.join(120)
        assert results == [200] * 15, results
