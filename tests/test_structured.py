"""Structured outputs by constrained decoding, log probabilities, n choices and several prompts.

Through real servers and the official openai client: the tiny random model
(whatever it would write, the grammar keeps it valid) and the real SmolLM2.
"""

import json
import math

import jsonschema
import openai
import pytest

from .conftest import run_server

HI = [{"role": "user", "content": "hi"}]
# Short, closed answers: booleans and enums leave a random model nothing long to write.
VERDICT = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]}},
    "required": ["ok", "color"], "additionalProperties": False,
}
WEATHER = {"type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}, "days": {"type": "boolean"}},
           "required": ["unit", "days"], "additionalProperties": False}


def json_schema_format(schema, strict=True):
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": strict}}


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused")


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_json_schema_reply_validates_even_from_a_random_model(client, seed):
    reply = client.chat.completions.create(
        model="tiny", messages=HI, seed=seed, max_tokens=60, response_format=json_schema_format(VERDICT),
    )
    choice = reply.choices[0]
    jsonschema.validate(json.loads(choice.message.content), VERDICT)
    assert choice.finish_reason == "stop"


def test_responses_text_format(client):
    response = client.responses.create(
        model="tiny", input="hi", max_output_tokens=60,
        text={"format": {"type": "json_schema", "name": "verdict", "schema": VERDICT, "strict": True}},
    )
    jsonschema.validate(json.loads(response.output_text), VERDICT)
    assert response.text.format.type == "json_schema" and response.status == "completed"


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "forecast"}}])
def test_a_forced_strict_tool_call_has_arguments_that_validate(client, choice):
    tools = [
        {"type": "function", "function": {"name": "forecast", "parameters": WEATHER, "strict": True}},
        {"type": "function", "function": {"name": "alarm", "parameters": VERDICT, "strict": True}},
    ]
    for seed in range(3):
        reply = client.chat.completions.create(model="tiny", messages=HI, seed=seed, tools=tools, tool_choice=choice,
                                               max_tokens=80)
        call = reply.choices[0].message.tool_calls[0]
        schema = WEATHER if call.function.name == "forecast" else VERDICT
        jsonschema.validate(json.loads(call.function.arguments), schema)
        assert reply.choices[0].finish_reason == "tool_calls"
        if isinstance(choice, dict):
            assert call.function.name == "forecast"


def test_schemas_that_cannot_be_enforced_are_400s_naming_the_field(server):
    body = {"model": "tiny", "messages": HI, "max_tokens": 4}
    cases = [
        ({"response_format": json_schema_format({"type": "nonsense"})}, "response_format", "not a valid JSON Schema"),
        ({"response_format": json_schema_format({"type": "string", "format": "weird"})}, "response_format",
         "cannot be enforced"),
        ({"response_format": {"type": "json_object"}, "tools": [{"type": "function", "function": {"name": "f"}}]},
         "response_format", "together with tools"),
        ({"response_format": {"type": "xml"}}, "response_format", "does not match any of the expected tags"),
    ]
    for extra, param, words in cases:
        refused = server.post("/v1/chat/completions", {**body, **extra})
        error = refused.json()["error"]
        assert refused.status_code == 400 and error["param"].startswith(param) and words in error["message"], error
    # not strict: a keyword the grammar cannot enforce is left to the model
    lenient = server.post("/v1/chat/completions", {
        **body, "max_tokens": 30, "response_format": json_schema_format({"type": "string", "format": "weird"}, False)})
    assert lenient.status_code == 200 and lenient.json()["choices"][0]["message"]["content"].startswith('"')


