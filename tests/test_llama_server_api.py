"""llama-server's own API (/completion, /infill, /tokenize, /detokenize, /apply-template, /props, /slots, /health),
answered here as llama-server answers it.

The same file, SmolLM2 with fill-in-the-middle tokens named in its metadata, is served by this server (real
gunicorn, the llama.cpp engine) and by llama-server built from the same llama.cpp source (.ci/run builds it:
KRONK_TEST_LLAMA_SERVER), each with one slot of 2,048 tokens. Each request goes to both, and what they answer
must agree: the tokens, the text, greedy completions token for token, the infill prompt, the fields' shapes.
"""

import concurrent.futures
import json
import os
import re
import time
from pathlib import Path

import pytest
import requests

from kronk_wsgi.engine.gguf_file import Field, read_gguf, write_gguf_copy
from kronk_wsgi.testing import run_llama_server, run_server, wait_until

BINARY = os.environ.get("KRONK_TEST_LLAMA_SERVER")
CONTEXT = 2048
# SmolLM2's vocabulary has no fill-in-the-middle tokens; these unused control tokens play them.
FIM = {"pre": "<issue_start>", "suf": "<issue_comment>", "mid": "<issue_closed>", "rep": "<repo_name>",
       "sep": "<file_sep>"}


@pytest.fixture(scope="module")
def fim_model(smollm2, tmp_path_factory) -> Path:
    """SmolLM2, with its metadata naming fill-in-the-middle tokens (as a coder model's does)."""
    source = read_gguf(smollm2)
    tokens = source.get("tokenizer.ggml.tokens")
    fields = dict(source.fields)
    for role, text in FIM.items():
        fields[f"tokenizer.ggml.fim_{role}_token_id"] = Field(4, tokens.index(text))  # 4: a uint32
    path = tmp_path_factory.mktemp("fim") / "smollm2-fim.gguf"
    write_gguf_copy(source, path, fields, {})
    return path


@pytest.fixture(scope="module")
def ours(fim_model, tmp_path_factory):
    models = {"smollm2": {"path": str(fim_model), "engine": "llama.cpp", "context_length": CONTEXT}}
    with run_server(tmp_path_factory.mktemp("ours"), {"KRONK_MODELS": json.dumps(models)}) as server:
        yield server.url


@pytest.fixture(scope="module")
def theirs(fim_model):
    if not BINARY:
        pytest.skip("llama-server is not built here (.ci/run builds it: KRONK_TEST_LLAMA_SERVER)")
    with run_llama_server(BINARY, fim_model, ["-c", str(CONTEXT), "-np", "1", "-t", "1", "--no-webui", "--jinja",
                                              "--metrics"]) as url:
        yield url


def both(ours: str, theirs: str, path: str, body: dict) -> tuple[dict, dict]:
    answers = []
    for url in (ours, theirs):
        reply = requests.post(url + path, json=body, timeout=120)
        assert reply.status_code == 200, (url, reply.text)
        answers.append(reply.json())
    return answers[0], answers[1]


@pytest.mark.parametrize("body", [
    {"content": "Hello world, how are you?"},
    {"content": "Hello world", "add_special": True},
    {"content": "<|im_start|>user\nhi<|im_end|>", "with_pieces": True},
    {"content": "<|im_start|>user", "parse_special": False},
    {"content": "á ü 日本語 🙂", "with_pieces": True},
    {"content": [1, "Hello", 2, " there"]},
])
def test_tokenize_agrees(ours, theirs, body):
    mine, reference = both(ours, theirs, "/tokenize", body)
    assert mine == reference


def test_detokenize_agrees(ours, theirs):
    tokens = requests.post(ours + "/tokenize", json={"content": "<|im_start|>Hello, wörld!"}, timeout=30).json()
    mine, reference = both(ours, theirs, "/detokenize", tokens)
    assert mine == reference == {"content": "<|im_start|>Hello, wörld!"}


def test_apply_template_agrees(ours, theirs):
    body = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                         {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "And?"}]}
    mine, reference = both(ours, theirs, "/apply-template", body)
    assert mine == reference


GREEDY = {"temperature": 0, "n_predict": 24, "return_tokens": True}


