"""Images in: a demo model and its LLaVA-style projector (random weights, `kronk-wsgi make-demo-model --vision`) on
the llama.cpp engine, with llama.cpp's mtmd library.

The engine against itself (an image's tokens, the prompt cache with images), against llama-server built from
llama.cpp's source on the same two files (the same prompt token count and greedy tokens for the same image), and
every protocol through real gunicorn, bad input included.
"""

import base64
import http.server
import json
import os
import subprocess
import sys
import threading

import anthropic
import pytest
import requests
from openai import OpenAI

from kronk_wsgi.engine import llamacpp_engine
from kronk_wsgi.engine.base import MediaError
from kronk_wsgi.engine.demo_model import PROJECTOR, write_demo_vision
from kronk_wsgi.engine.generate import DecodeOptions, Generation
from kronk_wsgi.engine.prompt_cache import PromptCache
from kronk_wsgi.engine.sampling import SamplingParams
from kronk_wsgi.testing import run_llama_server
from kronk_wsgi.testing.media_files import png, wav

from .conftest import run_server
from .support.hub import FakeHub

if not llamacpp_engine.available() or llamacpp_engine.mtmd_cpp is None:
    if os.environ.get("KRONK_TEST_REQUIRE_LLAMACPP") == "1":
        raise RuntimeError("llama-cpp-python with its mtmd library is required (KRONK_TEST_REQUIRE_LLAMACPP=1)")
    pytest.skip("llama-cpp-python with mtmd is not installed (pip install 'kronk_wsgi[llamacpp]')",
                allow_module_level=True)

BINARY = os.environ.get("KRONK_TEST_LLAMA_SERVER")
CONTEXT = 2048
RED, NOISE, OTHER = png(40, 30), png(40, 30, noise_seed=3), png(64, 48, noise_seed=4)


