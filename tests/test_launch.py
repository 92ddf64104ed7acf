"""``kronk-wsgi launch``: what each agent CLI is started with, read from a real server's model listing.

The agents themselves run in tests/test_agent_clis.py (Claude Code and Codex, launched this way).
"""

import json
import os
import subprocess
import sys

import pytest

from kronk_wsgi.engine import llamacpp_engine
from kronk_wsgi.launch import AGENTS, LaunchError, plan, served_model

from .conftest import ROOT, free_port, run_server


@pytest.fixture(scope="module")
def roomy(tiny_model, tmp_path_factory):
    """The tiny model with a 32k context (llama.cpp), and the tiny model at its 2k."""
    if not llamacpp_engine.available():
        pytest.skip("llama-cpp-python is not installed")
    models = {"agent": {"path": str(tiny_model), "engine": "llama.cpp", "context_length": 32768},
              "small": {"path": str(tiny_model)}}
    with run_server(tmp_path_factory.mktemp("launch"), {"KRONK_MODELS": json.dumps(models),
                                                        "KRONK_DEFAULT_MODEL": "agent"}) as server:
        yield server


def dry_run(url: str, agent: str, *extra: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kronk_wsgi.cli", "launch", agent, "--url", url, "--dry-run", *extra],
                          capture_output=True, text=True, timeout=60,
                          env={"PATH": os.environ["PATH"], "PYTHONPATH": str(ROOT), **env})


def settings(ran: subprocess.CompletedProcess) -> tuple[dict[str, str], str]:
    assert ran.returncode == 0, ran.stderr
    lines = ran.stdout.splitlines()
    assert lines[-1].startswith("# ")
    return dict(line.split("=", 1) for line in lines[:-1]), lines[-1][2:]


def test_claude_code_gets_the_models_window_a_reply_cap_and_no_hosted_key(roomy):
    env, command = settings(dry_run(roomy.url, "claude", "--", "-p", "say hi", KRONK_API_KEY="k-local",
                                    ANTHROPIC_API_KEY="sk-ant-hosted"))
    assert env["ANTHROPIC_BASE_URL"] == roomy.url and env["ANTHROPIC_AUTH_TOKEN"] == "k-local"
    assert env["ANTHROPIC_API_KEY"] == ""  # the hosted key is not passed on
    assert {env[name] for name in ("ANTHROPIC_MODEL", "ANTHROPIC_DEFAULT_OPUS_MODEL", "ANTHROPIC_DEFAULT_SONNET_MODEL",
                                   "ANTHROPIC_DEFAULT_HAIKU_MODEL", "CLAUDE_CODE_SUBAGENT_MODEL")} == {"agent"}
    assert (env["CLAUDE_CODE_MAX_CONTEXT_TOKENS"], env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"]) == ("32768", "8192")
    assert env["CLAUDE_CODE_ATTRIBUTION_HEADER"] == "0"
    assert command.endswith("claude -p 'say hi'")


def test_codex_gets_its_provider_as_options_and_opencode_as_its_config(roomy):
    env, command = settings(dry_run(roomy.url, "codex", "--model", "agent", "--", "exec", "hi"))
    assert env == {"KRONK_API_KEY": "kronk-wsgi"}
    assert f'base_url = "{roomy.url}/v1"' in command and 'wire_api = "responses"' in command
    assert "model_context_window=32768" in command and command.endswith("exec hi")
    env, _ = settings(dry_run(roomy.url, "opencode"))
    config = json.loads(env["OPENCODE_CONFIG_CONTENT"])
    assert config["model"] == "kronk/agent"
    provider = config["provider"]["kronk"]
    assert provider["options"]["baseURL"] == roomy.url + "/v1"
    assert provider["models"]["agent"]["limit"] == {"context": 32768, "output": 8192}


def test_what_cannot_be_launched_is_said_with_the_figures(roomy):
    small = served_model(roomy.url, "small", None)
    with pytest.raises(LaunchError, match="at least 32,768 tokens .* 'small' is served with 2,048"):
        plan(AGENTS["claude"], small)
    with pytest.raises(LaunchError, match="no model 'nope'; it has agent, small"):
        served_model(roomy.url, "nope", None)
    with pytest.raises(LaunchError, match="no server answers at"):
        served_model(f"http://127.0.0.1:{free_port()}", None, None)
    missing = subprocess.run([sys.executable, "-m", "kronk_wsgi.cli", "launch", "opencode", "--url", roomy.url],
                             capture_output=True, text=True, timeout=60,
                             env={"PATH": os.path.dirname(sys.executable), "PYTHONPATH": str(ROOT)})
    assert missing.returncode == 1 and "npm install -g opencode-ai" in missing.stderr
    stray = subprocess.run([sys.executable, "-m", "kronk_wsgi.cli", "models", "--", "x"], capture_output=True,
                           text=True, timeout=60, env={"PATH": os.environ["PATH"], "PYTHONPATH": str(ROOT)})
    assert stray.returncode == 2 and "kronk-wsgi launch" in stray.stderr