@pytest.mark.parametrize("body", [
    {"prompt": "The capital of France is"},
    {"prompt": [1, "user\nWhat is 2+2?", 2, "\n<|im_start|>assistant\n"]},
    {"prompt": "One, two, three,", "stop": [" six"]},
    {"prompt": "Write a list:\n1.", "n_predict": 5},
])
def test_a_greedy_completion_agrees_token_for_token(ours, theirs, body):
    mine, reference = both(ours, theirs, "/completion", {**GREEDY, **body})
    for key in ("content", "tokens", "stop", "stop_type", "stopping_word", "tokens_predicted", "tokens_evaluated",
                "has_new_line", "truncated", "prompt"):
        assert mine[key] == reference[key], key
    assert mine["timings"]["predicted_n"] == reference["timings"]["predicted_n"]
    assert set(reference["timings"]) <= set(mine["timings"])
    assert mine["generation_settings"]["n_predict"] == reference["generation_settings"]["n_predict"]
    assert mine["generation_settings"]["temperature"] == reference["generation_settings"]["temperature"]


INFILL = {**GREEDY, "input_prefix": "def add(a, b):\n    return ", "input_suffix": "\n\nprint(add(1, 2))\n",
          "prompt": "a"}


def test_an_infill_prompt_is_laid_out_as_llama_server_lays_it_out(ours, theirs):
    """The same layout, but whole: llama-server, with its default settings, keeps the last 2 tokens of the
    repository header (``filename`` and its newline), where this server keeps all of it that fits."""
    mine, reference = both(ours, theirs, "/infill", INFILL)
    assert reference["prompt"].startswith("filename\n<issue_start>")
    assert mine["prompt"] == "<repo_name>myproject\n<file_sep>" + reference["prompt"]


def test_an_infills_extra_files_come_first_in_the_repository_layout(ours):
    files = [{"filename": "util.py", "text": "def sub(a, b):\n    return a - b\n"}, {"text": "X = 1\n"}]
    reply = requests.post(ours + "/infill", json={**INFILL, "input_extra": files}, timeout=60)
    assert reply.status_code == 200
    expected = ("<repo_name>myproject\n<file_sep>util.py\ndef sub(a, b):\n    return a - b\n<file_sep>tmp\nX = 1\n"
                "<file_sep>filename\n<issue_start>def add(a, b):\n    return a<issue_comment>\n\nprint(add(1, 2))\n"
                "<issue_closed>")
    assert reply.json()["prompt"] == expected


def stream(url: str, path: str, body: dict) -> list[dict]:
    with requests.post(url + path, json={**body, "stream": True}, stream=True, timeout=120) as reply:
        assert reply.status_code == 200 and reply.headers["Content-Type"].startswith("text/event-stream")
        return [json.loads(line[6:]) for line in reply.iter_lines(decode_unicode=True) if line.startswith("data: ")]


def test_a_streamed_completion_is_framed_as_llama_server_frames_it(ours, theirs):
    body = {**GREEDY, "prompt": "The capital of France is", "n_probs": 2}
    mine, reference = stream(ours, "/completion", body), stream(theirs, "/completion", body)
    assert "".join(c["content"] for c in mine) == "".join(c["content"] for c in reference)
    assert [t for c in mine for t in c["tokens"]] == [t for c in reference for t in c["tokens"]]
    assert [c["stop"] for c in mine] == [False] * (len(mine) - 1) + [True]
    assert set(reference[-1]) <= set(mine[-1]) and mine[-1]["stop_type"] == reference[-1]["stop_type"]
    assert set(reference[0]) <= set(mine[0])
    mine_probs = [p["id"] for c in mine for p in c.get("completion_probabilities", [])]
    assert mine_probs == [t for c in mine for t in c["tokens"]]


def test_props_and_slots_describe_the_server(ours, theirs):
    mine, reference = (requests.get(url + "/props", timeout=30).json() for url in (ours, theirs))
    assert mine["total_slots"] == reference["total_slots"] == 1
    assert mine["model_path"].endswith(".gguf")
    assert mine["default_generation_settings"]["n_ctx"] == reference["default_generation_settings"]["n_ctx"]
    assert mine["chat_template"] == reference["chat_template"]
    slots = requests.get(ours + "/slots", timeout=30).json()
    assert [s["id"] for s in slots] == [0] and slots[0]["n_ctx"] == CONTEXT and slots[0]["is_processing"] is False
    assert requests.get(ours + "/health", timeout=30).json() == {"status": "ok"}


