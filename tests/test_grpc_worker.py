"""kronk_wsgi as a gRPC worker (SGLang's and vLLM's engine protocols): reading calls, writing replies, and real
processes: `kronk-wsgi grpc` workers on SmolLM2 (llama.cpp), called directly and through the real Shepherd Model
Gateway."""

import hashlib
import io
import json
import threading
import time
import zipfile

import grpc
import pytest
import requests
import tokenizers
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc
from smg_grpc_proto.generated import vllm_engine_pb2 as vllm
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vllm_grpc

from kronk_wsgi.api.planning import JSON_OBJECT, Ending
from kronk_wsgi.engine.gguf_file import read_gguf
from kronk_wsgi.engine.tokenizer import GGUFTokenizer
from kronk_wsgi.grpc_worker.replies import Replies
from kronk_wsgi.grpc_worker.requests import Refused, generation_request, stream_interval, vllm_generation_request
from kronk_wsgi.serving.events import ChoiceEnd, Finished, Logprobs, PromptCached, TextDelta, TokenIds, \
    TokenLogprob, Usage
from kronk_wsgi.testing import run_grpc_worker, run_server, run_smg

from .conftest import faulty_env

HARD_TEXTS = ["Hello world", "  leading spaces\tand\ttabs\n\nnewlines", "numbers 1234567 3.14159",
              "émojis 🦙🔥 and 中文字符 ", "<|im_start|>user\nhi<|im_end|>",
              "<start_of_turn>user\nhi<end_of_turn>",
              "don't can't I'll we've", "a\u00a0b\u200bc", " ", "\n", "code: def f(x):\n    return x**2  # comment",
              "<|im_start|>x<|im_end|>y", "ÿþ bytes"]
QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


def call(ids=(1, 2, 3), stream=False, **sampling) -> pb.GenerateRequest:
    return pb.GenerateRequest(request_id="r1", tokenized=pb.TokenizedInput(input_ids=list(ids)), stream=stream,
                              sampling_params=pb.SamplingParams(**sampling))


# -- reading a call ----------------------------------------------------------------------------------------------

def test_a_call_becomes_a_generation_request():
    request = generation_request(call(temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, frequency_penalty=0.5,
                                      presence_penalty=0.25, repetition_penalty=1.1, max_new_tokens=12,
                                      stop=["\n\n"], stop_token_ids=[7], min_new_tokens=2, ignore_eos=True, n=2,
                                      logit_bias={"5": -100.0}, json_schema='{"type": "object"}'), "m")
    assert request.prompts == [[1, 2, 3]] and request.n == 2 and request.max_tokens == 12
    assert request.ending == Ending(ignore_eos=True, stop_ids=(7,), min_tokens=2)
    assert request.stop == ("\n\n",) and request.token_ids
    s = request.sampling
    assert (s.temperature, s.top_p, s.top_k, s.min_p) == pytest.approx((0.7, 0.9, 40, 0.05))
    assert (s.frequency_penalty, s.presence_penalty, s.repetition_penalty) == pytest.approx((0.5, 0.25, 1.1))
    assert s.logit_bias == ((5, -100.0),) and request.reply_format.schema == {"type": "object"}


def test_unset_fields_read_as_the_neutral_values():
    request = generation_request(call(), "m")
    assert request.max_tokens is None and request.n == 1 and request.top_logprobs is None
    assert (request.sampling.top_p, request.sampling.top_k, request.sampling.repetition_penalty) == (1.0, 0, 1.0)
    assert generation_request(call(top_k=-1), "m").sampling.top_k == 0
    with_logprobs = call()
    with_logprobs.return_logprob, with_logprobs.top_logprobs_num, with_logprobs.logprob_start_len = True, 3, -1
    assert generation_request(with_logprobs, "m").top_logprobs == 3


