"""kronk_wsgi in front of gRPC workers (the "grpc" engine): a reply's decoding as the protocol's request, and real
processes: a `kronk-wsgi serve` whose model names two `kronk-wsgi grpc` workers on SmolLM2, called by the OpenAI
SDK; workers that die, never listen or serve another model."""

import io
import json
import threading
import time
import zipfile

import grpc
import openai
import pytest
import requests
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc
from smg_grpc_proto.generated import vllm_engine_pb2 as vllm

from kronk_wsgi.engine.generate import DecodeOptions
from kronk_wsgi.engine.grammar import Grammar
from kronk_wsgi.engine.grpc_engine import GrpcOptions
from kronk_wsgi.engine.grpc_remote import generate_request
from kronk_wsgi.engine.sampling import SamplingParams
from kronk_wsgi.serving.pool import WORKERS_POLL_SECONDS
from kronk_wsgi.testing import free_port, model_row, run_grpc_worker, run_server, wait_until

from .conftest import faulty_env

QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


# -- a reply's decoding as a Generate call ----------------------------------------------------------------------

def test_a_replys_decoding_becomes_the_protocols_request():
    options = DecodeOptions(
        end_ids=frozenset({2, 7}), max_tokens=12, min_tokens=3, top_logprobs=2,
        sampling=SamplingParams(temperature=0.5, top_p=0.9, top_k=0, min_p=0.1, repetition_penalty=1.1,
                                presence_penalty=0.2, frequency_penalty=0.3, logit_bias=((5, -100.0),)),
    )
    request = generate_request([1, 2, 3], options)
    params = request.sampling_params
    assert list(request.tokenized.input_ids) == [1, 2, 3] and request.stream
    assert request.return_logprob and request.top_logprobs_num == 2 and request.logprob_start_len == -1
    assert (params.temperature, params.top_p, params.min_p) == pytest.approx((0.5, 0.9, 0.1))
    assert params.top_k == -1  # off, in the protocol's terms
    assert (params.repetition_penalty, params.presence_penalty, params.frequency_penalty) == \
        pytest.approx((1.1, 0.2, 0.3))
    assert params.max_new_tokens == 12 and params.min_new_tokens == 3 and params.n == 1
    # This server's end tokens decide where a reply ends; stop texts are cut here, as the text streams.
    assert list(params.stop_token_ids) == [2, 7] and params.ignore_eos and not params.stop
    assert dict(params.logit_bias) == {"5": -100.0}
    assert params.WhichOneof("constraint") is None


def test_vllms_call_carries_the_same_decoding_under_its_names_and_the_seed():
    options = DecodeOptions(
        end_ids=frozenset({2}), max_tokens=12, min_tokens=3, top_logprobs=2,
        sampling=SamplingParams(temperature=0.5, top_k=0, seed=7, logit_bias=((5, -100.0),)),
        grammar=Grammar.__new__(Grammar),
    )
    options.grammar.origin = ("ebnf_grammar", 'root ::= "a"')
    request = generate_request([1, 2, 3], options, "vllm")
    params = request.sampling_params
    assert isinstance(request, vllm.GenerateRequest) and list(request.tokenized.input_ids) == [1, 2, 3]
    assert (params.max_tokens, params.min_tokens, params.seed, params.logprobs, params.top_k) == (12, 3, 7, 2, 0)
    assert list(params.stop_token_ids) == [2] and params.ignore_eos and dict(params.logit_bias) == {5: -100.0}
    assert params.WhichOneof("constraint") == "grammar" and params.grammar == 'root ::= "a"'


@pytest.mark.parametrize("workers, problem", [
    ([], "at least 1"), (["grpc://nohost"], "not grpc://HOST:PORT"), (["http://h:1/x"], "not grpc://HOST:PORT"),
])
def test_worker_addresses_are_checked(workers, problem):
    with pytest.raises(ValueError, match=problem):
        GrpcOptions(workers=workers)


def test_a_worker_url_is_its_address():
    assert GrpcOptions(workers=["grpc://127.0.0.1:30000", "h:1"]).workers == ["127.0.0.1:30000", "h:1"]