@pytest.mark.parametrize("body, field", [
    ({"prompt": "x", "mirostat": 2}, "mirostat"),
    ({"prompt": "x", "samplers": ["temperature", "top_k"]}, "samplers"),
    ({"prompt": "x", "id_slot": 3}, "id_slot"),
    ({"prompt": "x", "id_slot": -2}, "id_slot"),
    ({"prompt": [[1, 2], {"multimodal_data": ["AAAA"], "prompt_string": "x"}]}, "multimodal_data"),
    ({"prompt": "x", "n_predict": "many"}, "n_predict"),
    ({"prompt": "x", "logit_bias": [["Hello", "much"]]}, "logit_bias"),
    ({"prompt": "x", "logit_bias": [[1.5, 1.0]]}, "logit_bias"),
    ({"prompt": [5, -1]}, "prompt"),
])
def test_what_cannot_be_honoured_is_refused_in_llama_servers_error_shape(ours, body, field):
    reply = requests.post(ours + "/completion", json=body, timeout=30)
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["code"] == 400 and error["type"] == "invalid_request_error" and field in error["message"]


def test_infill_needs_fill_in_the_middle_tokens(smollm2, tmp_path):
    models = {"smollm2": {"path": str(smollm2), "engine": "llama.cpp", "context_length": CONTEXT}}
    with run_server(tmp_path, {"KRONK_MODELS": json.dumps(models)}) as server:
        reply = requests.post(server.url + "/infill", json={"input_prefix": "a", "input_suffix": "b"}, timeout=30)
    assert reply.status_code == 400 and "fill-in-the-middle" in reply.json()["error"]["message"]


def samples(url: str) -> dict[str, float]:
    """The llamacpp: samples of a /metrics page, by name (one model: one of each)."""
    lines = requests.get(url + "/metrics", timeout=30).text.splitlines()
    return {re.split(r"[{ ]", line)[0]: float(line.rsplit(" ", 1)[1]) for line in lines
            if line.startswith("llamacpp:")}


def test_metrics_carry_llama_servers_names(ours, theirs):
    """Every llamacpp: metric llama-server exports is here (those of speculative decoding aside), counting."""
    requests.post(ours + "/completion", json={**GREEDY, "prompt": "Count: one, two,"}, timeout=60)
    mine, reference = samples(ours), samples(theirs)
    expected = {name for name in reference if not name.startswith("llamacpp:spec_decode")}
    assert expected <= set(mine), expected - set(mine)
    assert mine["llamacpp:prompt_tokens_total"] > 0 and mine["llamacpp:tokens_predicted_total"] > 0
    assert mine["llamacpp:prompt_tokens_cached_total"] >= 0
    assert mine["llamacpp:prompt_seconds_total"] > 0 and mine["llamacpp:tokens_predicted_seconds_total"] > 0
    assert mine["llamacpp:n_decode_total"] >= mine["llamacpp:tokens_predicted_total"]
    assert mine["llamacpp:n_busy_slots_per_decode"] == 1.0  # one slot
    assert mine["llamacpp:n_tokens_max"] > 0 and mine["llamacpp:requests_processing"] == 0


def test_the_router_endpoints_load_and_unload_a_model_after_its_requests(smollm2, tmp_path):
    """GET /models gives each model's status; /models/unload waits for the running request to end (llama-server's
    router aborts it), and /models/sse tells the changes as they happen."""
    models = {"smollm2": {"path": str(smollm2), "engine": "llama.cpp", "context_length": CONTEXT}}
    with run_server(tmp_path, {"KRONK_MODELS": json.dumps(models)}) as server:
        def listed() -> dict:
            data = requests.get(server.url + "/models", timeout=30).json()["data"]
            return {m["id"]: m["status"]["value"] for m in data}

        assert listed() == {"smollm2": "loaded"}
        events = requests.get(server.url + "/models/sse", stream=True, timeout=60)
        lines = events.iter_lines(decode_unicode=True)
        first = json.loads(next(line for line in lines if line.startswith("data: "))[6:])
        assert first == {"model": "smollm2", "event": "model_status", "data": {"status": "loaded"}}
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            running = pool.submit(stream, server.url, "/completion",
                                  {"prompt": "Count to a hundred: 1, 2, 3,", "n_predict": 120, "ignore_eos": True})
            deadline = time.monotonic() + 60
            while requests.get(server.url + "/slots", timeout=30).json()[0]["is_processing"] is False:
                assert time.monotonic() < deadline and not running.done()
                time.sleep(0.05)
            reply = requests.post(server.url + "/models/unload", json={"model": "smollm2"}, timeout=120)
            assert reply.json() == {"success": True}
            chunks = running.result()
        assert chunks[-1]["stop"] is True and chunks[-1]["tokens_predicted"] == 120
        assert listed() == {"smollm2": "unloaded"}
        second = json.loads(next(line for line in lines if line.startswith("data: "))[6:])
        assert second["data"] == {"status": "unloaded"}
        events.close()
        assert requests.post(server.url + "/models/load", json={"model": "smollm2"}, timeout=120).json() == \
            {"success": True}
        assert listed() == {"smollm2": "loaded"}
        reply = requests.post(server.url + "/models/load", json={"model": "nothing"}, timeout=30)
        assert reply.status_code == 404 and reply.json()["error"]["type"] == "not_found_error"