@pytest.mark.parametrize("change, field", [
    (lambda c: c.sampling_params.__setattr__("regex", "[a-z]+"), "sampling_params.regex"),
    (lambda c: c.sampling_params.__setattr__("structural_tag", "{}"), "sampling_params.structural_tag"),
    (lambda c: c.sampling_params.__setattr__("json_schema", "{not json"), "sampling_params.json_schema"),
    (lambda c: c.sampling_params.__setattr__("json_schema", "[1]"), "sampling_params.json_schema"),
    (lambda c: c.sampling_params.logit_bias.__setitem__("x", 1.0), "sampling_params.logit_bias"),
    (lambda c: c.sampling_params.__setattr__("temperature", float("nan")), "sampling_params.temperature"),
    (lambda c: c.sampling_params.custom_params.update({"a": 1}), "sampling_params.custom_params"),
    (lambda c: c.mm_inputs.image_urls.append("http://x/a.png"), "mm_inputs"),
    (lambda c: c.__setattr__("return_hidden_states", True), "return_hidden_states"),
    (lambda c: c.input_embeds.append(0.5), "input_embeds"),
    (lambda c: c.__setattr__("lora_id", "adapter"), "lora_id"),
    (lambda c: c.__setattr__("custom_logit_processor", "x"), "custom_logit_processor"),
    (lambda c: c.token_ids_logprob.append(3), "token_ids_logprob"),
    (lambda c: (c.__setattr__("return_logprob", True), c.__setattr__("logprob_start_len", 0)), "logprob_start_len"),
    (lambda c: c.__setattr__("data_parallel_rank", 1), "data_parallel_rank"),
    (lambda c: c.disaggregated_params.__setattr__("bootstrap_host", "h"), "disaggregated_params"),
    (lambda c: c.tokenized.ClearField("input_ids"), "tokenized.input_ids"),
])
def test_what_cannot_be_honoured_is_refused_by_name(change, field):
    request = call()
    change(request)
    with pytest.raises(Refused) as refused:
        generation_request(request, "m")
    assert refused.value.field == field


def test_a_stream_interval_is_read_and_checked():
    assert stream_interval(call()) == 1 and stream_interval(call(stream_interval=4)) == 4
    with pytest.raises(Refused) as refused:
        stream_interval(call(stream_interval=0))
    assert refused.value.field == "sampling_params.stream_interval"


# -- writing the replies -------------------------------------------------------------------------------------------

def vllm_call(ids=(1, 2, 3), stream=False, **sampling) -> vllm.GenerateRequest:
    return vllm.GenerateRequest(request_id="r1", tokenized=vllm.TokenizedInput(input_ids=list(ids)), stream=stream,
                                sampling_params=vllm.SamplingParams(**sampling))


def test_a_vllm_call_becomes_a_generation_request():
    request = vllm_generation_request(vllm_call(
        ids=range(10), top_k=40, max_tokens=12, min_tokens=2, stop=["\n\n"], stop_token_ids=[7], seed=5, logprobs=3,
        truncate_prompt_tokens=4, logit_bias={5: -100.0}, choice=vllm.ChoiceConstraint(choices=['yes', 'no "q"'])), "m")
    assert request.prompts == [[6, 7, 8, 9]] and request.max_tokens == 12 and request.top_logprobs == 3
    assert request.ending == Ending(False, (7,), 2) and request.stop == ("\n\n",)
    sampling = request.sampling
    assert (sampling.temperature, sampling.top_p, sampling.repetition_penalty) == (1.0, 1.0, 1.0)  # unset: vLLM's
    assert sampling.seed == 5 and sampling.top_k == 40 and sampling.logit_bias == ((5, -100.0),)
    assert request.reply_format.gbnf == 'root ::= "yes" | "no \\"q\\""'
    assert vllm_generation_request(vllm_call(json_object=True), "m").reply_format.schema == JSON_OBJECT
    whole = vllm_generation_request(vllm_call(temperature=0), "m")
    assert whole.sampling.temperature == 0 and whole.max_tokens is None and whole.top_logprobs is None


@pytest.mark.parametrize("request_, field", [
    (vllm.GenerateRequest(text="hi"), "text"),
    (vllm_call(prompt_logprobs=1), "prompt_logprobs"),
    (vllm_call(include_stop_str_in_output=True), "include_stop_str_in_output"),
    (vllm_call(regex="a+"), "regex"),
    (vllm_call(truncate_prompt_tokens=-1), "truncate_prompt_tokens"),
    (vllm_call(logprobs=-1), "logprobs"),
    (vllm_call(ids=()), "input_ids"),
])
def test_what_a_vllm_call_asks_that_cannot_be_honoured_is_refused_by_name(request_, field):
    with pytest.raises(Refused, match=field):
        vllm_generation_request(request_, "m")


def test_vllm_replies_are_vllms_messages():
    replies = Replies("r", 3, stream=True, end_ids=frozenset({2}), logprobs=True, pb=vllm)
    out = []
    for event in (TokenIds((10,)), Logprobs((_logprob(10),)), TokenIds((2,)), ChoiceEnd("stop")):
        out += replies.feed(event)
    assert all(isinstance(m, vllm.GenerateResponse) for m in out)
    assert [list(m.chunk.token_ids) for m in out if m.HasField("chunk")] == [[10], [2]]
    assert out[-1].complete.finish_reason == "stop" and out[-1].complete.matched_token_id == 2


