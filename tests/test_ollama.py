"""The Ollama API through real gunicorn on the real SmolLM2, driven by Ollama's own Python client (the version Home
Assistant pins) and by the probe sequences of Open WebUI and Copilot; its flows (keep-alive lines, disconnects,
overload, in-band errors) on the fault-injecting engine."""

import json
import os
import subprocess
import time

import numpy as np
import ollama
import pydantic
import pytest
import requests

from kronk_wsgi.api.protocols.ollama import schemas as ollama_schemas, views as ollama_views
from kronk_wsgi.api.errors import ApiError
from kronk_wsgi.engine.chat_template import fill_in_middle
from kronk_wsgi.engine.sampling import SamplingParams
from kronk_wsgi.engine.gguf_file import ARRAY, STRING, Field, read_gguf, write_gguf_copy
from kronk_wsgi.testing import run_server
from kronk_wsgi.testing.rawhttp import RawStream

from .support.hub import FakeHub
from .support.scripted import run_scripted
from .conftest import metric

REPO = "someone/tiny-GGUF"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def fim_model(smollm2, tmp_path_factory):
    """SmolLM2 with three of its control tokens renamed to StarCoder's fill-in-the-middle markers."""
    source = read_gguf(smollm2)
    tokens = list(source.get("tokenizer.ggml.tokens"))
    for old, new in (("<jupyter_text>", "<fim_prefix>"), ("<jupyter_code>", "<fim_suffix>"),
                     ("<jupyter_output>", "<fim_middle>")):
        tokens[tokens.index(old)] = new
    fields = {**source.fields, "tokenizer.ggml.tokens": Field(ARRAY, tokens, STRING)}
    path = tmp_path_factory.mktemp("fim") / "smollm2-fim.gguf"
    write_gguf_copy(source, path, fields, {})
    return path


@pytest.fixture(scope="module")
def served(smollm2, fim_model, tmp_path_factory):
    models = {"smol": {"path": str(smollm2), "context_length": 2048}, "fim": {"path": str(fim_model), "context_length": 512},
              "scripted": {"path": str(smollm2), "context_length": 512, "engine": "tests.support.scripted:KIND"}}
    with run_scripted(tmp_path_factory.mktemp("ollama"), models, "smol") as server:
        server.client = ollama.Client(host=server.url)
        yield server


def test_the_probes_open_webui_and_copilot_make(served):
    root = requests.get(served.url + "/")
    assert root.status_code == 200 and root.text == "Ollama is running"
    assert requests.head(served.url + "/").status_code == 200
    assert requests.get(served.url + "/api/version").json()["version"]
    listed = requests.get(served.url + "/api/tags").json()["models"]
    names = {m["name"] for m in listed}
    assert {"smol:latest", "scripted:latest", "fim:latest"} <= names
    smol = next(m for m in listed if m["name"] == "smol:latest")
    assert smol["details"]["family"] == "llama" and smol["details"]["quantization_level"] == "Q4_1"
    assert smol["details"]["parameter_size"] == "134.5M" and smol["size"] > 90_000_000
    assert len(smol["digest"]) == 64
    shown = requests.post(served.url + "/api/show", data=json.dumps({"model": "smol:latest"})).json()  # no JSON type
    assert shown["model_info"]["llama.context_length"] > 0  # what Copilot reads as the context window
    assert shown["model_info"]["general.architecture"] == "llama"
    assert set(shown["capabilities"]) == {"completion", "tools", "embedding"}
    assert "<|im_start|>" in shown["template"]
    running = requests.get(served.url + "/api/ps").json()["models"]
    assert [m["name"] for m in running] == ["smol:latest"]  # the default model, loaded at start
    assert running[0]["context_length"] > 0 and running[0]["size"] > 0


def test_list_show_and_ps_with_the_client(served):
    names = [m.model for m in served.client.list().models]
    assert "smol:latest" in names
    shown = served.client.show("smol")
    assert shown.details.family == "llama" and "completion" in shown.capabilities
    assert "insert" in served.client.show("fim").capabilities
    assert served.client.ps().models[0].context_length > 0