def test_logprobs_belong_to_the_sampled_tokens(client):
    reply = client.chat.completions.create(model="tiny", messages=HI, temperature=0, max_tokens=12,
                                           logprobs=True, top_logprobs=3)
    choice = reply.choices[0]
    tokens = choice.logprobs.content
    assert len(tokens) == reply.usage.completion_tokens
    assert "".join(t.token for t in tokens) == choice.message.content
    for token in tokens:
        # greedy: the sampled token is the likeliest, listed first with its own log probability
        assert token.top_logprobs[0].token == token.token and token.top_logprobs[0].logprob == token.logprob
        assert len(token.top_logprobs) == 3 and token.logprob <= 0
        assert [t.logprob for t in token.top_logprobs] == sorted((t.logprob for t in token.top_logprobs), reverse=True)
        assert sum(math.exp(t.logprob) for t in token.top_logprobs) <= 1 + 1e-6
        assert bytes(token.bytes).decode() == token.token
    streamed = client.chat.completions.create(model="tiny", messages=HI, temperature=0, max_tokens=12,
                                              logprobs=True, top_logprobs=3, stream=True)
    listed = [t for c in streamed if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [(t.token, t.logprob) for t in listed] == [(t.token, t.logprob) for t in tokens]


def test_responses_logprobs_of_the_output_text(client):
    common = dict(model="tiny", input="hi", temperature=0, max_output_tokens=10, top_logprobs=2,
                  include=["message.output_text.logprobs"])
    response = client.responses.create(**common)
    part = response.output[0].content[0]
    assert "".join(t.token for t in part.logprobs) == part.text and len(part.logprobs) == 10
    assert all(t.top_logprobs[0].logprob == t.logprob and len(t.top_logprobs) == 2 for t in part.logprobs)
    events = list(client.responses.create(**common, stream=True))
    streamed = [t for e in events if e.type == "response.output_text.delta" for t in e.logprobs]
    assert [(t.token, t.logprob) for t in streamed] == [(t.token, t.logprob) for t in part.logprobs]
    assert events[-1].response.output[0].content[0].logprobs == part.logprobs


def test_completions_logprobs_in_the_legacy_shape(client):
    reply = client.completions.create(model="tiny", prompt="hello", temperature=0, max_tokens=6, logprobs=2)
    listed = reply.choices[0].logprobs
    assert "".join(listed.tokens) == reply.choices[0].text and len(listed.token_logprobs) == 6
    assert all(max(top.values()) == lp for top, lp in zip(listed.top_logprobs, listed.token_logprobs))
    assert listed.text_offset == [sum(len(t) for t in listed.tokens[:i]) for i in range(6)]


def test_n_choices_differ_under_one_seed_and_stream_by_index(client):
    common = dict(model="tiny", messages=HI, seed=7, max_tokens=8, n=2)
    whole = client.chat.completions.create(**common)
    texts = [c.message.content for c in whole.choices]
    assert [c.index for c in whole.choices] == [0, 1] and texts[0] != texts[1]
    assert whole.usage.completion_tokens == 16
    assert client.chat.completions.create(**common).choices[1].message.content == texts[1]  # the seed holds
    streamed = ["", ""]
    finishes = {}
    for chunk in client.chat.completions.create(**common, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert streamed == texts and finishes == {0: "length", 1: "length"}


def test_several_prompts_times_n(client, server):
    reply = client.completions.create(model="tiny", prompt=["one", "two two"], n=2, max_tokens=3, seed=1)
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    alone = [client.completions.create(model="tiny", prompt=p, max_tokens=3, seed=1) for p in ("one", "two two")]
    assert reply.choices[0].text == alone[0].choices[0].text and reply.choices[2].text == alone[1].choices[0].text
    assert reply.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    tokens = client.completions.create(model="tiny", prompt=[[5, 6, 7], [8, 9]], max_tokens=2)
    assert len(tokens.choices) == 2
    too_many = server.post("/v1/completions", {"model": "tiny", "prompt": ["a"] * 9, "n": 2})
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "n"


@pytest.fixture(scope="module")
def smol(smollm2, tmp_path_factory):
    """SmolLM2 with its own template, and with the built-in ChatML one, which takes tools."""
    models = {"smollm2": {"path": str(smollm2)}, "smollm2-tools": {"path": str(smollm2), "chat_template": "chatml"}}
    env = {"KRONK_MODELS": json.dumps(models), "KRONK_DEFAULT_MODEL": "smollm2"}
    with run_server(tmp_path_factory.mktemp("smol"), env) as server:
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="unused")


PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0, "maximum": 150}},
    "required": ["name", "age"], "additionalProperties": False,
}


@pytest.mark.parametrize("strict", [True, False])
def test_smollm2_answers_in_the_schema(smol, strict):
    reply = smol.chat.completions.create(
        model="smollm2", temperature=0, max_tokens=60, response_format=json_schema_format(PERSON, strict),
        messages=[{"role": "user", "content": "Describe Marie Curie as a JSON object with her name and age."}],
    )
    person = json.loads(reply.choices[0].message.content)
    jsonschema.validate(person, PERSON)
    assert reply.choices[0].finish_reason == "stop"


def test_smollm2_json_object_mode_streamed_as_whole(smol):
    common = dict(model="smollm2", temperature=0, max_tokens=120, response_format={"type": "json_object"},
                  messages=[{"role": "user", "content": 'Reply with the JSON object {"capital": ...} for France.'}])
    whole = smol.chat.completions.create(**common).choices[0]
    assert isinstance(json.loads(whole.message.content), dict) and whole.finish_reason == "stop"
    streamed = "".join(c.choices[0].delta.content or "" for c in smol.chat.completions.create(**common, stream=True))
    assert streamed == whole.message.content


def test_smollm2_forced_strict_tool_call(smol):
    tools = [{"type": "function", "function": {
        "name": "get_weather", "strict": True,
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                       "required": ["city"], "additionalProperties": False}}}]
    reply = smol.chat.completions.create(
        model="smollm2-tools", temperature=0, max_tokens=40, tools=tools, tool_choice="required",
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
    )
    call = reply.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and "Paris" in json.loads(call.function.arguments)["city"]