def _logprob(token):
    return TokenLogprob(b"x", -0.5, ((b"x", -0.5), (b"y", -1.5)), token, (token, 99))


def test_a_stream_is_chunks_then_each_choices_end():
    replies = Replies("r", 3, stream=True, end_ids=frozenset({2}), logprobs=True)
    out = []
    for event in (PromptCached(Usage(3, 0, 1)), TokenIds((10,)), Logprobs((_logprob(10),)), TextDelta("x"),
                  TokenIds((11, 2)), Logprobs((_logprob(11),)), ChoiceEnd("stop"), Finished(Usage(3, 2, 1))):
        out += replies.feed(event)
    chunks = [m.chunk for m in out if m.HasField("chunk")]
    assert [list(c.token_ids) for c in chunks] == [[10], [11, 2]]
    assert [list(c.output_logprobs.token_ids) for c in chunks] == [[10], [11]]
    assert list(chunks[0].output_logprobs.top_logprobs[0].token_ids) == [10, 99]
    assert [c.completion_tokens for c in chunks] == [1, 2] and chunks[0].cached_tokens == 1
    (complete,) = [m.complete for m in out if m.HasField("complete")]
    assert complete.finish_reason == "stop" and complete.matched_token_id == 2 and complete.completion_tokens == 2
    assert complete.prompt_tokens == 3 and complete.cached_tokens == 1


def test_a_stream_interval_holds_tokens_until_that_many_or_the_end():
    replies = Replies("r", 3, stream=True, end_ids=frozenset({2}), logprobs=False, stream_interval=3)
    out = []
    for event in (TokenIds((10,)), TokenIds((11,)), TokenIds((12,)), TokenIds((13,)), ChoiceEnd("length")):
        out += replies.feed(event)
    assert [list(m.chunk.token_ids) for m in out if m.HasField("chunk")] == [[10, 11, 12], [13]]


def test_reasoning_tokens_count_the_thinking_to_its_closing_tag():
    replies = Replies("r", 3, stream=True, end_ids=frozenset({2}), logprobs=False, thinking_end=(7, 8))
    out = []
    for event in (TokenIds((10, 7)), TokenIds((11,)), TokenIds((7, 8, 12)), TokenIds((13, 2)), ChoiceEnd("stop")):
        out += replies.feed(event)
    assert [m.chunk.reasoning_tokens for m in out if m.HasField("chunk")] == [2, 3, 5, 5]
    assert out[-1].complete.reasoning_tokens == 5
    unasked = Replies("r", 3, stream=False, end_ids=frozenset({2}), logprobs=False)
    unasked.feed(TokenIds((7, 8, 12)))
    assert unasked.feed(ChoiceEnd("stop"))[0].complete.reasoning_tokens == 0


def test_a_whole_answer_is_one_complete_per_choice_with_every_token():
    replies = Replies("r", 3, stream=False, end_ids=frozenset({2}), logprobs=False)
    out = []
    for event in (TokenIds((10,)), TokenIds((11,), index=1), TokenIds((12,)), ChoiceEnd("stop", "\n\n"),
                  ChoiceEnd("length", index=1)):
        out += replies.feed(event)
    assert all(m.HasField("complete") for m in out)
    first, second = (m.complete for m in out)
    assert list(first.output_ids) == [10, 12] and first.matched_stop_str == "\n\n" and first.index == 0
    assert list(second.output_ids) == [11] and second.finish_reason == "length" and second.index == 1
    assert not first.HasField("output_logprobs")


# -- the tokenizer bundle ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fixture", ["smollm2", "gemma3"])
def test_the_exported_tokenizer_reads_as_this_servers(fixture, request):
    tokenizer = GGUFTokenizer(read_gguf(request.getfixturevalue(fixture)))
    exported = tokenizers.Tokenizer.from_str(tokenizer.to_json())
    for text in HARD_TEXTS:
        ids = tokenizer.prompt(text)
        assert exported.encode(text).ids == ids, text
        plain = ids[1:] if tokenizer.add_bos else ids
        assert exported.decode(plain, skip_special_tokens=False) == tokenizer.decode(ids).decode(), text


# -- real workers ------------------------------------------------------------------------------------------------

def smollm_env(smollm2, **extra):
    return {"KRONK_MODELS": json.dumps({"smollm": {"path": str(smollm2), "engine": "llama.cpp"}}), **extra}