def test_chat_whole_and_streamed(served):
    options = {"temperature": 0, "num_predict": 12}
    whole = served.client.chat("smol", messages=ASK, options=options)
    assert whole.done and whole.done_reason in ("stop", "length") and whole.message.content
    assert whole.eval_count == 12 or whole.done_reason == "stop"
    assert whole.prompt_eval_count > 10 and whole.total_duration >= whole.eval_duration > 0
    parts = list(served.client.chat("smol", messages=ASK, options=options, stream=True))
    assert "".join(p.message.content for p in parts) == whole.message.content  # greedy: the same reply
    assert [p.done for p in parts].count(True) == 1 and parts[-1].done
    assert parts[-1].eval_count == whole.eval_count


def test_generate_with_the_template_raw_and_a_system_prompt(served):
    options = {"temperature": 0, "num_predict": 8}
    templated = served.client.generate("smol", "Say hello.", options=options)
    assert templated.response and templated.done
    raw = served.client.generate("smol", "The capital of France is", raw=True, options=options)
    assert raw.response and raw.prompt_eval_count < templated.prompt_eval_count  # no template around it
    system = served.client.generate("smol", "Say hello.", system="Answer in French.", options=options)
    assert system.response != templated.response  # the system message replaced the template's default one


def test_options_are_honoured_and_an_unknown_one_is_named(served):
    capped = served.client.generate("smol", "Count to ten.", options={"num_predict": 3, "temperature": 0})
    assert capped.eval_count == 3 and capped.done_reason == "length"
    seeded = [served.client.generate("smol", "Tell a story.", options={"seed": 7, "num_predict": 10}).response
              for _ in range(2)]
    assert seeded[0] == seeded[1]
    with pytest.raises(ollama.ResponseError) as caught:
        served.client.generate("smol", "Hi", options={"num_predictt": 3})
    assert caught.value.status_code == 400 and "options.num_predictt" in caught.value.error
    with pytest.raises(ollama.ResponseError) as caught:
        served.client.generate("smol", "Hi", options={"mirostat": 2})
    assert caught.value.status_code == 400 and "mirostat" in caught.value.error
    with pytest.raises(ollama.ResponseError) as caught:
        served.client.generate("smol", "Hi", options={"num_ctx": 10**6})
    assert caught.value.status_code == 400 and "num_ctx" in caught.value.error


def test_num_ctx_smaller_than_the_model_bounds_the_prompt(served):
    with pytest.raises(ollama.ResponseError) as caught:
        served.client.generate("smol", "word " * 100, raw=True, options={"num_ctx": 32})
    assert caught.value.status_code == 400 and "32" in caught.value.error
    fits = served.client.generate("smol", "Hello", raw=True, options={"num_ctx": 32, "temperature": 0})
    assert fits.prompt_eval_count + fits.eval_count <= 32


def test_tool_calls_arrive_with_arguments_as_an_object(served):
    served.say('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
    reply = served.client.chat("scripted", messages=ASK, tools=[WEATHER])
    (call,) = reply.message.tool_calls
    assert call.function.name == "get_weather" and call.function.arguments == {"city": "Paris"}
    served.say('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
    streamed = [c for part in served.client.chat("scripted", messages=ASK, tools=[WEATHER], stream=True)
                for c in part.message.tool_calls or ()]
    assert [c.function.arguments for c in streamed] == [{"city": "Paris"}]
    served.say("It is sunny in Paris.")
    history = ASK + [{"role": "assistant", "content": "", "tool_calls": [{"function": {
        "name": "get_weather", "arguments": {"city": "Paris"}}}]}, {"role": "tool", "content": "sunny",
                                                                   "tool_name": "get_weather"}]
    answered = served.client.chat("scripted", messages=history, tools=[WEATHER])
    assert answered.message.content == "It is sunny in Paris."


def test_format_with_a_json_schema_constrains_the_reply(served):
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "sunny": {"type": "boolean"}},
              "required": ["city", "sunny"]}
    reply = served.client.chat("smol", messages=ASK, format=schema, options={"temperature": 0, "num_predict": 60})
    if reply.done_reason == "stop":
        answer = json.loads(reply.message.content)
        assert isinstance(answer["city"], str) and isinstance(answer["sunny"], bool)
    else:
        assert reply.message.content.startswith("{")
    as_json = served.client.generate("smol", "A JSON object about Paris:", format="json",
                                     options={"temperature": 0, "num_predict": 40})
    assert as_json.response.lstrip().startswith("{")


