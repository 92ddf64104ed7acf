"""Planning a request: from a protocol's GenerationRequest to the job a slot runs, on a loaded model, no server."""

import pytest

from kronk_wsgi.api.errors import ApiError
from kronk_wsgi.api.planning import GenerationRequest, ReplyFormat, ToolUse, check, plan
from kronk_wsgi.config import ModelSampling, ModelSpec, Settings
from kronk_wsgi.engine.sampling import WHOLE_CONTEXT, SamplingParams
from kronk_wsgi.metrics import Metrics
from kronk_wsgi.serving.pool import ModelPool

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def pool(tiny_model):
    models = {"tiny": ModelSpec(path=str(tiny_model)), "plain": ModelSpec(path=str(tiny_model), chat_template="plain"),
              "short": ModelSpec(path=str(tiny_model), max_tokens=20),
              "tuned": ModelSpec(path=str(tiny_model), sampling={"temperature": 0.25, "top_k": 9, "repeat_last_n": -1})}
    pool = ModelPool(Settings(models=models, default_model="tiny", threads=1), Metrics())
    yield pool
    for model in pool.loaded():
        pool.unload(model.id, "admin")


@pytest.fixture(scope="module")
def tiny(pool):
    with pool.use("tiny") as model:
        yield model


def refused(call) -> ApiError:
    with pytest.raises(ApiError) as caught:
        call()
    assert caught.value.status == 400
    return caught.value


def test_a_chat_is_rendered_by_the_template_and_may_run_to_the_end_of_the_context(tiny):
    job = plan(tiny, GenerationRequest("tiny", prompt_param="messages", messages=ASK))
    rendered = tiny.template.render(ASK, None, None)
    assert job.prompts == [tiny.tokenize(rendered.text, inert=rendered.inert)]
    assert job.decode.max_tokens == tiny.engine.context_length - len(job.prompts[0])
    assert job.decode.end_ids == tiny.end_ids and job.decode.grammar is None
    assert job.reading.tool_rules is None and job.reading.reply_start == ""


def test_a_models_max_tokens_bounds_the_replies_whose_requests_set_none(pool):
    with pool.use("short") as short:
        assert plan(short, GenerationRequest("short", prompt_param="messages", messages=ASK)).decode.max_tokens == 20
        asked = plan(short, GenerationRequest("short", prompt_param="messages", messages=ASK, max_tokens=50))
        assert asked.decode.max_tokens == 50  # the request's own limit, as llama-server's n_predict overrides -n


def test_a_models_sampling_fills_what_a_request_left_to_its_protocols_default(pool):
    with pool.use("tuned") as tuned:
        asked = SamplingParams(temperature=0.8, top_k=40, seed=5)
        request = GenerationRequest("tuned", prompt_param="messages", messages=ASK, sampling=asked,
                                    sampling_defaulted=frozenset({"top_k", "repetition_window", "seed"}))
        sampling = plan(tuned, request).decode.sampling
        assert (sampling.temperature, sampling.top_k, sampling.seed) == (0.8, 9, 5)  # no seed in the model's
        assert sampling.repetition_window == WHOLE_CONTEXT
        silent = plan(tuned, GenerationRequest("tuned", prompt_param="messages", messages=ASK, sampling=asked))
        assert silent.decode.sampling == asked  # nothing left to the defaults: the request's own, whole


def test_a_models_sampling_setting_goes_over_its_files_and_names_what_it_cannot_apply():
    sampling, left = ModelSampling(top_k=5).over_file(
        {"temp": 0.6, "top_k": 20, "top_p": 7.0, "penalty_last_n": 32, "mirostat": 2, "sequence": "top_k;temp"})
    assert (sampling.temperature, sampling.top_k, sampling.top_p, sampling.repeat_last_n) == (0.6, 5, None, 32)
    assert left == ["mirostat", "sequence", "top_p"]  # no such sampler, an order, a value out of bounds


def test_raw_prompts_each_get_n_replies(tiny):
    request = GenerationRequest("tiny", prompt_param="prompt", prompts=["Once upon", [1, 5, 9]], n=2, max_tokens=7,
                                stop=("END",), sampling=SamplingParams(temperature=0))
    job = plan(tiny, request)
    assert job.prompts[1] == [1, 5, 9] and job.prompts[0] == tiny.tokenize("Once upon")
    assert job.n == 2 and job.decode.max_tokens == 7 and job.decode.stop == ("END",)
    assert job.decode.sampling.temperature == 0


