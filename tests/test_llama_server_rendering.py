"""Every real chat template renders what llama-server renders, conversation by conversation.

llama-server (built from the same llama.cpp source by .ci/run, its path in KRONK_TEST_LLAMA_SERVER) serves
SmolLM2 with each of llama.cpp's models/templates in turn (``--jinja --chat-template-file``); its
``/apply-template`` renders each conversation below, and the server here renders the same request body (the
chat completions request, read as the server reads it) through the same template with SmolLM2's special
tokens. The prompts must be the same text. A template llama-server cannot load is left out; one that
llama-server renders and this server does not, or renders differently, fails, unless it is named below.
"""

import os
import subprocess
import time
from pathlib import Path

import pytest
import requests

from kronk_wsgi.api.planning import tool_text
from kronk_wsgi.api.schemas import ChatCompletionRequest
from kronk_wsgi.engine.chat_template import ChatTemplate, ChatTemplateError
from kronk_wsgi.engine.gguf_file import read_gguf
from kronk_wsgi.engine.tokenizer import GGUFTokenizer
from kronk_wsgi.testing import fetch_llama_cpp_templates, free_port

BINARY = os.environ.get("KRONK_TEST_LLAMA_SERVER")
pytestmark = pytest.mark.skipif(
    not BINARY and not os.environ.get("KRONK_TEST_REQUIRE_LLAMA_SERVER"),
    reason="llama-server is not built here (.ci/run builds it: KRONK_TEST_LLAMA_SERVER)")

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "description": "The city"}},
           "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": WEATHER}}]
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
CONVERSATIONS = {
    "system": {"messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi!"}]},
    "multi-turn": {"messages": [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello."},
                                {"role": "user", "content": "How are you?"}]},
    "tools": {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": TOOLS},
    "tool-result": {"messages": [{"role": "user", "content": "Weather in Paris?"},
                                 {"role": "assistant", "content": "", "tool_calls": [CALL]},
                                 {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}],
                    "tools": TOOLS},
    "reasoning": {"messages": [{"role": "user", "content": "Hi!"},
                               {"role": "assistant", "content": "Hello.", "reasoning_content": "A greeting."},
                               {"role": "user", "content": "Bye!"}]},
}


# Where this server renders differently on purpose, or does not yet render as llama-server does.
_TOOLS_WRITTEN_IN = ("a template that renders no tools gets them written into its messages here (docs/PROTOCOLS.rst); "
                     "llama-server leaves them out, and the model never sees them")
DIFFERENT = {
    **{(name, conversation): _TOOLS_WRITTEN_IN for conversation in ("tools", "tool-result") for name in (
        "HuggingFaceTB-SmolLM3-3B.jinja", "deepseek-ai-DeepSeek-R1-Distill-Llama-8B.jinja",
        "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja", "deepseek-ai-DeepSeek-V3.1.jinja",
        "fireworks-ai-llama-3-firefunction-v2.jinja", "llama-cpp-rwkv-world.jinja",
        "microsoft-Phi-3.5-mini-instruct.jinja")},
    ("google-gemma-2-2b-it.jinja", "tools"): _TOOLS_WRITTEN_IN,
    **{("Apertus-8B-Instruct.jinja", conversation): "llama-server finds no thinking in Apertus' template and "
       "switches enable_thinking off; here it is on unless the request says otherwise" for conversation in CONVERSATIONS},
    ("google-gemma-4-31B-it-interleaved.jinja", "tool-result"):
        "llama-server moves tool results into the model's turn for this older Gemma 4 template; not done here",
    **{(name, "reasoning"): "llama-server gives Mistral's templates an earlier answer's reasoning as a thinking "
       "content part, which they render; here it is reasoning_content, which they do not read"
       for name in ("mistralai-Ministral-3-14B-Reasoning-2512.jinja", "unsloth-mistral-Devstral-Small-2507.jinja")},
}


def ours(template: ChatTemplate, body: dict) -> str:
    """The prompt this server renders for a chat completions ``body``."""
    request = ChatCompletionRequest.model_validate({"model": "m", **body}).generation_request()
    tools = list(request.tools.tools) if request.tools else None
    return template.render(request.messages, tools, request.thinking, tool_text=tool_text(template, tools),
                           variables=request.template_vars).text


def rendered_by_llama_server(binary: str, model: Path, template: Path) -> dict[str, str]:
    """llama-server's prompt for each conversation; {} if it cannot load the template."""
    port = free_port()
    proc = subprocess.Popen([binary, "-m", str(model), "--jinja", "--chat-template-file", str(template),
                             "--port", str(port), "--host", "127.0.0.1", "-c", "1024", "-np", "1", "-t", "1",
                             "--no-webui"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if requests.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            time.sleep(0.2)
        if proc.poll() is not None:
            return {}
        out = {}
        for name, body in CONVERSATIONS.items():
            reply = requests.post(f"http://127.0.0.1:{port}/apply-template", json=body, timeout=60)
            if reply.status_code == 200:
                out[name] = reply.json()["prompt"]
        return out
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture(scope="module")
def references(smollm2) -> dict[str, dict[str, str]]:
    templates = fetch_llama_cpp_templates()
    return {path.name: rendered_by_llama_server(BINARY, smollm2, path) for path in sorted(templates.glob("*.jinja"))}


@pytest.fixture(scope="module")
def special_tokens(smollm2) -> tuple[str, str]:
    tokenizer = GGUFTokenizer(read_gguf(smollm2))
    return tokenizer.token_text(tokenizer.bos_id), tokenizer.token_text(tokenizer.eos_id)


TEMPLATES = sorted(p.name for p in fetch_llama_cpp_templates().glob("*.jinja")) if BINARY else []


@pytest.mark.parametrize("name, conversation", [
    pytest.param(name, conversation, marks=pytest.mark.xfail(reason=DIFFERENT[name, conversation], strict=True))
    if (name, conversation) in DIFFERENT else (name, conversation)
    for name in TEMPLATES for conversation in CONVERSATIONS])
def test_a_template_renders_what_llama_server_renders(name, conversation, references, special_tokens):
    expected = references[name].get(conversation)
    if expected is None:
        pytest.skip("llama-server does not render it")
    template = ChatTemplate((fetch_llama_cpp_templates() / name).read_text(encoding="utf-8"), *special_tokens)
    try:
        got = ours(template, CONVERSATIONS[conversation])
    except ChatTemplateError as exc:
        pytest.fail(f"llama-server renders it, this server does not: {exc}")
    assert got == expected