def test_think_on_a_model_without_thinking_is_refused(served):
    with pytest.raises(ollama.ResponseError) as caught:
        served.client.chat("smol", messages=ASK, think=True)
    assert caught.value.status_code == 400 and "thinking" in caught.value.error
    assert served.client.chat("smol", messages=ASK, think=False, options={"num_predict": 2}).done


def test_suffix_fills_in_the_middle_where_the_vocabulary_can(served):
    filled = served.client.generate("fim", "def add(a, b):\n    ", suffix="\n    return c\n",
                                    options={"temperature": 0, "num_predict": 8})
    assert filled.done and filled.prompt_eval_count > 5
    with pytest.raises(ollama.ResponseError) as caught:
        served.client.generate("smol", "def add(a, b):", suffix="return c")
    assert caught.value.status_code == 400 and "insert" in caught.value.error


def test_embed_and_the_older_embeddings(served):
    embedded = served.client.embed("smol", ["The sky is blue.", "Grass is green."])
    assert len(embedded.embeddings) == 2 and embedded.prompt_eval_count > 4
    assert abs(np.linalg.norm(embedded.embeddings[0]) - 1) < 1e-3
    single = served.client.embed("smol", "The sky is blue.")
    assert np.allclose(single.embeddings[0], embedded.embeddings[0], atol=1e-4)
    older = served.client.embeddings("smol", "The sky is blue.")
    assert np.allclose(older.embedding, embedded.embeddings[0], atol=1e-4)
    long = "word " * 1000  # "fim" has a context of 512
    assert len(served.client.embed("fim", long).embeddings) == 1  # truncated to the context, as Ollama does
    with pytest.raises(ollama.ResponseError) as caught:
        served.client.embed("fim", long, truncate=False)
    assert caught.value.status_code == 400


def test_unknown_models_images_and_ollamas_own_formats_are_clear_errors(served):
    with pytest.raises(ollama.ResponseError) as caught:
        served.client.chat("llama3.2", messages=ASK)
    assert caught.value.status_code == 404 and "llama3.2" in caught.value.error
    with pytest.raises(ollama.ResponseError) as caught:
        served.client.chat("smol", messages=[{**ASK[0], "images": ["aGVsbG8="]}])
    assert caught.value.status_code == 400 and "reads text only" in caught.value.error
    created = requests.post(served.url + "/api/create", json={"model": "x", "from": "smol"})
    assert created.status_code == 400 and "/api/create" in created.json()["error"]
    unknown = requests.get(served.url + "/api/nothing")
    assert unknown.status_code == 404 and set(unknown.json()) == {"error"}
    broken = requests.post(served.url + "/api/chat", data=b"{not json")
    assert broken.status_code == 400 and set(broken.json()) == {"error"}
    assert "Traceback" not in served.logs()


