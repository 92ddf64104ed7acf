"""What real clients send: official fields that change nothing, thinking switches, browsers (CORS), JSON 404s."""

import pytest
import requests
from anthropic import Anthropic
from openai import OpenAI

from kronk_wsgi.engine.chat_template import ChatTemplate

from .conftest import run_server

CHAT = "/v1/chat/completions"
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def browser_facing(tiny_model, tmp_path_factory):
    env = {"KRONK_MODELS": f"tiny={tiny_model}", "KRONK_API_KEYS": "key-one",
           "KRONK_CORS_ORIGINS": "https://app.example"}
    with run_server(tmp_path_factory.mktemp("cors"), env) as server:
        yield server


def test_cors_preflight_needs_no_key_and_names_the_origin(browser_facing):
    preflight = requests.options(browser_facing.url + CHAT, timeout=10, headers={
        "Origin": "https://app.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type",
    })
    assert preflight.status_code == 200
    assert preflight.headers["Access-Control-Allow-Origin"] == "https://app.example"
    assert "POST" in preflight.headers["Access-Control-Allow-Methods"]
    assert "authorization" in preflight.headers["Access-Control-Allow-Headers"].lower()
    other = requests.options(browser_facing.url + CHAT, timeout=10, headers={
        "Origin": "https://evil.example", "Access-Control-Request-Method": "POST"})
    assert "Access-Control-Allow-Origin" not in other.headers
    real = requests.post(browser_facing.url + CHAT, json={"model": "tiny", "messages": HI, "max_tokens": 2},
                         headers={"Origin": "https://app.example", "Authorization": "Bearer key-one"}, timeout=30)
    assert real.status_code == 200 and real.headers["Access-Control-Allow-Origin"] == "https://app.example"
    refused = requests.post(browser_facing.url + CHAT, json={"model": "tiny", "messages": HI},
                            headers={"Origin": "https://app.example"}, timeout=30)
    assert refused.status_code == 401  # the key is still needed for the request itself


def test_a_standalone_server_answers_json_for_every_404(server):
    for path in ("/nothing", "/v2/chat"):  # "/" is Ollama's probe (tests/test_ollama.py)
        response = requests.get(server.url + path, timeout=10)
        assert response.status_code == 404 and response.json()["error"]["code"] == "unknown_url"


def test_harmless_official_fields_are_accepted(server):
    client = OpenAI(base_url=server.url + "/v1", api_key="unused")
    reply = client.chat.completions.create(
        model="tiny", messages=HI, max_tokens=2, store=False, metadata={"team": "a"}, service_tier="auto",
        modalities=["text"], prediction={"type": "content", "content": "Hello"}, user="u-1",
    )
    assert reply.choices[0].finish_reason in ("stop", "length")
    for field, value in (("store", True), ("modalities", ["text", "audio"])):
        refused = server.post(CHAT, {"model": "tiny", "messages": HI, field: value})
        assert refused.status_code == 400 and field in refused.json()["error"]["message"]


def test_response_format_text_is_taken(server):
    body = {"model": "tiny", "messages": HI, "max_tokens": 2, "response_format": {"type": "text"}}
    assert server.post(CHAT, body).status_code == 200


def test_thinking_switches_reach_the_template():
    template = ChatTemplate("{% if enable_thinking is defined and not enable_thinking %}/no_think {% endif %}"
                            "{% for m in messages %}{{ m.content }}{% endfor %}")
    hi = [{"role": "user", "content": "hi"}]
    assert template.render(hi, thinking=False).text == "/no_think hi"
    assert template.render(hi, thinking=True).text == template.render(hi).text == "hi"


def test_thinking_is_accepted_and_history_thinking_left_out(server):
    client = Anthropic(base_url=server.url, api_key="unused")
    message = client.messages.create(model="tiny", max_tokens=1500, messages=HI,
                                     thinking={"type": "enabled", "budget_tokens": 1024})
    assert message.stop_reason in ("end_turn", "max_tokens")
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "The user greets me.", "signature": "sig"},
        {"type": "redacted_thinking", "data": "xyz"}, {"type": "text", "text": "Hello!"}]},
        {"role": "user", "content": "how are you?"}]
    plain = [history[0], {"role": "assistant", "content": "Hello!"}, history[2]]
    counted = client.messages.count_tokens(model="tiny", messages=history).input_tokens
    assert counted == client.messages.count_tokens(model="tiny", messages=plain).input_tokens
    too_big = server.post("/v1/messages", {"model": "tiny", "max_tokens": 1024, "messages": HI,
                                           "thinking": {"type": "enabled", "budget_tokens": 1024}})
    assert too_big.status_code == 400 and "budget_tokens" in too_big.json()["error"]["message"]
    openai_client = OpenAI(base_url=server.url + "/v1", api_key="unused")
    reply = openai_client.chat.completions.create(model="tiny", messages=HI, max_tokens=2, reasoning_effort="low")
    assert reply.choices[0].finish_reason in ("stop", "length")
