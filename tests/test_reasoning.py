"""A reasoning model's thinking, told apart from its answer in every protocol.

The splitter on its own first; then a server whose model has a thinking chat
template, steered by the scripted engine (a random tiny model never closes a
thinking block): the real engine, sampling forced to the script.
"""

import json

import anthropic
import openai
import pytest

from kronk_wsgi.serving.events import ReasoningDelta, TextDelta
from kronk_wsgi.serving.reasoning import SYNTAXES, ReasoningSplitter, opens_thinking, reasoning_of

from .support.scripted import run_scripted

THINK = SYNTAXES[0]
# ChatML whose generation prompt opens the thinking block, unless thinking is switched off (as Qwen3's does).
OPENS_THINKING = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}"
    "{% endif %}"
)
# ChatML that knows the tags but leaves it to the model to open the block.
WRITES_THINKING = OPENS_THINKING.replace("{% else %}<think>\n{% endif %}", "{% endif %}")
ASK = [{"role": "user", "content": "Capital of France?"}]


def split(pieces, inside=False):
    splitter = ReasoningSplitter(THINK, inside)
    events = [e for piece in pieces for e in splitter.feed(piece)] + splitter.flush()
    thinking = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
    answer = "".join(e.text for e in events if isinstance(e, TextDelta))
    return thinking, answer


@pytest.mark.parametrize("pieces, thinking", [
    (["<think>\nFrance's capital.\n</think>\n\nParis."], "France's capital.\n"),
    (["<", "thi", "nk>", "\n", "France's", " capital.", "\n</", "think", ">", "\n\n", "Par", "is."], "France's capital.\n"),
    (["  <think>France's capital.</think>Paris."], "France's capital."),
])
def test_thinking_at_the_start_is_split_off_whatever_the_pieces(pieces, thinking):
    assert split(pieces) == (thinking, "Paris.")


def test_a_reply_inside_an_open_block_and_tags_later_on():
    assert split(["Hmm.", "</thi", "nk>\n", "Paris."], inside=True) == ("Hmm.", "Paris.")
    # a tag after the answer has begun is answer text; an unclosed block is all thinking
    assert split(["Paris <think>is</think> nice"]) == ("", "Paris <think>is</think> nice")
    assert split(["Hmm, let me", " see </thi"], inside=True) == ("Hmm, let me see </thi", "")
    assert split(["<thi"]) == ("", "<thi")


def test_templates_name_their_tags():
    assert reasoning_of(OPENS_THINKING) == THINK and reasoning_of("{{ messages }}") is None
    assert opens_thinking("<|im_start|>assistant\n<think>\n", THINK)
    assert not opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n", THINK)


@pytest.fixture(scope="module")
def thinker(tiny_model, tmp_path_factory):
    engine = "tests.support.scripted:KIND"
    models = {"opens": {"path": str(tiny_model), "engine": engine, "chat_template": OPENS_THINKING},
              "writes": {"path": str(tiny_model), "engine": engine, "chat_template": WRITES_THINKING}}
    with run_scripted(tmp_path_factory.mktemp("thinker"), models, "opens") as server:
        yield server