def test_keep_alive_zero_unloads_and_an_empty_request_loads(served):
    def running() -> list[str]:
        return [m.name for m in served.client.ps().models]

    loaded = served.client.generate("fim", "")
    assert loaded.done and loaded.done_reason == "load" and "fim:latest" in running()
    served.client.generate("fim", "Hi", keep_alive=0, options={"num_predict": 2})
    deadline = time.monotonic() + 30
    while "fim:latest" in running():
        assert time.monotonic() < deadline
        time.sleep(0.2)
    served.client.chat("fim", messages=[], keep_alive="10m")
    expires = next(m.expires_at for m in served.client.ps().models if m.name == "fim:latest")
    assert 500 < expires.timestamp() - time.time() <= 600
    unloaded = served.client.chat("fim", messages=[], keep_alive=0)
    assert unloaded.done_reason == "unload" and "fim:latest" not in running()
    with pytest.raises(ollama.ResponseError) as caught:
        served.client.generate("smol", "Hi", keep_alive="soon")
    assert caught.value.status_code == 400 and "keep_alive" in caught.value.error


@pytest.fixture
def hubbed(tiny_model, tmp_path):
    with FakeHub() as fake:
        fake.add_file(REPO, tiny_model, "tiny.Q8_0.gguf")
        env = {"HF_ENDPOINT": fake.url, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_DISABLE_TELEMETRY": "1",
               "KRONK_MODELS": f"local={tiny_model}"}
        with run_server(tmp_path, env) as server:
            server.client = ollama.Client(host=server.url)
            yield server


def test_pull_from_the_hub_then_chat_list_copy_and_delete(hubbed):
    name = f"hf.co/{REPO}:Q8_0"
    statuses = [p.status for p in hubbed.client.pull(name, stream=True)]
    assert statuses[0] == "pulling manifest" and statuses[-1] == "success"
    assert any(s.startswith("pulling ") and s != "pulling manifest" for s in statuses)
    assert name in [m.model for m in hubbed.client.list().models]
    reply = hubbed.client.generate(name, "Hello", options={"num_predict": 3})
    assert reply.done and reply.eval_count == 3
    hubbed.client.copy(name, "tiny-alias")
    assert hubbed.client.generate("tiny-alias", "Hello", options={"num_predict": 2}).done
    hubbed.client.delete("tiny-alias")
    with pytest.raises(ollama.ResponseError):
        hubbed.client.generate("tiny-alias", "Hello")
    hubbed.client.generate(name, "", keep_alive=0)  # unloaded, so that its file may go
    deadline = time.monotonic() + 30
    while name in [m.name for m in hubbed.client.ps().models]:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    hubbed.client.delete(name)
    assert name not in [m.model for m in hubbed.client.list().models]
    with pytest.raises(ollama.ResponseError) as caught:
        hubbed.client.pull("llama3.2")
    assert caught.value.status_code == 400 and "hf.co" in caught.value.error
    with pytest.raises(ollama.ResponseError) as caught:
        hubbed.client.delete("local")
    assert caught.value.status_code == 400 and "configuration" in caught.value.error


def chat_stream(server, tokens: int) -> RawStream:
    return RawStream(server.host, server.port, "/api/chat",
                     {"model": "tiny", "messages": ASK, "options": {"num_predict": tokens}})


def test_keep_alive_lines_parse_as_empty_deltas(slow):
    raw = chat_stream(slow, 3)
    lines = [json.loads(line) for _, line in raw.frames("\n")]
    raw.close()
    assert raw.headers["content-type"].startswith("application/x-ndjson")
    texts = [i for i, line in enumerate(lines) if line.get("message", {}).get("content")]
    assert len(texts) == 3
    between = lines[texts[0] + 1:texts[1]]
    assert between and all(line["message"]["content"] == "" and line["done"] is False for line in between)
    assert lines[-1]["done"] is True and lines[-1]["eval_count"] == 3