def data_url(image: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(image).decode()


def b64(image: bytes) -> str:
    return base64.b64encode(image).decode()


@pytest.fixture(scope="module")
def vision(tmp_path_factory):
    """The demo model and its projector, as the CLI writes them."""
    folder = tmp_path_factory.mktemp("vision")
    written = subprocess.run([sys.executable, "-m", "kronk_wsgi.cli", "make-demo-model", "--vision", str(folder)],
                             capture_output=True, text=True, check=True).stdout.splitlines()
    assert written[:2] == [str(p) for p in write_demo_vision(folder)]  # the same files again
    return tuple(map(type(folder), written[:2]))


@pytest.fixture(scope="module")
def engine(vision):
    """The pair on the engine, one slot; its prompt cache in RAM."""
    model, projector = vision
    options = llamacpp_engine.LlamaCppOptions(mmproj=str(projector))
    loaded = llamacpp_engine.LlamaCppEngine("vision", model, 512, options)
    slot, = loaded.new_slots(1, 1)
    slot.state_cache = PromptCache(loaded.state_identity(), 64 * 1024 * 1024, None, 0)
    yield loaded, slot
    loaded.close()


def greedy(engine, slot, prompt, tokens=8):
    options = DecodeOptions(max_tokens=tokens, sampling=SamplingParams(temperature=0), end_ids=frozenset())
    generation = Generation(slot, prompt, engine.tokenizer, options, engine.context_length)
    return generation, "".join(generation)


def test_an_image_is_the_projectors_tokens(engine):
    engine, _ = engine
    assert engine.modalities == {"image"}
    media = engine.media(NOISE)
    assert media.kind == "image" and len(media.tokens) == PROJECTOR.tokens and all(t < 0 for t in media.tokens)
    assert engine.media(NOISE).tokens == media.tokens  # the same image, the same placeholders
    assert not set(engine.media(OTHER).tokens) & set(media.tokens)
    with pytest.raises(MediaError, match="does not decode"):
        engine.media(b"\x89PNG but not really")


def test_an_image_steers_the_reply_and_the_cache_never_mixes_two(engine):
    engine, slot = engine
    tokenizer = engine.tokenizer
    # Long enough on both sides of the image that the slot saves what it holds before another prompt overwrites it.
    head, tail = tokenizer.prompt("hello the " * 40), tokenizer.encode(" model server and the token stream" * 10)
    first = [*head, *engine.media(NOISE).tokens, *tail]
    second = [*head, *engine.media(OTHER).tokens, *tail]
    one, one_text = greedy(engine, slot, first)
    two, two_text = greedy(engine, slot, second)
    assert two.cached_tokens == len(head)  # the other image parts from the first at its first token
    again, again_text = greedy(engine, slot, first)
    assert again_text == one_text != two_text
    assert again.cached_tokens == len(first) - 1  # restored with its image, from the state saved before the other
    assert one.completion_tokens == two.completion_tokens == 8


@pytest.fixture(scope="module")
def server(vision, tmp_path_factory):
    """The pair through real gunicorn, beside the demo model alone (text only)."""
    model, projector = vision
    models = {"vision": {"path": str(model), "mmproj": str(projector), "context_length": CONTEXT},
              "text": {"path": str(model), "engine": "llama.cpp", "context_length": CONTEXT}}
    with run_server(tmp_path_factory.mktemp("vision-server"), {"KRONK_MODELS": json.dumps(models),
                                                              "KRONK_DEFAULT_MODEL": "vision"}) as running:
        yield running


@pytest.fixture(scope="module")
def theirs(vision):
    if not BINARY:
        pytest.skip("llama-server is not built here (.ci/run builds it: KRONK_TEST_LLAMA_SERVER)")
    model, projector = vision
    os.environ.setdefault("LLAMA_MEDIA_MARKER", "<__media__>")  # llama-server's marker is random otherwise
    with run_llama_server(BINARY, model, ["--mmproj", str(projector), "-c", str(CONTEXT), "-np", "1", "-t", "1",
                                          "--no-webui", "--no-warmup"]) as url:
        yield url


@pytest.mark.parametrize("image", [NOISE, OTHER], ids=["noise", "other"])
def test_the_same_tokens_as_llama_server_for_the_same_image(server, theirs, image):
    body = {"prompt": {"prompt_string": "hello the <__media__> model server", "multimodal_data": [b64(image)]},
            "n_predict": 12, "temperature": 0, "return_tokens": True, "cache_prompt": False}
    mine, reference = (requests.post(url + "/completion", json=body, timeout=120).json()
                       for url in (server.url, theirs))
    assert mine["tokens_evaluated"] == reference["tokens_evaluated"] > PROJECTOR.tokens
    assert mine["tokens"] == reference["tokens"] and len(mine["tokens"]) == 12


def test_every_protocol_takes_an_image(server):
    openai = OpenAI(base_url=server.url + "/v1", api_key="unused")
    chat = openai.chat.completions.create(model="vision", max_tokens=6, temperature=0, messages=[
        {"role": "user", "content": [{"type": "text", "text": "what is this?"},
                                     {"type": "image_url", "image_url": {"url": data_url(NOISE), "detail": "low"}}]}])
    image_tokens = PROJECTOR.tokens
    text_only = openai.chat.completions.create(model="vision", max_tokens=6, temperature=0, messages=[
        {"role": "user", "content": "what is this?"}])
    # The text after an image is tokenized apart from the text before it, as llama-server does: a token or two more.
    assert image_tokens <= chat.usage.prompt_tokens - text_only.usage.prompt_tokens <= image_tokens + 2
    assert chat.choices[0].message.content != text_only.choices[0].message.content
    streamed = openai.chat.completions.create(model="vision", max_tokens=6, temperature=0, stream=True, messages=[
        {"role": "user", "content": [{"type": "text", "text": "what is this?"},
                                     {"type": "image_url", "image_url": {"url": data_url(NOISE)}}]}])
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == chat.choices[0].message.content

    response = openai.responses.create(model="vision", max_output_tokens=6, temperature=0, input=[
        {"role": "user", "content": [{"type": "input_text", "text": "what is this?"},
                                     {"type": "input_image", "image_url": data_url(NOISE), "detail": "auto"}]}])
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    follow = openai.responses.create(model="vision", max_output_tokens=4, previous_response_id=response.id,
                                     input="and now?")
    assert follow.usage.input_tokens_details.cached_tokens > response.usage.input_tokens  # the image's state too

    claude = anthropic.Anthropic(base_url=server.url, api_key="unused")
    content = [{"type": "text", "text": "what is this?"},
               {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64(NOISE)}}]
    message = claude.messages.create(model="vision", max_tokens=6, extra_body={"temperature": 0},
                                     messages=[{"role": "user", "content": content}])
    counted = claude.messages.count_tokens(model="vision", messages=[{"role": "user", "content": content}])
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == counted.input_tokens
    shot = claude.messages.create(model="vision", max_tokens=6, tools=[
        {"name": "screenshot", "input_schema": {"type": "object"}}], messages=[
        {"role": "user", "content": "look"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "screenshot", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [content[1]]}]}])
    assert shot.usage.output_tokens >= 1

    ollama = requests.post(server.url + "/api/chat", timeout=60, json={
        "model": "vision", "stream": False, "options": {"num_predict": 4},
        "messages": [{"role": "user", "content": "what is this?", "images": [b64(NOISE)]}]}).json()
    assert ollama["prompt_eval_count"] > image_tokens
    generated = requests.post(server.url + "/api/generate", timeout=60, json={
        "model": "vision", "stream": False, "prompt": "what is this?", "images": [b64(NOISE)],
        "options": {"num_predict": 4}}).json()
    assert generated["prompt_eval_count"] == ollama["prompt_eval_count"]