@pytest.fixture(scope="module")
def workers(smollm2, tmp_path_factory):
    """Two kronk gRPC workers on SmolLM2 (one slot each)."""
    with run_grpc_worker(tmp_path_factory.mktemp("w1"), smollm_env(smollm2)) as one, \
            run_grpc_worker(tmp_path_factory.mktemp("w2"), smollm_env(smollm2)) as two:
        yield one, two


@pytest.fixture(scope="module")
def gateway(workers, tmp_path_factory):
    """The real SMG in front of both workers, balancing cache-aware."""
    log = tmp_path_factory.mktemp("smg") / "smg.log"
    with run_smg([w.url for w in workers], "smollm", ["--policy", "cache_aware"], log=log) as url:
        yield url


@pytest.fixture(scope="module")
def kronk_http(smollm2, tmp_path_factory):
    with run_server(tmp_path_factory.mktemp("http"), smollm_env(smollm2)) as server:
        yield server


def stub(worker) -> pb_grpc.SglangSchedulerStub:
    return pb_grpc.SglangSchedulerStub(grpc.insecure_channel(worker.address))


def test_the_worker_describes_its_model_and_its_load(workers):
    scheduler = stub(workers[0])
    info = scheduler.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    assert info.served_model_name == "smollm" and info.is_generation and info.max_context_length == 8192
    assert info.vocab_size == 49152 and 2 in info.eos_token_ids
    server = scheduler.GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
    assert server.server_type == "grpc" and server.server_args["max_running_requests"] == 1
    loads = scheduler.GetLoads(pb.GetLoadsRequest(), timeout=10)
    assert loads.dp_rank_count == 1 and loads.loads[0].max_running_requests == 1
    assert scheduler.HealthCheck(pb.HealthCheckRequest(), timeout=10).healthy
    assert requests.get(workers[0].http + "/health", timeout=10).status_code == 200
    assert "kronk_requests" in requests.get(workers[0].http + "/metrics", timeout=10).text


def test_the_tokenizer_bundle_tokenizes_as_the_worker(workers, smollm2):
    chunks = list(stub(workers[0]).GetTokenizer(common_pb2.GetTokenizerRequest(), timeout=30))
    data = b"".join(c.data for c in chunks)
    assert chunks[-1].sha256 == hashlib.sha256(data).hexdigest() and not any(c.sha256 for c in chunks[:-1])
    archive = zipfile.ZipFile(io.BytesIO(data))
    assert {"tokenizer.json", "tokenizer_config.json", "config.json"} <= set(archive.namelist())
    exported = tokenizers.Tokenizer.from_str(archive.read("tokenizer.json").decode())
    ours = GGUFTokenizer(read_gguf(smollm2))
    assert [exported.encode(t).ids for t in HARD_TEXTS] == [ours.prompt(t) for t in HARD_TEXTS]
    assert "<|im_start|>" in json.loads(archive.read("tokenizer_config.json"))["chat_template"]


def test_hostile_sampling_is_invalid_argument_naming_the_field(workers):
    scheduler = stub(workers[0])
    for sampling, field in (({"top_p": 2.0}, "top_p"), ({"repetition_penalty": -1.0}, "repetition_penalty"),
                            ({"logit_bias": {"999999": 1.0}}, "logit_bias"), ({"stop_token_ids": [10**6]},
                                                                                "stop_token_ids"),
                            ({"regex": "a+"}, "regex"), ({"ebnf_grammar": "root ::= ("}, "ebnf_grammar")):
        with pytest.raises(grpc.RpcError) as failed:
            list(scheduler.Generate(call(ids=[1, 2], max_new_tokens=2, **sampling), timeout=30))
        assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in failed.value.details()
    with pytest.raises(grpc.RpcError) as failed:
        list(scheduler.Generate(call(ids=[1] * 9000, max_new_tokens=2), timeout=30))
    assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "context" in failed.value.details()