def test_a_client_gone_frees_the_place_and_overload_is_429(slow):
    raw = chat_stream(slow, 500)  # 150 s of generation unless the hang-up stops it
    for _, line in raw.frames("\n"):
        if json.loads(line)["message"]["content"]:
            break
    busy = requests.post(slow.url + "/api/chat", json={"model": "tiny", "messages": ASK, "stream": False}, timeout=60)
    assert busy.status_code == 429 and int(busy.headers["Retry-After"]) >= 1 and set(busy.json()) == {"error"}
    raw.close()
    reply = requests.post(slow.url + "/api/generate", json={"model": "tiny", "prompt": "Hi", "stream": False,
                                                           "options": {"num_predict": 1}}, timeout=60)
    assert reply.status_code == 200 and reply.json()["eval_count"] == 1
    assert metric(slow, "kronk_active_generations", model="tiny") == 0
    assert metric(slow, "kronk_requests_total", route="/api/chat", model="tiny", status="200",
                  outcome="client_gone") >= 1


def test_an_engine_failure_after_the_first_line_is_one_more_line(failing):
    client = ollama.Client(host=failing.url)
    parts = []
    with pytest.raises(ollama.ResponseError) as caught:
        for part in client.chat("tiny", messages=ASK, stream=True):
            parts.append(part)
    assert parts and "failed while generating" in caught.value.error
    raw = chat_stream(failing, 50)
    last = json.loads(list(raw.frames("\n"))[-1][1])
    raw.close()
    assert last["done"] is True and "error" in last and "injected" not in json.dumps(last)
    whole = requests.post(failing.url + "/api/chat", json={"model": "tiny", "messages": ASK, "stream": False})
    assert whole.status_code == 500 and set(whole.json()) == {"error"}


# -- the module's logic on its own, no server --------------------------------------------------------------------

@pytest.mark.parametrize("given, seconds", [
    (None, None), (0, 0.0), (300, 300.0), (-1, -1.0), ("10", 10.0), ("5m", 300.0), ("1h30m", 5400.0),
    ("1.5s", 1.5), ("300ms", 0.3), ("-1m", -60.0), ("24h", 86400.0),
])
def test_keep_alive_durations(given, seconds):
    assert ollama_views.keep_alive_seconds(given) == seconds


@pytest.mark.parametrize("given", ["soon", "5 minutes", "m5", "", "1d"])
def test_keep_alive_that_is_no_duration_is_a_400(given):
    with pytest.raises(ApiError) as caught:
        ollama_views.keep_alive_seconds(given)
    assert caught.value.status == 400 and caught.value.param == "keep_alive"


def test_options_take_ollamas_defaults_and_names():
    assert ollama_views.sampling(ollama_schemas.Options()) == SamplingParams(
        temperature=0.8, top_p=0.9, top_k=40, repetition_penalty=1.1, repetition_window=64)
    given = ollama_views.sampling(ollama_schemas.Options(temperature=0, top_k=0, repeat_last_n=0, repeat_penalty=1.0,
                                                   seed=3, min_p=0.05))
    assert (given.temperature, given.top_k, given.repetition_window, given.seed, given.min_p) == (0, 0, 0, 3, 0.05)
    assert ollama_views.sampling(ollama_schemas.Options(repeat_last_n=-1)).repetition_window > 10**6
    for field, value in (("mirostat", 1), ("typical_p", 0.5), ("tfs_z", 0.9), ("num_predict", 0)):
        with pytest.raises(pydantic.ValidationError):
            ollama_schemas.Options(**{field: value})
    ollama_schemas.Options(mirostat=0, typical_p=1.0, tfs_z=1, num_predict=-2, num_gpu=99, num_thread=8)


def test_fill_in_the_middle_markers():
    starcoder = {"<fim_prefix>", "<fim_suffix>", "<fim_middle>", "<|endoftext|>"}
    assert fill_in_middle(starcoder, "a(", ")") == "<fim_prefix>a(<fim_suffix>)<fim_middle>"
    qwen = {"<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"}
    assert fill_in_middle(qwen, "x", "y") == "<|fim_prefix|>x<|fim_suffix|>y<|fim_middle|>"
    assert fill_in_middle({"<fim_prefix>", "<fim_suffix>"}, "x", "y") is None