def test_the_count_endpoints_count_what_a_request_would_take(ours, theirs):
    chat = {"model": "smollm2", "messages": [{"role": "system", "content": "Be brief."},
                                             {"role": "user", "content": "Name three colours."}]}
    mine, reference = both(ours, theirs, "/v1/chat/completions/input_tokens", chat)
    assert mine == reference and mine["object"] == "response.input_tokens"
    used = requests.post(ours + "/v1/chat/completions", json={**chat, "max_tokens": 1}, timeout=60).json()
    assert used["usage"]["prompt_tokens"] == mine["input_tokens"]
    without_v1 = requests.post(ours + "/chat/completions", json={**chat, "max_tokens": 1}, timeout=60).json()
    assert without_v1["usage"]["prompt_tokens"] == used["usage"]["prompt_tokens"]  # llama-server's path without /v1
    response = {"model": "smollm2", "instructions": "Be brief.", "input": "Name three colours."}
    counted = requests.post(ours + "/v1/responses/input_tokens", json=response, timeout=60).json()
    used = requests.post(ours + "/v1/responses", json={**response, "max_output_tokens": 16}, timeout=60).json()
    assert counted == {"object": "response.input_tokens", "input_tokens": used["usage"]["input_tokens"]}


def test_a_slot_is_saved_erased_and_restored(smollm2, tmp_path):
    """A slot's state saved to a file, erased, and restored: the same prompt then reads its tokens from the slot
    (tokens_cached, timings.cache_n), and the answer is the same; id_slot puts a request on the slot it names."""
    models = {"smollm2": {"path": str(smollm2), "engine": "llama.cpp", "context_length": CONTEXT}}
    env = {"KRONK_MODELS": json.dumps(models), "KRONK_PARALLEL": "2", "KRONK_SLOT_SAVE_PATH": str(tmp_path / "slots"),
           "KRONK_PROMPT_CACHE_RAM_MB": "0", "KRONK_PROMPT_CACHE_DISK_MB": "0"}
    prompt = {**GREEDY, "prompt": "A long story about a cat who lived in a lighthouse by the sea. " * 8, "id_slot": 1}
    with run_server(tmp_path, env) as server:
        first = server.post("/completion", prompt).json()
        assert first["id_slot"] == 1 and first["timings"]["cache_n"] == 0
        saved = server.post("/slots/1?action=save", {"filename": "cat.bin"}).json()
        assert saved["id_slot"] == 1 and saved["n_saved"] == first["tokens_cached"] and saved["n_written"] > 0
        assert (tmp_path / "slots" / "cat.bin").stat().st_size == saved["n_written"]
        assert server.post("/slots/1?action=erase", {}).json() == {"id_slot": 1, "n_erased": saved["n_saved"]}
        erased = server.post("/completion", prompt).json()
        assert erased["timings"]["cache_n"] == 0
        server.post("/slots/1?action=erase", {})
        restored = server.post("/slots/0?action=restore", {"filename": "cat.bin"}).json()
        assert restored["id_slot"] == 0 and restored["n_restored"] == saved["n_saved"]
        again = server.post("/completion", {**prompt, "id_slot": 0}).json()
        assert again["id_slot"] == 0 and again["timings"]["cache_n"] == first["timings"]["prompt_n"] - 1
        assert again["content"] == first["content"]
        for name in ("../cat.bin", "/etc/passwd", "a/b", ".hidden", ""):
            reply = server.post("/slots/0?action=save", {"filename": name})
            assert reply.status_code == 400 and reply.json()["error"]["type"] == "invalid_request_error", name
        assert server.post("/slots/0?action=restore", {"filename": "none.bin"}).status_code == 404
        (tmp_path / "slots" / "bad.bin").write_bytes(b"kronk_wsgi slot state\n" + (5).to_bytes(8, "little") + b"{oops")
        reply = server.post("/slots/0?action=restore", {"filename": "bad.bin"})
        assert reply.status_code == 400 and "damaged" in reply.json()["error"]["message"]
        assert server.post("/slots/5?action=save", {"filename": "x.bin"}).status_code == 400
        assert server.post("/slots/0?action=fly", {}).status_code == 400
        assert not (tmp_path / "cat.bin").exists()