def test_constraints_and_stops_shape_the_reply(workers, smollm2):
    scheduler = stub(workers[0])
    tokenizer = GGUFTokenizer(read_gguf(smollm2))
    prompt = tokenizer.prompt("<|im_start|>user\nName a colour.<|im_end|>\n<|im_start|>assistant\n")
    (whole,) = scheduler.Generate(call(prompt, max_new_tokens=40, temperature=0.0,
                                       ebnf_grammar='root ::= "red" | "blue"'), timeout=60)
    assert tokenizer.decode(whole.complete.output_ids).decode() in ("red", "blue")
    (capped,) = scheduler.Generate(call(prompt, max_new_tokens=3, temperature=0.0, ignore_eos=True), timeout=60)
    assert capped.complete.finish_reason == "length" and capped.complete.completion_tokens == 3
    answers = [m.complete for m in scheduler.Generate(call(prompt, max_new_tokens=4, n=2, temperature=1.0),
                                                       timeout=60)]
    assert sorted(c.index for c in answers) == [0, 1]
    every_two = call(prompt, stream=True, max_new_tokens=5, temperature=0.0, ignore_eos=True, stream_interval=2)
    every_two.require_reasoning = True  # SmolLM2 does not think: none of its tokens are reasoning
    messages = list(scheduler.Generate(every_two, timeout=60))
    assert [len(m.chunk.token_ids) for m in messages if m.HasField("chunk")] == [2, 2, 1]
    assert all(m.chunk.reasoning_tokens == 0 for m in messages if m.HasField("chunk"))


def test_an_abort_or_a_cancel_stops_the_stream_and_frees_the_slot(workers, smollm2):
    scheduler = stub(workers[1])
    prompt = GGUFTokenizer(read_gguf(smollm2)).prompt("Count from one to one thousand:")
    stream = scheduler.Generate(pb.GenerateRequest(
        request_id="long-1", tokenized=pb.TokenizedInput(input_ids=prompt), stream=True,
        sampling_params=pb.SamplingParams(max_new_tokens=4000, ignore_eos=True)), timeout=120)
    next(stream)
    assert scheduler.Abort(pb.AbortRequest(request_id="long-1"), timeout=10).success
    (end,) = [m.complete for m in stream if m.HasField("complete")]
    assert end.finish_reason == "abort" and end.completion_tokens < 4000
    cancelled = scheduler.Generate(call(prompt, stream=True, max_new_tokens=4000, ignore_eos=True), timeout=120)
    next(cancelled)
    cancelled.cancel()
    deadline = time.monotonic() + 30
    while scheduler.GetLoads(pb.GetLoadsRequest(), timeout=10).loads[0].num_running_reqs:
        assert time.monotonic() < deadline, "the slot was not freed"
        time.sleep(0.1)
    (served,) = scheduler.Generate(call(prompt, max_new_tokens=2), timeout=60)
    assert served.complete.completion_tokens <= 2
    outcomes = [entry["outcome"] for entry in workers[1].completed()]
    assert "aborted" in outcomes and "client_gone" in outcomes
    assert not scheduler.Abort(pb.AbortRequest(request_id="long-1"), timeout=10).success


# -- through the real gateway ------------------------------------------------------------------------------------

def answers_as_kronk(gateway: str, kronk_http, max_tokens: int) -> str:
    """Assert that the gateway's greedy answer is kronk's own HTTP answer, token for token; the answer."""
    body = {"model": "smollm", "messages": QUESTION, "max_tokens": max_tokens, "temperature": 0, "logprobs": True}
    through = requests.post(gateway + "/v1/chat/completions", json=body, timeout=120).json()
    own = kronk_http.post("/v1/chat/completions", body).json()
    assert through["choices"][0]["message"]["content"] == own["choices"][0]["message"]["content"]
    assert ([t["token"] for t in through["choices"][0]["logprobs"]["content"]]
            == [t["token"] for t in own["choices"][0]["logprobs"]["content"]])
    assert through["usage"]["prompt_tokens"] == own["usage"]["prompt_tokens"]
    assert through["usage"]["completion_tokens"] == own["usage"]["completion_tokens"]
    return own["choices"][0]["message"]["content"]


def streamed(gateway: str, body: dict) -> tuple[str, list]:
    """A chat completion streamed through the gateway: its text, and each chunk's finish reason."""
    text, reasons = "", []
    with requests.post(gateway + "/v1/chat/completions", json={**body, "stream": True}, stream=True,
                       timeout=120) as response:
        for line in response.iter_lines():
            if line.startswith(b"data: {"):
                choice = json.loads(line[6:])["choices"]
                if choice:
                    text += choice[0]["delta"].get("content") or ""
                    reasons.append(choice[0]["finish_reason"])
    return text, reasons


def test_the_gateways_greedy_answer_is_kronks_own(gateway, kronk_http):
    answers_as_kronk(gateway, kronk_http, 40)


