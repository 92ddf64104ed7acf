"""Starts this server where llama.cpp's server test suite starts llama-server: the same command line, read into
kronk_wsgi's settings, then `kronk-wsgi serve` in its place.

The suite fetches its models from the Hugging Face hub, which is out of reach here: a model named by
``--hf-repo`` (and ``--hf-file``) is the file KRONK_SUITE_MODELS maps its name to (a JSON object), else the one
it maps "*" to. Flags that change nothing here are read and left; the others are listed in the server's log.

With KRONK_SUITE_REFERENCE naming a llama-server binary, that binary is started instead, with the same models
in place of the hub's: the reference that this server's results are compared with.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

# Flags with a value, and flags without one, that have no meaning here: what they set is this server's way already
# (Jinja templates, metrics and slots always on, one model loaded and kept) or is not taken (GPU layers, LoRA).
VALUED = {"--batch-size", "--ubatch-size", "-ctk", "-ctv", "-fa", "--n-gpu-layers", "--pooling",
          "--reasoning-format", "--reasoning", "--grp-attn-n", "--grp-attn-w", "--tags", "--cache-ram",
          "--sleep-idle-seconds", "--lora", "--spec-type", "--spec-draft-n-max", "--spec-draft-n-min",
          "--model-draft", "--mmproj-url", "--media-path", "--models-dir", "--models-max", "--models-preset",
          "--cors-origins", "--tools", "--tools-runtime",
          "--slot-save-path", "--spec-synth-len", "--spec-synth-rates", "--model-url"}
# llama-server's sampling flags: the model's sampling defaults, by their names there
SAMPLING = {"--temp": ("temperature", float), "--seed": ("seed", int), "--top-k": ("top_k", int),
            "--top-p": ("top_p", float), "--min-p": ("min_p", float), "--repeat-penalty": ("repeat_penalty", float),
            "--repeat-last-n": ("repeat_last_n", int), "--presence-penalty": ("presence_penalty", float),
            "--frequency-penalty": ("frequency_penalty", float)}
FLAGS = {"--offline", "--cont-batching", "--embedding", "--reranking", "--metrics", "--kv-unified", "--swa-full",
         "--slots", "--no-slots", "--verbose", "--context-shift", "--no-ui", "--no-webui", "--no-models-autoload",
         "--jinja", "--no-jinja", "--no-mmproj", "--no-cache-idle-slots", "--ui-mcp-proxy", "--backend_sampling"}


def main(argv: list[str]) -> None:
    options: dict[str, str] = {}
    left: list[str] = []
    i = 0
    while i < len(argv):
        flag = argv[i]
        if flag in FLAGS:
            left.append(flag)
            i += 1
            continue
        value = argv[i + 1] if i + 1 < len(argv) else ""
        if flag in VALUED:
            left.append(f"{flag} {value}")
        else:
            options[flag] = value
        i += 2
    models = json.loads(os.environ.get("KRONK_SUITE_MODELS", "{}"))
    repo = options.get("--hf-repo")
    if "--model" in options:
        path = options["--model"]
    elif repo is not None:
        name = repo + ("/" + options["--hf-file"] if "--hf-file" in options else "")
        path = models.get(name, models.get(repo, models["*"]))
    else:
        path = models["*"]
    reference = os.environ.get("KRONK_SUITE_REFERENCE")
    if reference:
        hub = {"--hf-repo", "--hf-file", "--model"}
        rest = [arg for i, arg in enumerate(argv) if arg not in hub and (i == 0 or argv[i - 1] not in hub)]
        os.execv(reference, [reference, "--model", path, *rest])
    spec: dict[str, object] = {"path": path, "engine": "llama.cpp"}
    parallel = int(options.get("--parallel", "1"))
    if "--ctx-size" in options and int(options["--ctx-size"]) > 0:
        spec["context_length"] = int(options["--ctx-size"]) // parallel  # llama-server's context is all slots'
    if int(options.get("--n-predict", "-1")) > 0:
        spec["max_tokens"] = int(options["--n-predict"])  # a reply's length where its request sets none
    sampling = {SAMPLING[flag][0]: SAMPLING[flag][1](value) for flag, value in options.items() if flag in SAMPLING}
    if sampling:
        spec["sampling"] = sampling
    if "--chat-template-file" in options:
        spec["chat_template"] = Path(options["--chat-template-file"]).read_text()
    elif "--chat-template" in options:
        spec["chat_template"] = options["--chat-template"]
    name = options.get("--alias") or Path(path).name
    # llama-server serving one model serves it under any name its clients send
    env = {**os.environ, "KRONK_MODELS": json.dumps({name: spec}), "KRONK_PARALLEL": str(parallel),
           "KRONK_UNKNOWN_MODEL": "default"}
    if "--api-key" in options:
        env["KRONK_API_KEYS"] = options["--api-key"]
    if "--threads" in options:
        env["KRONK_THREADS"] = options["--threads"]
    for flag in ("--mcp-servers-json", "--mcp-servers-config"):  # JSON, or the path of a JSON file: the same setting
        if flag in options:
            env["KRONK_MCP_SERVERS"] = options[flag]
    unknown = sorted(set(options) - {"--port", "--host", "--model", "--hf-repo", "--hf-file", "--alias",
                                     "--parallel", "--ctx-size", "--n-predict", "--chat-template",
                                     "--chat-template-file", "--api-key", "--threads", "--mcp-servers-json",
                                     "--mcp-servers-config", *SAMPLING})
    print(f"llama_server_shim: left {left + unknown}", file=sys.stderr, flush=True)
    host = options.get("--host", "127.0.0.1").split(",")[0]
    server = subprocess.Popen([sys.executable, "-m", "kronk_wsgi.cli", "serve", "--bind",
                               f"{host}:{options.get('--port', '8080')}"], env=env, start_new_session=True)

    # llama-server stops at once when asked; the suite kills it 5 s later. The whole server (master and workers)
    # is told to stop now (gunicorn's quick shutdown, SIGQUIT: a graceful stop takes a second or more) and is
    # killed if still there after 4 s, or the next test would find this one's workers on its port.
    asked: list[float] = []  # when the suite asked it to stop
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: asked.append(time.monotonic()))
    passed_on = False
    while True:
        try:
            sys.exit(server.wait(timeout=0.1))
        except subprocess.TimeoutExpired:
            pass
        if asked and not passed_on:
            os.killpg(server.pid, signal.SIGQUIT)
            passed_on = True
        if asked and time.monotonic() - asked[0] > 4:
            os.killpg(server.pid, signal.SIGKILL)


if __name__ == "__main__":
    main(sys.argv[1:])