NODE_MODULES = os.environ.get("KRONK_TEST_NODE_MODULES", "")
JS_CLIENT = """
const { Ollama } = require('ollama');
(async () => {
  const client = new Ollama({ host: process.env.HOST });
  const listed = await client.list();
  const parts = [];
  for await (const part of await client.chat({ model: 'smol', messages: [{ role: 'user', content: 'Hi' }],
                                              stream: true, options: { num_predict: 5, temperature: 0 } })) {
    parts.push(part);
  }
  const generated = await client.generate({ model: 'smol', prompt: 'Hi', options: { num_predict: 3 } });
  const embedded = await client.embed({ model: 'smol', input: ['a', 'b'] });
  let missing = null;
  try { await client.chat({ model: 'nope', messages: [{ role: 'user', content: 'Hi' }] }); }
  catch (error) { missing = { status: error.status_code, message: error.error }; }
  console.log(JSON.stringify({ names: listed.models.map(m => m.name), parts, generated, vectors: embedded.embeddings.length,
                               missing }));
})().catch(error => { console.error(error); process.exit(1); });
"""


@pytest.mark.skipif(not NODE_MODULES and not os.environ.get("KRONK_TEST_REQUIRE_NPM"),
                    reason="Ollama's JavaScript client is not installed (KRONK_TEST_NODE_MODULES)")
def test_ollamas_javascript_client(served):
    ran = subprocess.run(["node", "-e", JS_CLIENT], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "NODE_PATH": NODE_MODULES, "HOST": served.url})
    assert ran.returncode == 0, ran.stderr
    seen = json.loads(ran.stdout)
    assert "smol:latest" in seen["names"]
    assert seen["parts"][-1]["done"] and seen["parts"][-1]["eval_count"] == 5
    assert "".join(p["message"]["content"] for p in seen["parts"])
    assert seen["generated"]["done"] and seen["generated"]["eval_count"] == 3
    assert seen["vectors"] == 2
    assert seen["missing"] == {"status": 404, "message": "model 'nope' not found, try pulling it first"}


def test_names_resolve_exactly_and_never_shadow_or_delete_a_configured_model(tiny_model, tmp_path):
    with FakeHub() as fake:
        fake.add_file(REPO, tiny_model, "tiny.Q8_0.gguf")
        models = json.dumps({"local": {"path": str(tiny_model)}, "hubbed": {"repo_id": REPO, "quant": "Q8_0"}})
        env = {"HF_ENDPOINT": fake.url, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_DISABLE_TELEMETRY": "1",
               "KRONK_MODELS": models, "KRONK_DEFAULT_MODEL": "local"}
        with run_server(tmp_path, env) as server:
            client = ollama.Client(host=server.url)
            assert [p.status for p in client.pull(f"hf.co/{REPO}:Q8_0", stream=True)][-1] == "success"
            listed = len(requests.get(server.url + "/v1/models", timeout=30).json()["data"])
            for variant in (f"hf.co/{REPO}:q8_0", f"hf.co/{REPO}:Q8_0"):  # the file the configured model serves
                with pytest.raises(ollama.ResponseError) as caught:
                    client.delete(variant)
                assert caught.value.status_code == 400 and "configuration" in caught.value.error
            assert client.generate("hubbed", "Hello", options={"num_predict": 2}).done
            for name in ("local:latest", "LOCAL", f"hf.co/{REPO}:q8_0"):
                with pytest.raises(ollama.ResponseError) as caught:
                    client.copy("local", name)
                assert caught.value.status_code == 400
            for made_up in (f"hf.co/{REPO}:tInY", f"hf.co/{REPO}:Q8", f"hf.co/{REPO}:gguf"):
                with pytest.raises(ollama.ResponseError) as caught:
                    client.show(made_up)
                assert caught.value.status_code == 404
            assert len(requests.get(server.url + "/v1/models", timeout=30).json()["data"]) == listed
            assert client.show("local:LATEST").details is not None  # a tag is case-insensitive, as Ollama has it