# -- real processes --------------------------------------------------------------------------------------------

def worker_env(smollm2):
    return {"KRONK_MODELS": json.dumps({"smollm": {"path": str(smollm2), "engine": "llama.cpp"}})}


def front_env(model, workers, **options):
    """The front's model "remote" on ``workers``: its tokenizer from the file or folder ``model``, or from the
    workers (None)."""
    return {"KRONK_MODELS": json.dumps({"remote": {
        **({"path": str(model)} if model is not None else {}), "engine": "grpc",
        "engine_options": {"workers": [w if isinstance(w, str) else w.url for w in workers], **options}}})}


@pytest.fixture(scope="module")
def workers(smollm2, tmp_path_factory):
    with run_grpc_worker(tmp_path_factory.mktemp("w1"), worker_env(smollm2)) as one, \
            run_grpc_worker(tmp_path_factory.mktemp("w2"), worker_env(smollm2)) as two:
        yield one, two


@pytest.fixture(scope="module")
def front(workers, smollm2, tmp_path_factory):
    with run_server(tmp_path_factory.mktemp("front"), front_env(smollm2, workers)) as server:
        yield server


@pytest.fixture(scope="module")
def local(smollm2, tmp_path_factory):
    env = {"KRONK_MODELS": json.dumps({"remote": {"path": str(smollm2), "engine": "llama.cpp"}})}
    with run_server(tmp_path_factory.mktemp("local"), env) as server:
        yield server


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def test_the_workers_greedy_answer_is_the_local_engines(front, local):
    same_greedy_answer(front, local)


def same_greedy_answer(front, local):
    asked = dict(model="remote", messages=QUESTION, max_tokens=40, temperature=0)
    remote = client(front).chat.completions.create(**asked)
    mine = client(local).chat.completions.create(**asked)
    assert remote.choices[0].message.content == mine.choices[0].message.content
    assert remote.choices[0].finish_reason == mine.choices[0].finish_reason
    assert remote.usage.prompt_tokens == mine.usage.prompt_tokens
    assert remote.usage.completion_tokens == mine.usage.completion_tokens


def test_a_model_naming_no_file_reads_the_workers_tokenizer_and_answers_as_the_local_engine(workers, local,
                                                                                             tmp_path):
    with run_server(tmp_path, front_env(None, workers)) as server:
        same_greedy_answer(server, local)
        row = model_row(server, "remote")
        assert row["source"] == f"gRPC workers {workers[0].url}, {workers[1].url}", row


def test_a_model_naming_a_tokenizer_folder_answers_as_the_local_engine(workers, local, tmp_path):
    bundle = b"".join(chunk.data for chunk in pb_grpc.SglangSchedulerStub(grpc.insecure_channel(workers[0].address))
                      .GetTokenizer(common_pb2.GetTokenizerRequest(), timeout=60))
    zipfile.ZipFile(io.BytesIO(bundle)).extractall(tmp_path / "tokenizer")
    with run_server(tmp_path, front_env(tmp_path / "tokenizer", workers)) as server:
        same_greedy_answer(server, local)


def test_a_model_naming_no_file_whose_workers_send_no_tokenizer_says_so(tmp_path):
    gone = f"grpc://127.0.0.1:{free_port()}"
    with run_server(tmp_path, front_env(None, [gone]), ready="/v1/liveness") as server:
        reply = server.post("/v1/chat/completions", {"model": "remote", "messages": QUESTION})
        assert reply.status_code >= 500 and "no worker sent its tokenizer" in reply.text, reply.text
        assert "Traceback" not in server.logs()


def test_a_stream_is_the_whole_answer_with_logprobs(front):
    asked = dict(model="remote", messages=QUESTION, max_tokens=30, temperature=0, logprobs=True, top_logprobs=2)
    whole = client(front).chat.completions.create(**asked)
    parts, logprobs = [], []
    for chunk in client(front).chat.completions.create(**asked, stream=True):
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
        if chunk.choices and chunk.choices[0].logprobs and chunk.choices[0].logprobs.content:
            logprobs += chunk.choices[0].logprobs.content
    assert "".join(parts) == whole.choices[0].message.content
    assert [t.token for t in logprobs] == [t.token for t in whole.choices[0].logprobs.content]
    assert all(t.logprob <= 0 and len(t.top_logprobs) == 2 for t in logprobs)


