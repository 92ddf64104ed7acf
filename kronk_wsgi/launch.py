"""``kronk-wsgi launch``: an agent CLI started against a running server, with the settings it needs for the model.

Each agent is told the server's address, a key, the model (for every role it has), the model's context window
(which it compacts its conversation by) and a cap on a reply that leaves the conversation most of that window.
Nothing is written to the agent's own configuration: the settings are its environment and its command line.
"""

import dataclasses
import json
import os
import shutil
import urllib.error
import urllib.parse
import urllib.request
from typing import Callable, Optional

DEFAULT_URL = "http://127.0.0.1:8000"  # kronk-wsgi serve's default bind
# The most a reply may have: a quarter of the window, and no more than the agents ask of hosted models.
MOST_OUTPUT = 32_000


class LaunchError(Exception):
    """Why an agent was not started, in words for its user."""


@dataclasses.dataclass(frozen=True)
class Served:
    """The model an agent is launched on, as the server describes it."""

    url: str
    key: str
    model: str
    context: int

    @property
    def output(self) -> int:
        return min(MOST_OUTPUT, self.context // 4)


@dataclasses.dataclass(frozen=True)
class Agent:
    name: str  # as its user knows it
    program: str  # the command on PATH
    package: str  # the npm package that installs it
    least_context: int  # tokens: its own prompt and tools, a few turns, and the room it keeps for compacting
    settings: Callable[[Served], tuple[dict[str, str], list[str]]]  # its environment and its leading arguments


def _claude(served: Served) -> tuple[dict[str, str], list[str]]:
    model = served.model
    return {
        "ANTHROPIC_BASE_URL": served.url, "ANTHROPIC_AUTH_TOKEN": served.key,
        "ANTHROPIC_API_KEY": "",  # a hosted key in the user's environment is not sent here
        "ANTHROPIC_MODEL": model, "ANTHROPIC_DEFAULT_OPUS_MODEL": model, "ANTHROPIC_DEFAULT_SONNET_MODEL": model,
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": model, "CLAUDE_CODE_SUBAGENT_MODEL": model,
        "CLAUDE_CODE_MAX_CONTEXT_TOKENS": str(served.context),  # the window it compacts by
        "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(served.output),
        "CLAUDE_CODE_ATTRIBUTION_HEADER": "0",  # its per-request header would change every prompt's start
        "DISABLE_TELEMETRY": "1", "DISABLE_ERROR_REPORTING": "1", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    }, []


def _codex(served: Served) -> tuple[dict[str, str], list[str]]:
    provider = {"name": "kronk-wsgi", "base_url": served.url + "/v1", "wire_api": "responses",
                "env_key": "KRONK_API_KEY"}
    table = "{" + ", ".join(f"{key} = {json.dumps(value)}" for key, value in provider.items()) + "}"
    options = {"model_provider": '"kronk"', "model_providers.kronk": table, "model": json.dumps(served.model),
               "model_context_window": str(served.context)}
    return {"KRONK_API_KEY": served.key}, [arg for key, value in options.items() for arg in ("-c", f"{key}={value}")]


def _opencode(served: Served) -> tuple[dict[str, str], list[str]]:
    config = {
        "$schema": "https://opencode.ai/config.json", "model": f"kronk/{served.model}",
        "provider": {"kronk": {
            "npm": "@ai-sdk/openai-compatible", "name": "kronk-wsgi",
            "options": {"baseURL": served.url + "/v1", "apiKey": served.key},
            "models": {served.model: {"name": served.model,
                                      "limit": {"context": served.context, "output": served.output}}},
        }},
    }
    return {"OPENCODE_CONFIG_CONTENT": json.dumps(config)}, []


AGENTS = {
    "claude": Agent("Claude Code", "claude", "@anthropic-ai/claude-code", 32_768, _claude),
    "codex": Agent("Codex", "codex", "@openai/codex", 16_384, _codex),
    "opencode": Agent("opencode", "opencode", "opencode-ai", 16_384, _opencode),
}


def _get(url: str, key: Optional[str]) -> dict:
    request = urllib.request.Request(url)
    if key:
        request.add_header("Authorization", f"Bearer {key}")
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.load(response)


def served_model(url: str, model: Optional[str], key: Optional[str]) -> Served:
    """The model at ``url`` (its default model unless named) and its context; LaunchError if it cannot be had."""
    url = url.rstrip("/")
    try:
        if model is None:
            model = _get(url + "/v1/readiness", key).get("default_model")
        card = _get(f"{url}/v1/models/{urllib.parse.quote(model, safe='')}", key)
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            listed = ", ".join(m["id"] for m in _get(url + "/v1/models", key)["data"])
            raise LaunchError(f"the server at {url} has no model {model!r}; it has {listed}") from None
        if exc.code == 401:
            raise LaunchError(f"the server at {url} wants a key: set KRONK_API_KEY") from None
        if exc.code == 503:  # readiness: the default model is not loaded yet
            raise LaunchError(f"the server at {url} is not ready yet (its default model is loading): try again, "
                              "or name a model with --model") from None
        raise LaunchError(f"the server at {url} answered {exc.code}") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise LaunchError(f"no server answers at {url} ({reason}): start one with kronk-wsgi serve, "
                          "or give its address with --url") from None
    context = card.get("context_length")
    if not context:
        raise LaunchError(f"the context of {model!r} is not known until its file is on this machine: send it a "
                          "request first (it downloads then)")
    return Served(url, key or "kronk-wsgi", model, context)


def plan(agent: Agent, served: Served) -> tuple[dict[str, str], list[str]]:
    """What the agent is started with: its environment's settings and its arguments before the user's; LaunchError
    if the model's context is too small for it."""
    if served.context < agent.least_context:
        raise LaunchError(f"{agent.name} needs a context of at least {agent.least_context:,} tokens (its own "
                          f"prompt and tools, and room to work and compact in); {served.model!r} is served with "
                          f"{served.context:,}: raise its context_length")
    return agent.settings(served)


def launch(name: str, url: Optional[str], model: Optional[str], dry_run: bool, extra: list[str]) -> int:
    """Start the agent ``name`` (or, with ``dry_run``, print what it would be started with); its exit status."""
    agent = AGENTS[name]
    served = served_model(url or os.environ.get("KRONK_URL") or DEFAULT_URL, model, os.environ.get("KRONK_API_KEY"))
    env, leading = plan(agent, served)
    program = shutil.which(agent.program)
    command = [program or agent.program, *leading, *extra]
    if dry_run:
        for key, value in env.items():
            print(f"{key}={value}")
        print("# " + " ".join(_quoted(arg) for arg in command))
        return 0
    if program is None:
        raise LaunchError(f"{agent.name} is not installed (no {agent.program} on PATH): npm install -g "
                          f"{agent.package}")
    print(f"kronk-wsgi: starting {agent.name} on {served.model!r} at {served.url} (context {served.context:,}, "
          f"replies up to {served.output:,} tokens): set {', '.join(env)}", flush=True)
    os.execvpe(program, command, {**os.environ, **env})  # the agent takes this process's place


def _quoted(arg: str) -> str:
    return arg if arg and all(c.isalnum() or c in "-_./:=@" for c in arg) else "'" + arg.replace("'", "'\\''") + "'"
