"""What real clients send: official fields that change nothing, browsers (CORS), JSON for every 404."""

import pytest
import requests
from openai import OpenAI

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
    for path in ("/", "/nothing", "/v2/chat"):
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


def test_response_format_text_is_taken_and_json_is_refused_by_name(server):
    body = {"model": "tiny", "messages": HI, "max_tokens": 2}
    assert server.post(CHAT, {**body, "response_format": {"type": "text"}}).status_code == 200
    refused = server.post(CHAT, {**body, "response_format": {"type": "json_object"}})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "response_format.type"
