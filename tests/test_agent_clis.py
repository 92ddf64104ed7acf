"""Claude Code and Codex CLI themselves, headless, against a server running Gemma 3 270M with its 32k context,
and (with KRONK_TEST_SLOW_AGENTS=1: four minutes more on 2 cores, where Gemma 3 takes one) one running SmolLM2
with a 32k context, four times what it was trained on: enough for the agents' prompts.

The CLIs come from npm (.ci/run installs them into KRONK_TEST_NODE_MODULES). Gemma 3 270M is a base model, and
SmolLM2 past its trained context no better: their replies to an agent's 10k-token prompt are noise of any
length, so each model is configured, as an Ollama Modelfile would configure a base model, to end its turn at a
blank line. What is tested is the clients' side: each runs to its end, exits 0, and every request it made is a
200; and a second session right after the first reads its prompt from the prompt cache.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kronk_wsgi.engine import llamacpp_engine

from .conftest import ROOT, run_server

NODE_MODULES = Path(os.environ.get("KRONK_TEST_NODE_MODULES", "/nonexistent"))

if not llamacpp_engine.available() or not (NODE_MODULES / ".bin").is_dir():
    if os.environ.get("KRONK_TEST_REQUIRE_NPM") and os.environ.get("KRONK_TEST_REQUIRE_LLAMACPP") == "1":
        raise RuntimeError("Claude Code and Codex are required (KRONK_TEST_REQUIRE_NPM) but not installed")
    pytest.skip("the agent CLIs or llama-cpp-python are not installed (KRONK_TEST_NODE_MODULES)",
                allow_module_level=True)

pytestmark = pytest.mark.timeout(900)

# The test harness's own probes: the readiness poll that started the server may be logged after a test began.
PROBES = ("/v1/readiness", "/v1/liveness")  # about a minute of prefill per CLI on 2 cores, more on a busy machine


SLOW = pytest.mark.skipif(not os.environ.get("KRONK_TEST_SLOW_AGENTS"), reason="SmolLM2's prefill of the agents' "
                          "10k-token prompts takes minutes: KRONK_TEST_SLOW_AGENTS=1 runs it")


@pytest.fixture(scope="module", params=["gemma3", pytest.param("smollm2", marks=SLOW)])
def agent_server(request, tmp_path_factory):
    """A server of one model, named "agent": Gemma 3 (whose sliding window keeps only its last 512 tokens: its
    prompt's state is saved one token short of the end) and SmolLM2 (whose slot holds the whole prompt)."""
    models = json.dumps({"agent": {"path": str(request.getfixturevalue(request.param)), "engine": "llama.cpp",
                                   "context_length": 32768, "stop": ["\n\n"]}})
    with run_server(tmp_path_factory.mktemp("agents"), {"KRONK_MODELS": models, "KRONK_THREADS": 2}) as server:
        yield server


def run_cli(command: list[str], home: Path, env: dict) -> subprocess.CompletedProcess:
    home.mkdir(exist_ok=True)
    return subprocess.run(command, cwd=home, capture_output=True, text=True, timeout=800,
                          env={"PATH": os.environ["PATH"], "HOME": str(home), **env})


def main_request(entries: list[dict]) -> dict:
    """A session's main request: the one with the longest prompt."""
    return max(entries, key=lambda entry: entry.get("prompt_tokens") or 0)


def claude_code(agent_server, home: Path) -> tuple[dict, list[dict]]:
    """One headless Claude Code session: its result, and the requests it made."""
    since = len(agent_server.logs().splitlines())
    ran = run_cli([str(NODE_MODULES / ".bin" / "claude"), "-p", "say hi", "--output-format", "json"], home, {
        "ANTHROPIC_BASE_URL": agent_server.url, "ANTHROPIC_AUTH_TOKEN": "unused", "ANTHROPIC_MODEL": "agent",
        "ANTHROPIC_SMALL_FAST_MODEL": "agent", "DISABLE_TELEMETRY": "1", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    })
    assert ran.returncode == 0, (ran.stdout[-2000:], ran.stderr[-2000:])
    made = [entry for entry in agent_server.completed(since) if entry["route"] not in PROBES]
    assert made and {entry["route"] for entry in made} <= {"/v1/messages", "/v1/models"}
    assert [entry["status"] for entry in made] == [200] * len(made)
    return json.loads(ran.stdout), made


def test_claude_code_twice(agent_server, tmp_path):
    result, _ = claude_code(agent_server, tmp_path)
    assert result["is_error"] is False and result["stop_reason"] == "end_turn"
    usage = result["usage"]
    read = usage["input_tokens"] + usage["cache_read_input_tokens"] + usage["cache_creation_input_tokens"]
    assert read > 5000  # Claude Code's own prompt, read here
    _, made = claude_code(agent_server, tmp_path)  # a new session: its billing header differs, nothing else
    main = main_request(made)
    assert main["cached_tokens"] >= 0.95 * main["prompt_tokens"], main


def codex(agent_server, home: Path) -> list[dict]:
    """One Codex CLI session: the requests it made."""
    since = len(agent_server.logs().splitlines())
    (home / "codex").mkdir(exist_ok=True)
    (home / "codex" / "config.toml").write_text(
        'model = "agent"\nmodel_provider = "kronk"\n\n[model_providers.kronk]\nname = "kronk"\n'
        f'base_url = "{agent_server.url}/v1"\nwire_api = "responses"\n')
    ran = run_cli([str(NODE_MODULES / ".bin" / "codex"), "exec", "--skip-git-repo-check", "say hi"], home,
                  {"CODEX_HOME": str(home / "codex"), "OPENAI_API_KEY": "unused"})
    assert ran.returncode == 0, (ran.stdout[-2000:], ran.stderr[-2000:])
    made = [entry for entry in agent_server.completed(since) if entry["route"] not in (*PROBES, "/v1/models")]
    assert made and {entry["route"] for entry in made} == {"/v1/responses"}
    assert [entry["status"] for entry in made] == [200] * len(made)
    assert all("web_search" in entry.get("tools_not_offered", ()) for entry in made)  # named, never silently
    return made


def test_codex_cli_twice(agent_server, tmp_path):
    codex(agent_server, tmp_path)
    main = main_request(codex(agent_server, tmp_path))
    assert main["cached_tokens"] >= 0.95 * main["prompt_tokens"], main


def launched(agent_server, home: Path, agent: str, arguments: list[str], env: dict) -> list[dict]:
    """``kronk-wsgi launch AGENT`` with the agent's arguments, its CLI on PATH: the requests it made, each a 200."""
    since = len(agent_server.logs().splitlines())
    path = f"{NODE_MODULES / '.bin'}:{os.environ['PATH']}"
    ran = run_cli([sys.executable, "-m", "kronk_wsgi.cli", "launch", agent, "--url", agent_server.url, "--",
                   *arguments], home, {"PATH": path, "PYTHONPATH": str(ROOT), **env})
    assert ran.returncode == 0, (ran.stdout[-2000:], ran.stderr[-2000:])
    made = [entry for entry in agent_server.completed(since) if not entry["route"].startswith((*PROBES, "/v1/models"))]
    assert made and [entry["status"] for entry in made] == [200] * len(made)
    assert {entry["model"] for entry in made} == {"agent"}
    return made


def test_kronk_wsgi_launch_starts_claude_code_with_the_models_window(agent_server, tmp_path):
    launched(agent_server, tmp_path, "claude", ["-p", "say hi", "--output-format", "json", "--debug"], {})
    debug = (tmp_path / ".claude" / "debug" / "latest").read_text()
    # Claude Code compacts at its window less the room of one reply (its cap, 8,192 here), kept for the summary
    assert "effectiveWindow=24576" in debug, [line for line in debug.splitlines() if "autocompact" in line]


def test_kronk_wsgi_launch_starts_codex_with_no_configuration_of_its_own(agent_server, tmp_path):
    codex_home = tmp_path / "codex"
    codex_home.mkdir()
    made = launched(agent_server, tmp_path, "codex", ["exec", "--skip-git-repo-check", "say hi"],
                    {"CODEX_HOME": str(codex_home)})
    assert {entry["route"] for entry in made} == {"/v1/responses"}
    sessions = "".join(path.read_text() for path in codex_home.glob("sessions/**/*.jsonl"))
    # Codex works in 95% of the window it is given: 32,768 tokens told, 31,129 in its session's record
    assert '"model_context_window":31129' in sessions.replace(" ", "")
