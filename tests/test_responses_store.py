"""Stateful Responses through the openai client: store, retrieve, continue (across a restart), delete, retention."""

import openai
import pytest
from openai import OpenAI

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
