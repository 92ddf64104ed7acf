"""Hardening, round three: what one API key sent never speeds up, or shows in the usage of, another key's request."""

import os

import pytest
from anthropic import Anthropic
from openai import OpenAI

from kronk_wsgi.engine import llamacpp_engine

from .conftest import run_server

needs_llamacpp = pytest.mark.skipif(not llamacpp_engine.available() and not os.environ.get("KRONK_TEST_REQUIRE_LLAMACPP"),
                                    reason="llama-cpp-python is not installed")

MEMO = [{"role": "user", "content": "Internal memo. The door code is 4417-2291. " * 30 + "Summarize the memo."}]


def cached(server, key: str) -> tuple[int, int]:
    """The memo's prompt tokens and cached tokens, asked with ``key`` through the OpenAI API."""
    client = OpenAI(base_url=server.url + "/v1", api_key=key)
    reply = client.chat.completions.create(model="smol", messages=MEMO, max_tokens=1, temperature=0)
    return reply.usage.prompt_tokens, reply.usage.prompt_tokens_details.cached_tokens


@needs_llamacpp
@pytest.mark.parametrize("scope", ["key", "shared"])
def test_the_prompt_cache_is_each_keys_own_unless_shared(smollm2, tmp_path, scope):
    models = '{"smol": {"path": "%s", "engine": "llama.cpp", "context_length": 2048}}' % smollm2
    env = {"KRONK_MODELS": models, "KRONK_PARALLEL": 2, "KRONK_API_KEYS": "key-a,key-b,key-c",
           "KRONK_PROMPT_CACHE_DIR": str(tmp_path / "prompt-cache"), "KRONK_PROMPT_CACHE_SCOPE": scope}
    with run_server(tmp_path, env) as server:
        prompt, _ = cached(server, "key-a")
        assert prompt > 300
        _, guessed = cached(server, "key-b")  # the same prompt from other keys: in the slot, in RAM, on disk
        anthropic = Anthropic(base_url=server.url, api_key="key-c").messages.create(
            model="smol", max_tokens=1, messages=MEMO)
        _, again = cached(server, "key-a")
        if scope == "key":
            assert guessed == 0 and anthropic.usage.cache_read_input_tokens == 0
        else:
            assert guessed >= 0.9 * prompt and anthropic.usage.cache_read_input_tokens >= 0.9 * prompt
        assert again >= 0.9 * prompt  # a key's own prefix stays its to reuse