def test_where_clients_look_the_model_takes_images(server):
    listed = {m["id"]: m for m in requests.get(server.url + "/v1/models", timeout=30).json()["data"]}
    assert listed["vision"]["architecture"]["input_modalities"] == ["text", "image"]
    assert listed["text"]["architecture"]["input_modalities"] == ["text"]
    props = requests.get(server.url + "/props", timeout=30).json()
    assert props["modalities"] == {"vision": True, "audio": False} and props["media_marker"] == "<__media__>"
    shown = requests.post(server.url + "/api/show", json={"model": "vision"}, timeout=30).json()
    assert "vision" in shown["capabilities"]
    info = anthropic.Anthropic(base_url=server.url, api_key="unused").models.retrieve("vision")
    assert info.capabilities.image_input.supported


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {"model": "text", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(RED)}}]}]}, "messages[0].content[0]"),
    ("/v1/chat/completions", {"model": "vision", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(b"not an image at all")}}]}]}, "messages[0].content[0]"),
    ("/v1/chat/completions", {"model": "vision", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://169.254.169.254/latest"}}]}]},
     "messages[0].content[0].image_url"),
    ("/v1/chat/completions", {"model": "vision", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}]}]},
     "messages[0].content[0].image_url"),
    ("/v1/chat/completions", {"model": "vision", "messages": [{"role": "user", "content": [
        {"type": "file", "file": {"file_id": "file-1"}}]}]}, "messages[0].content[0].file"),
    ("/v1/chat/completions", {"model": "vision", "messages": [{"role": "assistant", "content": [
        {"type": "image_url", "image_url": {"url": data_url(RED)}}]}]}, "messages[0]"),
    ("/v1/chat/completions", {"model": "vision", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(png(8, 8, noise_seed=i))}} for i in range(33)]}]},
     "messages[0].content[32]"),
    ("/v1/chat/completions", {"model": "vision", "messages": [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": b64(wav()), "format": "wav"}}]}]}, "messages[0].content[0]"),
    ("/v1/responses", {"model": "vision", "input": [{"role": "user", "content": [
        {"type": "input_image", "file_id": "file-1"}]}]}, "input[0].content[0]"),
    ("/api/chat", {"model": "vision", "messages": [{"role": "user", "content": "hi", "images": ["@@@"]}]},
     None),
    ("/completion", {"prompt": {"prompt_string": "no marker", "multimodal_data": [b64(RED)]}}, None),
])
def test_bad_images_are_400s_naming_the_part(server, path, body, param):
    reply = requests.post(server.url + path, json=body, timeout=60)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    if param is not None:
        assert error["param"] == param, error
    assert "Traceback" not in reply.text and "Traceback" not in server.logs()


def test_an_anthropic_image_by_url_or_file_is_refused(server):
    claude = anthropic.Anthropic(base_url=server.url, api_key="unused")
    for source in ({"type": "url", "url": "https://example.com/cat.png"}, {"type": "file", "file_id": "file_1"}):
        with pytest.raises(anthropic.BadRequestError, match="fetches only the URLs its media_allow setting allows|no Files API"):
            claude.messages.create(model="vision", max_tokens=4, messages=[
                {"role": "user", "content": [{"type": "image", "source": source}]}])


def test_an_image_that_does_not_fit_the_context(vision, tmp_path):
    model, projector = vision
    models = {"small": {"path": str(model), "mmproj": str(projector), "context_length": 24}}
    with run_server(tmp_path, {"KRONK_MODELS": json.dumps(models)}) as small:
        reply = requests.post(small.url + "/v1/chat/completions", timeout=60, json={"model": "small", "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(NOISE)}}]}]})
        assert reply.status_code == 400 and reply.json()["error"]["code"] == "context_length_exceeded", reply.text


def test_a_hub_repository_s_projector_comes_with_its_model(vision, tmp_path):
    model, projector = vision
    repo = "someone/tiny-vision-GGUF"
    with FakeHub() as fake:
        fake.add_file(repo, model, "tiny-vision.Q8_0.gguf")
        fake.add_file(repo, projector, "mmproj-tiny-vision-f16.gguf")
        env = {"HF_ENDPOINT": fake.url, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_DISABLE_TELEMETRY": "1"}
        pulled = subprocess.run([sys.executable, "-m", "kronk_wsgi.cli", "pull", repo], capture_output=True,
                                text=True, timeout=120, env={**os.environ, **env})
        assert pulled.returncode == 0, pulled.stderr
        assert [line.rsplit("/", 1)[-1] for line in pulled.stdout.split()] == [
            "tiny-vision.Q8_0.gguf", "mmproj-tiny-vision-f16.gguf"]  # the model named alone: the projector is none
        models = {"seeing": {"repo_id": repo, "context_length": CONTEXT},
                  "blind": {"repo_id": repo, "mmproj": "none", "context_length": CONTEXT}}
        offline = {**env, "HF_HUB_OFFLINE": "1", "HF_ENDPOINT": "http://127.0.0.1:9",
                   "KRONK_MODELS": json.dumps(models), "KRONK_DEFAULT_MODEL": "seeing"}
        with run_server(tmp_path, offline) as server:
            listed = {m["id"]: m for m in requests.get(server.url + "/v1/models", timeout=30).json()["data"]}
            assert listed["seeing"]["architecture"]["input_modalities"] == ["text", "image"]
            image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(NOISE)}}]}]
            seen = server.post("/v1/chat/completions", {"model": "seeing", "messages": image, "max_tokens": 2})
            assert seen.status_code == 200 and seen.json()["usage"]["prompt_tokens"] > PROJECTOR.tokens
            refused = server.post("/v1/chat/completions", {"model": "blind", "messages": image, "max_tokens": 2})
            assert refused.status_code == 400 and "reads text only" in refused.json()["error"]["message"]


