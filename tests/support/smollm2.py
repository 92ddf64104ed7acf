"""What a served SmolLM2-135M-Instruct must answer, whichever engine serves it."""

from openai import OpenAI

SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
QUESTION = {"role": "user", "content": "What is the capital of France?"}
PROMPT_TOKENS = 27  # [SYSTEM, QUESTION] as the reference tokenizer counts it (tests/test_real_model.py)


def assert_answers_paris(url: str, model: str = "smollm2") -> None:
    """The openai client gets Paris in a few tokens, stopped at the end of the turn, streamed as whole."""
    client = OpenAI(base_url=url + "/v1", api_key="unused")
    whole = client.chat.completions.create(model=model, messages=[SYSTEM, QUESTION], temperature=0, max_tokens=40)
    choice = whole.choices[0]
    assert "Paris" in choice.message.content and "<|im_end|>" not in choice.message.content
    assert choice.finish_reason == "stop" and whole.usage.completion_tokens < 15
    assert whole.usage.prompt_tokens == PROMPT_TOKENS
    streamed = client.chat.completions.create(
        model=model, messages=[SYSTEM, QUESTION], temperature=0, max_tokens=40, stream=True,
    )
    chunks = list(streamed)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == choice.message.content
    assert chunks[-1].choices[0].finish_reason == "stop"