def test_stop_texts_json_schemas_and_token_limits(front):
    stopped = client(front).chat.completions.create(model="remote", messages=QUESTION, max_tokens=40,
                                                    temperature=0, stop=["Paris"])
    assert "Paris" not in stopped.choices[0].message.content and stopped.choices[0].finish_reason == "stop"
    cut = client(front).chat.completions.create(model="remote", messages=QUESTION, max_tokens=3, temperature=0)
    assert cut.choices[0].finish_reason == "length" and cut.usage.completion_tokens == 3
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
              "additionalProperties": False}
    shaped = client(front).chat.completions.create(
        model="remote", messages=QUESTION, max_tokens=40, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": True}})
    assert set(json.loads(shaped.choices[0].message.content)) == {"city"}


WEATHER = {"type": "function", "function": {"name": "get_weather", "strict": True, "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "strict": True, "parameters": {  # not what it would write
    "type": "object", "properties": {"zone_code": {"type": "integer", "enum": [17, 42]}}, "required": ["zone_code"],
    "additionalProperties": False}}}


@pytest.mark.parametrize("tools, choice", [
    ([WEATHER, TIME], "required"),
    ([WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}}),
    ([WEATHER, TIME], "auto"),  # held once the model opens a call: this one answers in text, let through as here
], ids=["required", "named", "strict"])
def test_tool_calls_are_held_by_the_workers_as_by_the_local_engine(front, local, tools, choice):
    """The calls' grammar goes to the worker as its constraint (Lark, held from the opening of a call where the
    model may answer instead): the greedy reply is the local engine's."""
    asked = dict(model="remote", messages=[{"role": "user", "content": "What is the weather in Paris this week?"}],
                 tools=tools, tool_choice=choice, max_tokens=60, temperature=0)
    remote = client(front).chat.completions.create(**asked).choices[0]
    mine = client(local).chat.completions.create(**asked).choices[0]
    assert remote.finish_reason == mine.finish_reason
    assert remote.message.content == mine.message.content
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in remote.message.tool_calls or ()]
    assert calls == [(c.function.name, json.loads(c.function.arguments)) for c in mine.message.tool_calls or ()]
    assert calls or choice == "auto"
    if choice != "auto":
        assert calls[0][0] != "get_time" or calls[0][1]["zone_code"] in (17, 42)


def test_what_the_workers_cannot_honour_is_a_400_naming_it(front):
    seeded = front.post("/v1/chat/completions", {"model": "remote", "messages": QUESTION, "seed": 3})
    assert seeded.status_code == 400 and seeded.json()["error"]["param"] == "seed"
    custom = {"type": "custom", "name": "sql", "format": {"type": "grammar", "syntax": "lark",
                                                         "definition": 'start: "SELECT 1"'}}
    raw = front.post("/v1/responses", {"model": "remote", "input": "Hi", "tools": [custom], "tool_choice": "required"})
    assert raw.status_code == 400 and raw.json()["error"]["param"] == "tools", raw.text
    windowed = front.post("/completion", {"prompt": "Hello", "n_predict": 3, "repeat_last_n": 10})
    assert windowed.status_code == 400 and "repeat_last_n" in windowed.text, windowed.text


