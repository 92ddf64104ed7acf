"""Bad input gets a clear error in OpenAI's shape, never a 500."""

import pytest
import requests

from .conftest import run_server

CHAT = "/v1/chat/completions"
OK_MESSAGES = [{"role": "user", "content": "hi"}]


def body(**fields):
    return {"model": "tiny", "messages": OK_MESSAGES, **fields}


JSON_CASES = [
    # (body, status, code, param)
    (body(model="nope"), 404, "model_not_found", "model"),
    (body(model="/etc/passwd"), 404, "model_not_found", "model"),
    ({"messages": OK_MESSAGES}, 400, None, "model"),
    ({"model": "tiny"}, 400, None, "messages"),
    (body(messages=[]), 400, None, "messages"),
    (body(messages=[{"role": "user"}]), 400, None, "messages[0]"),
    (body(messages=[{"role": "wizard", "content": "x"}]), 400, None, "messages[0].role"),
    (body(messages=[{"role": "user", "content": 5}]), 400, None, "messages[0].content"),
    (body(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]), 400, None, "messages[0].content[0].image_url"),
    (body(max_tokens="5"), 400, None, "max_tokens"),
    (body(max_tokens=0), 400, None, "max_tokens"),
    (body(max_tokens=5.5), 400, None, "max_tokens"),
    (body(temperature=3), 400, None, "temperature"),
    (body(temperature="hot"), 400, None, "temperature"),
    (body(top_p=0), 400, None, "top_p"),
    (body(stream="yes"), 400, None, "stream"),
    (body(stop=["a", "b", "c", "d", "e"]), 400, None, "stop"),
    (body(n=17), 400, None, "n"),
    (body(logit_bias={"99999": 1}), 400, None, "logit_bias"),
    (body(stream_options={"include_usage": True}), 400, None, None),
    (body(max_tokens=2, max_completion_tokens=2), 400, None, None),
    (body(frobnicate=True), 400, None, "frobnicate"),
    ([1, 2], 400, None, None),
]


@pytest.mark.parametrize("payload,status,code,param", JSON_CASES)
def test_bad_json_bodies(server, payload, status, code, param):
    response = requests.post(server.url + CHAT, json=payload, timeout=30)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "code", "param"}
    assert error["message"] and "Traceback" not in error["message"]
    assert error["type"] == ("invalid_request_error" if status in (400, 404) else error["type"])
    assert error["code"] == code
    assert error["param"] == param


@pytest.mark.parametrize("data,content_type", [
    (b"{not json", "application/json"),
    (b'{"model": "tiny"', "application/json"),
    (b"model=tiny", "application/x-www-form-urlencoded"),
    (b"", "application/json"),
])
def test_malformed_bodies(server, data, content_type):
    response = requests.post(server.url + CHAT, data=data, headers={"Content-Type": content_type}, timeout=30)
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"


def test_huge_body_is_413(server):
    payload = b'{"model": "tiny", "messages": [{"role": "user", "content": "' + b"x" * (9 * 1024 * 1024) + b'"}]}'
    response = requests.post(server.url + CHAT, data=payload, headers={"Content-Type": "application/json"}, timeout=30)
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "request_too_large"


def test_unknown_route_and_method(server):
    response = requests.get(server.url + "/v1/nothing-here", timeout=10)
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "unknown_url"
    response = requests.get(server.url + CHAT, timeout=10)
    assert response.status_code == 405
    assert response.json()["error"]["code"] == "method_not_allowed"
    assert "POST" in response.headers["Allow"]


@pytest.fixture(scope="module")
def secured(tiny_model, tmp_path_factory):
    env = {"KRONK_MODELS": f"tiny={tiny_model}", "KRONK_API_KEYS": "key-one,key-two"}
    with run_server(tmp_path_factory.mktemp("auth"), env) as server:
        yield server


@pytest.mark.parametrize("headers,status", [
    ({}, 401),
    ({"Authorization": "Bearer wrong"}, 401),
    ({"Authorization": "Basic key-one"}, 401),
    ({"x-api-key": "key-on"}, 401),
    ({"Authorization": "Bearer key-one"}, 200),
    ({"Authorization": "bearer key-two"}, 200),
    ({"x-api-key": "key-two"}, 200),
])
def test_auth(secured, headers, status):
    response = requests.post(secured.url + CHAT, json=body(max_tokens=1), headers=headers, timeout=30)
    assert response.status_code == status
    if status == 401:
        assert response.json()["error"] == {
            "message": "invalid or missing API key", "type": "authentication_error",
            "code": "invalid_api_key", "param": None,
        }


def test_health_stays_open_with_auth(secured):
    assert requests.get(secured.url + "/v1/liveness", timeout=10).status_code == 200
    assert requests.get(secured.url + "/v1/readiness", timeout=10).status_code == 200
    assert requests.get(secured.url + "/v1/models", timeout=10).status_code == 401


def test_auth_on_anthropic_routes(secured):
    messages = {"model": "tiny", "max_tokens": 1, "messages": OK_MESSAGES}
    response = requests.post(secured.url + "/v1/messages", json=messages, timeout=30)
    assert response.status_code == 401
    assert response.json() == {"type": "error", "error": {"type": "authentication_error", "message": "invalid or missing API key"}}
    assert response.headers["request-id"]
    response = requests.post(secured.url + "/v1/messages", json=messages, headers={"x-api-key": "key-one"}, timeout=30)
    assert response.status_code == 200 and response.headers["request-id"] == response.json()["id"]
