"""Stateful Responses through the openai client: store, retrieve, continue (across a restart), delete, retention;
whose they are, who may read the file, its limits, and a store that is slow or broken."""

import sqlite3
import time

import openai
import pytest
from openai import OpenAI

from kronk_wsgi.api.response_store import ResponseStore

from .conftest import run_server

FIRST = "Remember the word apple."
SECOND = "Which word did I ask you to remember?"


@pytest.fixture
def start(tiny_model, tmp_path):
    """Start servers that share one stored-responses file."""
    def start(**env):
        settings = {"KRONK_MODELS": f"tiny={tiny_model}", "KRONK_RESPONSES_DB": str(tmp_path / "responses.db"), **env}
        return run_server(tmp_path, settings)

    return start


def client_of(server) -> OpenAI:
    return OpenAI(base_url=server.url + "/v1", api_key="unused")


def test_store_retrieve_continue_after_a_restart_and_delete(start):
    with start() as server:
        client = client_of(server)
        first = client.responses.create(model="tiny", input=FIRST, instructions="Be brief.", max_output_tokens=8)
        assert first.store is True  # OpenAI's default
        kept = client.responses.retrieve(first.id)
        assert kept.id == first.id and kept.output_text == first.output_text
        # The same conversation sent whole, statelessly: the prompt the continuation must make.
        whole = client.responses.create(model="tiny", store=False, max_output_tokens=1, input=[
            {"role": "user", "content": FIRST}, {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": SECOND},
        ])
    with start() as server:  # a new server process, the same file
        client = client_of(server)
        second = client.responses.create(model="tiny", input=SECOND, previous_response_id=first.id,
                                         max_output_tokens=1)
        assert second.previous_response_id == first.id
        assert second.usage.input_tokens == whole.usage.input_tokens  # the earlier turn is in the prompt
        third = client.responses.create(model="tiny", input="And now?", previous_response_id=second.id,
                                        max_output_tokens=1)
        assert third.usage.input_tokens > second.usage.input_tokens  # a chain of turns
        assert client.responses.delete(first.id) is None
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(first.id)
        with pytest.raises(openai.NotFoundError):
            client.responses.create(model="tiny", input="more", previous_response_id=first.id)


def test_nothing_is_kept_with_store_false(start):
    with start() as server:
        client = client_of(server)
        response = client.responses.create(model="tiny", input=FIRST, store=False, max_output_tokens=2)
        assert response.store is False
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(response.id)


def test_streamed_responses_are_kept_before_they_complete(start):
    with start() as server:
        client = client_of(server)
        final = None
        with client.responses.stream(model="tiny", input=FIRST, max_output_tokens=4) as stream:
            for event in stream:
                if event.type in ("response.completed", "response.incomplete"):
                    final = event.response  # already kept when the client hears of it:
                    assert client.responses.retrieve(final.id).status == final.status
        assert client.responses.retrieve(final.id).output_text == final.output_text


def test_only_the_newest_are_kept(start):
    with start(KRONK_RESPONSES_KEEP="2") as server:
        client = client_of(server)
        ids = [client.responses.create(model="tiny", input=f"turn {i}", max_output_tokens=2).id for i in range(3)]
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(ids[0])
        assert [client.responses.retrieve(i).id for i in ids[1:]] == ids[1:]


def test_each_key_sees_only_its_own_responses(start):
    with start(KRONK_API_KEYS="key-a,key-b") as server:
        a = OpenAI(base_url=server.url + "/v1", api_key="key-a", max_retries=0)
        b = OpenAI(base_url=server.url + "/v1", api_key="key-b", max_retries=0)
        mine = a.responses.create(model="tiny", input=FIRST, max_output_tokens=2)
        with pytest.raises(openai.NotFoundError):
            b.responses.retrieve(mine.id)
        with pytest.raises(openai.NotFoundError):
            b.responses.create(model="tiny", input=SECOND, previous_response_id=mine.id, max_output_tokens=1)
        with pytest.raises(openai.NotFoundError):
            b.responses.delete(mine.id)
        assert a.responses.retrieve(mine.id).id == mine.id  # still there, still the owner's
        assert "key-a" not in (server.log.parent / "responses.db").read_bytes().decode("latin-1")


def test_the_store_is_readable_by_its_owner_only(start, tmp_path):
    db = tmp_path / "private" / "responses.db"
    with start(KRONK_RESPONSES_DB=str(db)) as server:
        client_of(server).responses.create(model="tiny", input=FIRST, max_output_tokens=2)
        files = [db, db.with_name(db.name + "-wal"), db.with_name(db.name + "-shm")]
        assert {f.name: f.stat().st_mode & 0o777 for f in files if f.exists()} == {f.name: 0o600 for f in files}
        assert db.parent.stat().st_mode & 0o777 == 0o700


@pytest.mark.parametrize("body, param", [
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ({"metadata": {"k" * 65: "v"}}, "metadata"),
    ({"metadata": {"k": "v" * 513}}, "metadata.k"),
    ({"user": "u" * 513}, "user"),
])
def test_metadata_and_user_keep_openais_limits(start, body, param):
    with start() as server:
        reply = server.post("/v1/responses", {"model": "tiny", "input": FIRST, "max_output_tokens": 1, **body})
        assert reply.status_code == 400 and reply.json()["error"]["param"].startswith(param)
        chat = server.post("/v1/chat/completions",
                           {"model": "tiny", "messages": [{"role": "user", "content": FIRST}], "max_tokens": 1, **body})
        assert chat.status_code == 400


def test_a_locked_store_holds_up_neither_chats_nor_the_end_of_a_response(start, tmp_path):
    """Another process holds the file's write lock: chats are served at once, a response ends when its write
    has waited STORE_WAIT_SECONDS, and is kept once the lock is gone."""
    with start() as server:
        client = client_of(server)
        client.responses.create(model="tiny", input=FIRST, max_output_tokens=1)  # the file exists
        locker = sqlite3.connect(tmp_path / "responses.db", timeout=1)
        locker.execute("BEGIN IMMEDIATE")
        try:
            started = time.monotonic()
            chat = server.post("/v1/chat/completions",
                               {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
            chat_seconds = time.monotonic() - started
            response = client.responses.create(model="tiny", input=SECOND, max_output_tokens=2)
        finally:
            locker.rollback()
            locker.close()
        assert chat.status_code == 200 and chat_seconds < 5  # it waited 42-44 s behind the store's lock
        assert response.status in ("completed", "incomplete")
        deadline = time.monotonic() + 30
        while True:  # the write goes on after the response, and lands once the lock is gone
            try:
                assert client.responses.retrieve(response.id).id == response.id
                break
            except openai.NotFoundError:
                assert time.monotonic() < deadline
                time.sleep(0.2)


def test_a_response_that_cannot_be_stored_says_so(start, tmp_path):
    (tmp_path / "not-a-directory").write_text("")
    with start(KRONK_RESPONSES_DB=str(tmp_path / "not-a-directory" / "responses.db")) as server:
        client = client_of(server)
        with client.responses.stream(model="tiny", input=FIRST, max_output_tokens=2) as stream:
            events = [event for event in stream]
        assert events[-1].type == "response.failed" and events[-1].response.error.code == "store_failed"
        whole = server.post("/v1/responses", {"model": "tiny", "input": FIRST, "max_output_tokens": 2})
        assert whole.status_code == 500 and whole.json()["error"]["code"] == "store_failed"
        assert client.responses.create(model="tiny", input=FIRST, max_output_tokens=2, store=False).status != "failed"


def test_the_store_keeps_its_byte_budget_and_a_chain_grows_by_its_turns(tmp_path):
    store = ResponseStore(tmp_path / "r.db", most=1000, max_bytes=20_000)
    previous = None
    for turn in range(40):
        response = {"id": f"resp_{turn}", "output": [], "padding": "x" * 900}
        store.put(response, "owner", previous, [{"role": "user", "content": f"turn {turn}"}])
        previous = response["id"]
    db = sqlite3.connect(tmp_path / "r.db")
    total, count, smallest, largest = db.execute(
        "SELECT SUM(size), COUNT(*), MIN(size), MAX(size) FROM stored_responses").fetchone()
    assert total <= 20_000 and count < 40
    assert largest - smallest < 10  # each turn stores its own messages, not the whole conversation again
    assert store.get("resp_39", "owner")["id"] == "resp_39"
    assert store.conversation("resp_39", "owner") is None  # its first turns are gone: it cannot be continued
    assert store.get("resp_39", "someone else") is None


def test_a_chain_is_continued_whole(tmp_path):
    store = ResponseStore(tmp_path / "r.db", most=1000, max_bytes=10**9)
    store.put({"id": "resp_1"}, "o", None, [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}])
    store.put({"id": "resp_2"}, "o", "resp_1", [{"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}])
    assert [m["content"] for m in store.conversation("resp_2", "o")] == ["a", "b", "c", "d"]
    assert store.delete("resp_2", "other") is False and store.delete("resp_2", "o") is True


def test_background_events_count_in_the_byte_budget_and_go_with_their_response(tmp_path):
    store = ResponseStore(tmp_path / "r.db", most=1000, max_bytes=30_000)
    for turn in range(10):
        response_id = f"resp_{turn}"
        store.put({"id": response_id, "status": "completed"}, "owner", None, [])
        store.add_events(response_id, [(sequence, "x" * 500) for sequence in range(10)])  # 5,000 bytes each
    store.put({"id": "resp_last", "status": "completed"}, "owner", None, [])  # the budget is looked at here
    db = sqlite3.connect(tmp_path / "r.db")
    responses = db.execute("SELECT SUM(size) FROM stored_responses").fetchone()[0]
    events = db.execute("SELECT SUM(length(frame)) FROM background_events").fetchone()[0]
    assert responses + events <= 30_000 and store.get("resp_0", "owner") is None
    assert len(store.events("resp_9", "owner", -1)) == 10  # the newest keep theirs
    assert db.execute("SELECT COUNT(*) FROM background_events WHERE id = 'resp_0'").fetchone()[0] == 0
    assert store.delete("resp_9", "owner") and store.events("resp_9", "owner", -1) == []
    kept = db.execute("SELECT SUM(bytes) FROM background_event_bytes").fetchone()[0]
    assert kept == db.execute("SELECT SUM(length(frame)) FROM background_events").fetchone()[0]