def test_the_gateway_streams_what_it_answers_whole(gateway):
    body = {"model": "smollm", "messages": QUESTION, "max_tokens": 30, "temperature": 0}
    whole = requests.post(gateway + "/v1/chat/completions", json=body, timeout=120).json()
    text, reasons = streamed(gateway, body)
    assert text == whole["choices"][0]["message"]["content"] and reasons[-1] == whole["choices"][0]["finish_reason"]


def test_the_gateway_tokenizes_hard_texts_as_kronk(gateway, kronk_http):
    for text in HARD_TEXTS:
        theirs = requests.post(gateway + "/v1/tokenize", json={"model": "smollm", "prompt": text}, timeout=30)
        ours = kronk_http.post("/tokenize", {"content": text, "add_special": True, "parse_special": True})
        assert theirs.json()["tokens"] == ours.json()["tokens"], text


def test_the_gateway_reads_a_json_schema_reply(gateway):
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
              "additionalProperties": False}
    reply = requests.post(gateway + "/v1/chat/completions", timeout=120, json={
        "model": "smollm", "messages": QUESTION, "max_tokens": 60, "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}})
    assert reply.status_code == 200, reply.text
    assert set(json.loads(reply.json()["choices"][0]["message"]["content"])) == {"city"}


def test_a_worker_that_fails_mid_stream_ends_it_and_the_next_goes_to_the_other(tiny_model, tmp_path):
    """One worker dies while it streams (its process killed); the gateway's stream ends, and the next request is
    served by the worker left (on the fault-injecting engine: a token every 0.1 s)."""
    env = faulty_env(tiny_model, KRONK_TEST_STEP_DELAY=0.1, KRONK_TEST_NO_EOS=1)
    with run_grpc_worker(tmp_path / "a", env) as first, run_grpc_worker(tmp_path / "b", env) as second, \
            run_smg([first.url, second.url], "tiny", ["--policy", "round_robin"]) as url:
        body = {"model": "tiny", "messages": QUESTION, "max_tokens": 200, "stream": True}
        got = threading.Event()

        def stream():
            with requests.post(url + "/v1/chat/completions", json=body, stream=True, timeout=120) as response:
                for line in response.iter_lines():
                    if line.startswith(b"data: {"):
                        got.set()

        reader = threading.Thread(target=stream)
        reader.start()
        assert got.wait(60)
        busy = next(w for w in (first, second) if stub(w).GetLoads(pb.GetLoadsRequest(), timeout=10)
                    .loads[0].num_running_reqs)
        busy.proc.kill()
        reader.join(60)
        assert not reader.is_alive()
        for _ in range(2):
            reply = requests.post(url + "/v1/chat/completions", timeout=120,
                                  json={"model": "tiny", "messages": QUESTION, "max_tokens": 3})
            assert reply.status_code == 200, reply.text


def test_the_gateway_serves_a_vllm_worker_as_it_serves_an_sglang_one(smollm2, kronk_http, tmp_path):
    """A worker serving only VllmEngine: SMG finds it a vLLM worker and answers as kronk's own server does."""
    with run_grpc_worker(tmp_path / "w", smollm_env(smollm2), args=["--protocol", "vllm"]) as worker, \
            run_smg([worker.url], "smollm", log=tmp_path / "smg.log") as gateway:
        assert "(runtime: vllm)" in (tmp_path / "smg.log").read_text()
        answer = answers_as_kronk(gateway, kronk_http, 30)
        body = {"model": "smollm", "messages": QUESTION, "max_tokens": 30, "temperature": 0}
        assert streamed(gateway, body)[0] == answer
        engine = vllm_grpc.VllmEngineStub(grpc.insecure_channel(worker.address))
        assert engine.HealthCheck(vllm.HealthCheckRequest(), timeout=10).healthy
        assert engine.GetServerInfo(vllm.GetServerInfoRequest(), timeout=10).max_num_seqs == 1
        tokenizer = GGUFTokenizer(read_gguf(smollm2))
        ids = tokenizer.prompt("Is the sky blue? Answer yes or no.")
        (reply,) = engine.Generate(vllm_call(ids, temperature=0, max_tokens=5,
                                             choice=vllm.ChoiceConstraint(choices=["yes", "no"])), timeout=60)
        chosen = b"".join(tokenizer.piece(token) for token in reply.complete.output_ids).decode()
        assert chosen in ("yes", "no") and reply.complete.finish_reason == "stop", (chosen, reply)
        with pytest.raises(grpc.RpcError) as failed:
            list(engine.Generate(vllm_call(ids, prompt_logprobs=1), timeout=30))
        assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompt_logprobs" in failed.value.details()
