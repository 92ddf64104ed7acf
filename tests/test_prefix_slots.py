"""A request takes the free slot that holds its conversation, so a later turn evaluates only its new tokens."""

from openai import OpenAI

from .conftest import run_server

ASK = [{"role": "user", "content": "Tell me about the sea"}]


def test_turns_find_their_conversation_in_its_slot(tiny_model, tmp_path):
    env = {"KRONK_MODELS": f"tiny={tiny_model}", "KRONK_PARALLEL": 2, "KRONK_THREADS": 1}
    with run_server(tmp_path, env) as server:
        client = OpenAI(base_url=server.url + "/v1", api_key="unused")
        first = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=12, seed=1)
        other = client.chat.completions.create(model="tiny", max_tokens=12, seed=1,
                                               messages=[{"role": "user", "content": "Something else entirely"}])
        # the other conversation took the slot unused longest, not the one holding the first
        assert other.usage.prompt_tokens_details.cached_tokens == 0
        turn = ASK + [{"role": "assistant", "content": first.choices[0].message.content},
                      {"role": "user", "content": "And the mountains?"}]
        second = client.chat.completions.create(model="tiny", messages=turn, max_tokens=12, seed=1)
        assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens
        assert second.usage.prompt_tokens > first.usage.prompt_tokens + 5
        third = client.chat.completions.create(model="tiny", max_tokens=4, seed=1, messages=[
            {"role": "user", "content": "Something else entirely"}, {"role": "assistant", "content": "Yes."},
            {"role": "user", "content": "More"}])
        assert third.usage.prompt_tokens_details.cached_tokens >= other.usage.prompt_tokens - 1