def test_any_model_name_is_served_by_the_default_model_when_asked(smollm2, tmp_path):
    """With unknown_model "default", a name this server does not know is the default model's, as llama-server
    serving one model takes any name; without it, a 404."""
    models = {"smollm2": {"path": str(smollm2), "engine": "llama.cpp", "context_length": CONTEXT}}
    chat = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    with run_server(tmp_path, {"KRONK_MODELS": json.dumps(models), "KRONK_UNKNOWN_MODEL": "default"}) as server:
        reply = server.post("/v1/chat/completions", chat)
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] >= 1
        def chat_logged():
            return [e for e in server.completed() if e["route"] == "/v1/chat/completions"]

        assert wait_until(chat_logged)[-1]["model"] == "smollm2"  # logged (after the reply) by the model that served it
    with run_server(tmp_path, {"KRONK_MODELS": json.dumps(models)}) as server:
        assert server.post("/v1/chat/completions", chat).status_code == 404


# The sampling a model's author recommends, written into its file as llama.cpp's converter writes it: greedy, so
# that a request silent on sampling gets the same tokens from both servers.
FILE_SAMPLING = {"temp": Field(6, 0.0), "top_k": Field(5, 20), "top_p": Field(6, 0.875), "min_p": Field(6, 0.125),
                 "penalty_repeat": Field(6, 1.0), "xtc_probability": Field(6, 0.0)}


@pytest.fixture(scope="module")
def sampling_model(smollm2, tmp_path_factory) -> Path:
    source = read_gguf(smollm2)
    fields = {**source.fields, **{f"general.sampling.{key}": field for key, field in FILE_SAMPLING.items()}}
    path = tmp_path_factory.mktemp("sampling") / "smollm2-sampling.gguf"
    write_gguf_copy(source, path, fields, {})
    return path


def test_a_models_own_sampling_is_what_a_silent_request_gets(sampling_model, tmp_path):
    """The file's general.sampling values are the defaults, as llama-server reads them: shown in /props, and used
    where a request sets no sampling (greedy here, so both servers write the same tokens); a request's own
    values still win, and a model's setting wins over its file."""
    if not BINARY:
        pytest.skip("llama-server is not built here (.ci/run builds it: KRONK_TEST_LLAMA_SERVER)")
    configured = {"path": str(sampling_model), "engine": "llama.cpp", "context_length": CONTEXT}
    models = {"filed": configured, "set": {**configured, "sampling": {"top_k": 7, "seed": 11}}}
    silent = {"prompt": "The three primary colors are", "n_predict": 12, "return_tokens": True}
    with run_server(tmp_path, {"KRONK_MODELS": json.dumps(models), "KRONK_DEFAULT_MODEL": "filed"}) as server, \
            run_llama_server(BINARY, sampling_model, ["-c", str(CONTEXT), "-np", "1", "-t", "1", "--no-webui"]) as theirs:
        mine, reference = (requests.get(url + "/props", timeout=30).json()["default_generation_settings"]["params"]
                           for url in (server.url, theirs))
        for name in ("temperature", "top_k", "top_p", "min_p", "repeat_penalty"):
            assert mine[name] == pytest.approx(reference[name]), name
        assert (mine["temperature"], mine["top_k"], mine["top_p"]) == (0, 20, 0.875)
        answers = [requests.post(url + "/completion", json=silent, timeout=120).json() for url in (server.url, theirs)]
        assert answers[0]["tokens"] == answers[1]["tokens"] and len(answers[0]["tokens"]) == 12

        def chat(model: str, **fields) -> str:
            body = {"model": model, "messages": [{"role": "user", "content": "Name a color."}], "max_tokens": 16,
                    **fields}
            reply = requests.post(server.url + "/v1/chat/completions", json=body, timeout=120)
            assert reply.status_code == 200, reply.text
            return reply.json()["choices"][0]["message"]["content"]

        assert chat("filed") == chat("filed") == chat("filed", temperature=0)
        assert chat("filed", temperature=1.5, seed=3) != chat("filed")
        props = requests.get(server.url + "/props", params={"model": "set"}, timeout=30).json()
        params = props["default_generation_settings"]["params"]
        assert (params["top_k"], params["temperature"], params["seed"]) == (7, 0, 11)
        shown = requests.post(server.url + "/api/show", json={"model": "set"}, timeout=30).json()["parameters"]
        parameters = dict(line.split(None, 1) for line in shown.splitlines())
        assert (parameters["temperature"], parameters["top_k"], parameters["seed"]) == ("0.0", "7", "11")