def test_a_model_on_vllm_workers_answers_as_on_sglang_ones_and_takes_a_seed(workers, smollm2, local, tmp_path):
    """The same two workers, called through their VllmEngine service: the local engine's greedy answer, and a
    seeded sample drawn the same twice (SGLang's protocol carries no seed; vLLM's does)."""
    with run_server(tmp_path, front_env(smollm2, workers, backend="vllm")) as server:
        asked = dict(model="remote", messages=QUESTION, max_tokens=30, temperature=0, logprobs=True)
        remote = client(server).chat.completions.create(**asked)
        mine = client(local).chat.completions.create(**asked)
        assert remote.choices[0].message.content == mine.choices[0].message.content
        assert [t.token for t in remote.choices[0].logprobs.content] == [t.token for t in mine.choices[0].logprobs.content]
        seeded = dict(model="remote", messages=QUESTION, max_tokens=12, temperature=1.0, seed=3)
        first, again = (client(server).chat.completions.create(**seeded) for _ in range(2))
        assert first.choices[0].message.content == again.choices[0].message.content


def test_a_conversations_next_turn_goes_to_the_worker_that_holds_it(front, workers):
    """cache_aware: the slot (a worker's place) whose tokens continue most of the prompt is taken."""
    for number in range(3):
        conversation = [{"role": "user", "content": f"Conversation {number}: tell me about the number {number}."}]
        first = client(front).chat.completions.create(model="remote", messages=conversation, max_tokens=20,
                                                      temperature=0)
        conversation += [{"role": "assistant", "content": first.choices[0].message.content},
                         {"role": "user", "content": "And one more sentence, please."}]
        second = client(front).chat.completions.create(model="remote", messages=conversation, max_tokens=5,
                                                       temperature=0)
        assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens, number


def test_conversations_taken_in_turn_each_go_back_to_the_worker_that_holds_them(front):
    """cache_aware over more conversations than workers: a later turn goes to the worker its earlier turn was sent
    to, though that worker ran another conversation since (one slot each: the slot's own tokens do not say it)."""
    facts = " ".join(f"Fact {i} is worth knowing." for i in range(30))
    conversations = [[{"role": "user", "content": f"Conversation {number} is about the number {number}. {facts} "
                                                  "Summarize it."}] for number in range(3)]
    firsts = []
    for conversation in conversations:
        first = client(front).chat.completions.create(model="remote", messages=conversation, max_tokens=10,
                                                      temperature=0)
        firsts.append(first)
        conversation += [{"role": "assistant", "content": first.choices[0].message.content},
                         {"role": "user", "content": "And one more sentence, please."}]
    for number in (1, 2, 0):  # conversation 0's worker has run conversation 2 since; the other is free
        second = client(front).chat.completions.create(model="remote", messages=conversations[number], max_tokens=5,
                                                       temperature=0)
        assert second.usage.prompt_tokens_details.cached_tokens >= firsts[number].usage.prompt_tokens, number