def test_the_errors_name_the_bodys_own_fields(tiny):
    vocab = tiny.engine.tokenizer.vocab_size
    context = tiny.engine.context_length
    error = refused(lambda: plan(tiny, GenerationRequest("tiny", prompt_param="prompt", prompts=[[vocab]])))
    assert error.param == "prompt"
    too_long = GenerationRequest("tiny", prompt_param="input", messages=[{"role": "user", "content": "word " * context}])
    error = refused(lambda: plan(tiny, too_long))
    assert error.param == "input" and error.code == "context_length_exceeded"
    clamped = plan(tiny, GenerationRequest("tiny", prompt_param="messages", messages=ASK, max_tokens=32_000))
    assert clamped.decode.max_tokens == context - len(clamped.prompts[0])  # what fits, as llama-server does
    biased = GenerationRequest("tiny", prompt_param="messages", messages=ASK,
                               sampling=SamplingParams(logit_bias=((vocab, 5.0),)))
    assert refused(lambda: plan(tiny, biased)).param == "logit_bias"


def test_a_forced_call_starts_the_reply_inside_it_with_its_arguments_constrained(tiny):
    tools = ToolUse((TOOL,), choice="required", name="get_weather", max_calls=1)
    job = plan(tiny, GenerationRequest("tiny", prompt_param="messages", messages=ASK, tools=tools))
    assert job.reading.reply_start.startswith("<tool_call>") and "get_weather" in job.reading.reply_start
    assert job.reading.tool_rules is not None and job.reading.tool_rules.max_calls == 1
    assert job.decode.grammar is not None and job.decode.constrain_after == ""
    rendered = tiny.template.render(ASK, [TOOL], None)
    assert job.prompts[0] == tiny.tokenize(rendered.text + job.reading.reply_start, inert=rendered.inert)


def test_strict_tools_with_auto_constrain_a_call_once_the_model_opens_it(tiny):
    tools = ToolUse((TOOL,), strict=frozenset({"get_weather"}))
    job = plan(tiny, GenerationRequest("tiny", prompt_param="messages", messages=ASK, tools=tools))
    assert job.reading.reply_start == "" and job.decode.constrain_after == "<tool_call>"
    assert job.decode.grammar is not None
    unchecked = plan(tiny, GenerationRequest("tiny", prompt_param="messages", messages=ASK, tools=ToolUse((TOOL,))))
    assert unchecked.decode.grammar is None and unchecked.reading.tool_rules is not None
    none = plan(tiny, GenerationRequest("tiny", prompt_param="messages", messages=ASK,
                                        tools=ToolUse((TOOL,), choice="none")))
    assert none.reading.tool_rules is None


def test_a_reply_format_constrains_the_reply(tiny):
    request = GenerationRequest("tiny", prompt_param="messages", messages=ASK,
                                reply_format=ReplyFormat(WEATHER, strict=True, param="text.format"))
    assert plan(tiny, request).decode.grammar is not None


def test_a_template_without_tools_gets_them_written_into_the_messages(pool):
    with pool.use("plain") as plain:
        request = GenerationRequest("plain", prompt_param="messages", messages=ASK, tools=ToolUse((TOOL,)))
        job = plan(plain, request)
        text = plain.engine.tokenizer.decode(job.prompts[0]).decode()
        assert "<tools>" in text and '"get_weather"' in text and text.startswith("system: ")
        assert job.reading.tool_rules is not None and job.reading.tool_rules.format.opens[0] == "<tool_call>"


@pytest.mark.parametrize("request_, param", [
    (GenerationRequest("m", prompt_param="messages", messages=ASK, tools=ToolUse((TOOL,), name="other")),
     "tool_choice"),
    (GenerationRequest("m", prompt_param="messages", messages=ASK, tools=ToolUse((TOOL,)),
                       reply_format=ReplyFormat(WEATHER, strict=False, param="response_format")), "response_format"),
    (GenerationRequest("m", prompt_param="prompt", prompts=["a", "b", "c"], n=6), "n"),
    (GenerationRequest("m", prompt_param="messages", messages=ASK,
                       reply_format=ReplyFormat({"type": "nonsense"}, strict=True, param="text.format")), "text.format"),
    (GenerationRequest("m", prompt_param="messages", messages=ASK,
                       tools=ToolUse(({"type": "function", "function": {"name": "t", "parameters": {"type": 3}}},),
                                     strict=frozenset({"t"}))), "tools"),
], ids=["unknown forced tool", "format with tools", "too many choices", "bad format schema", "bad strict tool"])
def test_check_refuses_what_no_model_could_answer(request_, param):
    assert refused(lambda: check(request_)).param == param
