"""Bodies with fields swapped for odd values never get a 500: a 400 (or 404) in the route's shape, or a 200."""

import random

import pytest
import requests

HELLO = [{"role": "user", "content": "Hi"}]
VALID = {
    "/v1/chat/completions": {"model": "tiny", "messages": HELLO, "max_tokens": 2, "stop": ["x"],
                             "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]},
    "/v1/completions": {"model": "tiny", "prompt": "Hi", "max_tokens": 2, "logit_bias": {"5": 1}},
    "/v1/messages": {"model": "tiny", "max_tokens": 2, "system": [{"type": "text", "text": "s"}],
                     "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
                     "tools": [{"name": "f", "input_schema": {}}], "tool_choice": {"type": "auto"}},
    "/v1/messages/count_tokens": {"model": "tiny", "messages": HELLO},
    "/v1/responses": {"model": "tiny", "input": [{"role": "user", "content": "Hi"}], "max_output_tokens": 2,
                      "tools": [{"type": "function", "name": "f", "parameters": {}, "strict": False}]},
    "/v1/embeddings": {"model": "tiny", "input": ["a", "b"]},
    "/v1/tokenize": {"model": "tiny", "messages": HELLO},
    "/v1/detokenize": {"model": "tiny", "tokens": [1, 2]},
}
ODD = [None, 0, -1, 2**70, 1.5, float("1e308"), "", "x" * 300, "\u0000\ud7ff", True, [], [None], {}, {"type": "x"}, [1, "a"]]


def paths(value, prefix=()):
    """Every place in a JSON value, as a path of keys and indexes."""
    yield prefix
    if isinstance(value, dict):
        for key, item in value.items():
            yield from paths(item, prefix + (key,))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from paths(item, prefix + (index,))


def replaced(value, path, new):
    if not path:
        return new
    copy = dict(value) if isinstance(value, dict) else list(value)
    copy[path[0]] = replaced(value[path[0]], path[1:], new)
    return copy


def cases():
    rng = random.Random(7)
    for route, body in VALID.items():
        places = [p for p in paths(body) if p]
        for _ in range(12):
            place = rng.choice(places)
            yield pytest.param(route, replaced(body, place, rng.choice(ODD)), id=f"{route}:{'.'.join(map(str, place))}")


@pytest.mark.parametrize("route,body", list(cases()))
def test_odd_values_are_never_a_500(server, route, body):
    response = requests.post(server.url + route, json=body, timeout=60)
    assert response.status_code in (200, 400, 404), response.text
    if response.status_code != 200:
        error = response.json()
        message = error["error"]["message"]
        assert message and "Traceback" not in message
        if route.startswith("/v1/messages"):
            assert error["type"] == "error" and error["error"]["type"] in ("invalid_request_error", "not_found_error")
        else:
            assert error["error"]["type"] == "invalid_request_error"