def test_a_client_that_leaves_frees_the_workers_slot(front, workers):
    def gone() -> int:
        return sum(entry["outcome"] == "client_gone" for w in workers for entry in w.completed())

    def running() -> int:
        return sum(pb_grpc.SglangSchedulerStub(grpc.insecure_channel(w.address))
                   .GetLoads(pb.GetLoadsRequest(), timeout=10).loads[0].num_running_reqs for w in workers)

    before = gone()
    with requests.post(front.url + "/v1/chat/completions", stream=True, timeout=60,
                       json={"model": "remote", "messages": QUESTION, "max_tokens": 2000, "stream": True,
                             "temperature": 1, "ignore_eos": True}) as response:
        for line in response.iter_lines():
            if line.startswith(b"data: {") and b'"content":"' in line and b'"content":""' not in line:
                break
        assert running() == 1  # still generating when the client leaves
    deadline = time.monotonic() + 30
    while (gone() == before or running()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert gone() == before + 1 and running() == 0


def test_workers_are_added_and_removed_at_run_time_through_the_admin_api(workers, smollm2, tmp_path):
    """Through either of two worker processes (each call on a new connection): a change made through one is
    followed by the other."""
    one, two = workers
    admin = lambda method, **kw: requests.request(method, server.url + "/admin/models/remote/workers",  # noqa: E731
                                                  timeout=60, headers={"Connection": "close"}, **kw)

    def served(worker) -> int:  # generations run (the front may cancel a call as its complete message arrives)
        return sum(entry["completion_tokens"] > 0 for entry in worker.completed())

    def everywhere(urls: list, slots: int):
        """Every process has the model on ``urls`` with ``slots`` and their admission places (two each): each
        answer on a new connection says so for three times the processes' poll (a process that has not followed
        the change yet would answer otherwise within it)."""
        def agrees() -> bool:
            row = model_row(server, "remote")
            return [r["url"] for r in admin("GET").json()["data"]] == urls and \
                (row["slots"], row["places"]) == (slots, 2 * slots)

        def agreed():
            since = time.monotonic()
            while agrees():
                if time.monotonic() - since > 3 * WORKERS_POLL_SECONDS:
                    return True
            return False
        return wait_until(agreed, seconds=60)

    with run_server(tmp_path, {**front_env(smollm2, [one]), "KRONK_WORKERS": 2}) as server:
        client(server).chat.completions.create(model="remote", messages=QUESTION, max_tokens=2)
        everywhere([one.url], 1)
        added = admin("POST", json={"url": two.url})
        assert added.status_code == 200 and added.json()["slots"] == 1, added.text
        everywhere([one.url, two.url], 2)
        assert admin("POST", json={"url": two.url}).status_code == 409  # a worker of the model already
        gone = admin("POST", json={"url": f"grpc://127.0.0.1:{free_port()}"})
        assert gone.status_code == 502 and "does not answer" in gone.json()["error"]["message"]
        assert admin("POST", json={"url": "h1"}).status_code == 400
        removed = admin("DELETE", params={"url": one.url})
        assert removed.status_code == 200 and removed.json()["slots"] == 1, removed.text
        everywhere([two.url], 1)
        before = served(one), served(two)
        for number in range(3):
            conversation = [{"role": "user", "content": f"Say the number {number}."}]
            client(server).chat.completions.create(model="remote", messages=conversation, max_tokens=2)
        assert served(one) == before[0] and wait_until(lambda: served(two) == before[1] + 3)
        assert admin("DELETE", params={"url": two.url}).status_code == 409  # the last one
        assert admin("DELETE", params={"url": one.url}).status_code == 404  # not a worker any more
        assert "grpc worker added" in server.logs() and "grpc worker removed" in server.logs()


def test_only_a_model_on_grpc_workers_has_workers(local):
    reply = requests.post(local.url + "/admin/models/remote/workers", json={"url": "grpc://h1:1"}, timeout=30)
    assert reply.status_code == 400 and "llama.cpp engine" in reply.json()["error"]["message"]


def test_a_worker_that_is_gone_is_passed_over_with_the_reason_logged(workers, smollm2, tmp_path):
    gone = f"grpc://127.0.0.1:{free_port()}"  # nothing listens there
    with run_server(tmp_path, front_env(smollm2, [gone, workers[0]], policy="round_robin")) as server:
        for _ in range(3):
            reply = client(server).chat.completions.create(model="remote", messages=QUESTION, max_tokens=3)
            assert reply.choices[0].finish_reason == "length"
        assert "grpc worker unreachable" in server.logs()


def test_a_worker_that_never_answers_is_given_up_on(workers, smollm2, tmp_path):
    import socket

    silent = socket.socket()  # accepts connections, says nothing
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    try:
        url = f"grpc://127.0.0.1:{silent.getsockname()[1]}"
        with run_server(tmp_path, front_env(smollm2, [url, workers[1]], policy="round_robin",
                                            connect_timeout=1)) as server:
            for _ in range(2):
                reply = client(server).chat.completions.create(model="remote", messages=QUESTION, max_tokens=3)
                assert reply.choices[0].finish_reason == "length"
    finally:
        silent.close()


def test_a_worker_of_another_model_is_refused_with_the_reason(workers, tiny_model, tmp_path):
    with run_server(tmp_path, front_env(tiny_model, workers), ready="/v1/liveness") as server:
        reply = server.post("/v1/chat/completions", {"model": "remote", "messages": QUESTION})
        assert reply.status_code >= 500 and "serves another model" in reply.text, reply.text


def test_a_worker_busy_past_its_admission_wait_is_a_429(smollm2, tmp_path):
    """The worker's one slot taken (by a call straight to it) past its admission wait: the front's whole answer is
    a 429 with Retry-After, as its own admission's would be."""
    env = {**worker_env(smollm2), "KRONK_ADMISSION_TIMEOUT": "1", "KRONK_QUEUE_DEPTH": "1"}
    with run_grpc_worker(tmp_path / "w", env) as worker, \
            run_server(tmp_path, front_env(smollm2, [worker])) as server:
        options = DecodeOptions(end_ids=frozenset(), max_tokens=2000)
        with grpc.insecure_channel(worker.address) as channel:
            taking = pb_grpc.SglangSchedulerStub(channel).Generate(generate_request([1, 2, 3], options))
            next(taking)  # its first token: the slot is the call's
            reply = server.post("/v1/chat/completions", {"model": "remote", "messages": QUESTION})
            taking.cancel()
        assert reply.status_code == 429 and reply.headers["Retry-After"] == "5", reply.text
        assert reply.json()["error"]["code"] == "model_busy"


def test_a_worker_killed_mid_stream_ends_it_with_an_in_band_error(tiny_model, tmp_path):
    env = faulty_env(tiny_model, KRONK_TEST_STEP_DELAY=0.1, KRONK_TEST_NO_EOS=1)
    with run_grpc_worker(tmp_path / "a", env) as worker, \
            run_server(tmp_path, front_env(tiny_model, [worker])) as server:
        events, got = [], threading.Event()

        def stream():
            with requests.post(server.url + "/v1/chat/completions", stream=True, timeout=120,
                               json={"model": "remote", "messages": QUESTION, "max_tokens": 500,
                                     "stream": True}) as response:
                for line in response.iter_lines():
                    events.append(line)
                    if b'"content":"' in line and b'"content":""' not in line:  # the worker's first tokens
                        got.set()

        reader = threading.Thread(target=stream)
        reader.start()
        assert got.wait(60)
        worker.proc.kill()
        reader.join(60)
        assert not reader.is_alive()
        assert any(b'"error"' in line for line in events), events[-3:]
        assert not server.proc.poll()
        assert "Traceback" not in server.logs()


def test_workers_are_health_checked_between_requests(tiny_model, tmp_path):
    """A worker that was not there when the model loaded is taken in once it answers its health check (its model
    asked then, its slots past the one it was counted as added), and serves; one that goes is taken out by its
    health check, before any request finds it gone."""
    port = free_port()
    late = f"127.0.0.1:{port}"

    def logged(event: str) -> bool:
        return any(entry.get("event") == event and entry.get("worker") == late for entry in server_log(server))

    with run_grpc_worker(tmp_path / "a", faulty_env(tiny_model)) as first, \
            run_server(tmp_path, front_env(tiny_model, [first, late], policy="round_robin",
                                           health_interval=0.2)) as server:
        assert logged("grpc worker unreachable")
        assert model_row(server, "remote")["slots"] == 2  # the worker away counts as one
        with run_grpc_worker(tmp_path / "b", faulty_env(tiny_model, KRONK_PARALLEL=2), port=port) as second:
            wait_until(lambda: logged("grpc worker back"))
            wait_until(lambda: model_row(server, "remote")["slots"] == 3)  # it runs two at once
            for _ in range(4):
                reply = server.post("/v1/chat/completions", {"model": "remote", "messages": QUESTION, "max_tokens": 2})
                assert reply.status_code == 200, reply.text
            assert second.completed() and first.completed()  # round robin again over both
        wait_until(lambda: logged("grpc worker out"))
        served = len(first.completed())
        reply = server.post("/v1/chat/completions", {"model": "remote", "messages": QUESTION, "max_tokens": 2})
        assert reply.status_code == 200 and len(first.completed()) == served + 1
        assert "grpc worker failed" not in server.logs()  # no request was sent to the worker that had gone
        assert "Traceback" not in server.logs()


def server_log(server) -> list[dict]:
    return [json.loads(line) for line in server.logs().splitlines() if line.startswith("{")]