def test_chat_gives_reasoning_content_whole_and_streamed(thinker):
    thinker.say("The capital of France is Paris.\n</think>\n\nParis.")
    body = {"model": "opens", "messages": ASK, "max_tokens": 100}
    whole = thinker.post("/v1/chat/completions", body).json()
    message = whole["choices"][0]["message"]
    assert message["reasoning_content"] == "The capital of France is Paris.\n" and message["content"] == "Paris."
    client = openai.OpenAI(base_url=thinker.url + "/v1", api_key="unused")
    chunks = list(client.chat.completions.create(model="opens", messages=ASK, max_tokens=100, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == message["reasoning_content"]
    assert "".join(d.content or "" for d in deltas) == "Paris."


def test_a_model_that_opens_the_block_itself(thinker):
    thinker.say("<think>Easy.</think>\nParis.")
    message = thinker.post("/v1/chat/completions", {"model": "writes", "messages": ASK}).json()["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == ("Easy.", "Paris.")


def test_thinking_switched_off_leaves_only_an_answer(thinker):
    thinker.say("Paris.")
    body = {"model": "opens", "messages": ASK, "reasoning_effort": "none"}
    message = thinker.post("/v1/chat/completions", body).json()["choices"][0]["message"]
    assert message["content"] == "Paris." and "reasoning_content" not in message


def test_reasoning_format_none_leaves_the_thinking_in_the_answer(thinker):
    thinker.say("<think>Easy.</think>\nParis.")
    body = {"model": "writes", "messages": ASK, "reasoning_format": "none"}
    message = thinker.post("/v1/chat/completions", body).json()["choices"][0]["message"]
    assert message["content"] == "<think>Easy.</think>\nParis." and "reasoning_content" not in message
    refused = thinker.post("/v1/chat/completions", {**body, "reasoning_format": "deepseek-legacy"})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "reasoning_format"


def test_anthropic_thinking_blocks(thinker):
    thinker.say("Capital of France.</think>Paris.")
    client = anthropic.Anthropic(base_url=thinker.url, api_key="unused")
    thinking = {"type": "enabled", "budget_tokens": 1024}  # below max_tokens, as Anthropic requires
    message = client.messages.create(model="opens", max_tokens=1500, messages=ASK, thinking=thinking)
    assert [b.type for b in message.content] == ["thinking", "text"]
    assert message.content[0].thinking == "Capital of France." and message.content[0].signature
    assert message.content[1].text == "Paris." and message.stop_reason == "end_turn"
    with client.messages.stream(model="opens", max_tokens=1500, messages=ASK, thinking=thinking) as stream:
        streamed = stream.get_final_message()
    assert [b.type for b in streamed.content] == ["thinking", "text"]
    assert streamed.content[0].thinking == "Capital of France."
    assert streamed.content[0].signature == message.content[0].signature
    # the thinking block handed back in the next turn is accepted
    follow_up = ASK + [{"role": "assistant", "content": [b.model_dump() for b in message.content]},
                       {"role": "user", "content": "And of Italy?"}]
    assert client.messages.create(model="opens", max_tokens=1500, messages=follow_up).content


def test_responses_reasoning_item(thinker):
    thinker.say("Capital of France.</think>Paris.")
    client = openai.OpenAI(base_url=thinker.url + "/v1", api_key="unused")
    response = client.responses.create(model="opens", input="Capital of France?")
    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert response.output[0].content[0].text == "Capital of France." and response.output_text == "Paris."
    events = list(client.responses.create(model="opens", input="Capital of France?", stream=True))
    kinds = [e.type for e in events]
    assert "response.reasoning_text.delta" in kinds and kinds[-1] == "response.completed"
    assert [item.type for item in events[-1].response.output] == ["reasoning", "message"]
    # handed back as input, the reasoning item is accepted
    again = client.responses.create(model="opens", input=[
        {"role": "user", "content": "Capital of France?"}, *[item.model_dump(exclude_none=True) for item in response.output],
        {"role": "user", "content": "Sure?"},
    ])
    assert again.output_text == "Paris."


def test_the_json_format_starts_after_the_thinking(thinker):
    # The grammar would refuse "Let" as the first character of JSON: it applies only after </think>.
    thinker.say('Let me answer in JSON.</think>{"city": "Paris"}')
    body = {"model": "opens", "messages": ASK, "response_format": {"type": "json_object"}}
    message = thinker.post("/v1/chat/completions", body).json()["choices"][0]["message"]
    assert message["reasoning_content"] == "Let me answer in JSON."
    assert json.loads(message["content"]) == {"city": "Paris"}


def test_anthropic_budget_tokens_closes_the_thinking(thinker):
    # The script starts the thinking; then the random model thinks on, and would never close the block.
    thinker.say("Let me think.<<endless>>")
    body = {"model": "opens", "max_tokens": 1400, "messages": ASK,
            "thinking": {"type": "enabled", "budget_tokens": 1024}}
    message = thinker.post("/v1/messages", body).json()
    thinking, text = message["content"][0], message["content"][-1]
    assert thinking["type"] == "thinking" and thinking["thinking"].startswith("Let me think.")
    assert text["type"] == "text" and text["text"]  # the answer came after the forced </think>
    # The thinking took about the budget of the 1400 tokens written (its text, tokenized again, may come out
    # a few tokens apart from the tokens generated: seen 1052 for 1024 once); the answer took the rest.
    counted = thinker.post("/v1/tokenize", {"model": "opens", "text": thinking["thinking"], "add_special": False})
    assert 1000 <= counted.json()["count"] <= 1080 and message["usage"]["output_tokens"] == 1400
    assert "</think>" not in thinking["thinking"] + text["text"]


def test_encrypted_reasoning_goes_back_and_forth_and_a_forged_one_is_a_400(thinker):
    """Codex keeps no state (store false) and sends each reasoning item back with its encrypted_content."""
    thinker.say("Capital of France.\n</think>\n\nParis.")
    client = openai.OpenAI(base_url=thinker.url + "/v1", api_key="unused", max_retries=0)
    first = client.responses.create(model="opens", input="Capital of France?", store=False, max_output_tokens=100,
                                    include=["reasoning.encrypted_content"], reasoning={"effort": "low"})
    reasoning = next(item for item in first.output if item.type == "reasoning")
    assert reasoning.encrypted_content and "Capital of France" not in reasoning.encrypted_content
    thinker.say("Sure.\n</think>\n\nYes.")
    again = [{"role": "user", "content": "Capital of France?"}, reasoning.model_dump(exclude_none=True),
             {"role": "assistant", "content": "Paris."}, {"role": "user", "content": "Sure?"}]
    second = client.responses.create(model="opens", input=again, store=False, max_output_tokens=20)
    assert second.output_text == "Yes."
    forged = {**reasoning.model_dump(exclude_none=True), "encrypted_content": reasoning.encrypted_content[:-8] + "AAAAAAA="}
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model="opens", input=[again[0], forged, *again[2:]], store=False)
    assert caught.value.body["param"] == "input[1].encrypted_content"