def test_tokenize_counts_an_image_as_its_tokens(server):
    message = {"role": "user", "content": [{"type": "text", "text": "what is this?"},
                                           {"type": "image_url", "image_url": {"url": data_url(NOISE)}}]}
    counted = server.post("/v1/tokenize", {"model": "vision", "messages": [message]}).json()
    chat = server.post("/v1/chat/completions", {"model": "vision", "messages": [message], "max_tokens": 1}).json()
    assert counted["count"] == chat["usage"]["prompt_tokens"]


@pytest.fixture(scope="module")
def pictures():
    """A local web server: /noise.png, /away (a redirect to it), anything else 404."""
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path == "/noise.png":
                self.send_response(200)
                self.send_header("Content-Length", str(len(NOISE)))
                self.end_headers()
                self.wfile.write(NOISE)
            elif self.path == "/away":
                self.send_response(302)
                self.send_header("Location", "/noise.png")
                self.end_headers()
            else:
                self.send_error(404)

        def log_message(self, *args):
            pass

    web = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=web.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{web.server_port}"
    web.shutdown()


def test_an_image_by_url_only_from_where_the_operator_allows(vision, pictures, tmp_path):
    model, projector = vision
    models = {"vision": {"path": str(model), "mmproj": str(projector), "context_length": CONTEXT}}
    env = {"KRONK_MODELS": json.dumps(models), "KRONK_MEDIA_ALLOW": pictures + "/"}
    with run_server(tmp_path, env) as allowing:
        def ask(url):
            return allowing.post("/v1/chat/completions", {"model": "vision", "max_tokens": 1, "messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]})

        fetched, sent = ask(pictures + "/noise.png"), ask(data_url(NOISE))
        assert fetched.status_code == 200 and fetched.json()["usage"]["prompt_tokens"] == \
            sent.json()["usage"]["prompt_tokens"]
        assert sent.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == \
            sent.json()["usage"]["prompt_tokens"] - 1  # the same image, by its bytes: its state is reused
        claude = anthropic.Anthropic(base_url=allowing.url, api_key="unused").messages.create(
            model="vision", max_tokens=1, messages=[{"role": "user", "content": [
                {"type": "image", "source": {"type": "url", "url": pictures + "/noise.png"}}]}])
        assert claude.usage.input_tokens + claude.usage.cache_read_input_tokens == sent.json()["usage"]["prompt_tokens"]
        for url, why in ((pictures + "/away", "answered 302"), (pictures + "/gone.png", "answered 404"),
                         ("http://127.0.0.2:9/noise.png", "media_allow")):
            refused = ask(url)
            assert refused.status_code == 400 and why in refused.json()["error"]["message"], refused.text
        assert "Traceback" not in allowing.logs()
