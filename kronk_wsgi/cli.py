"""The kronk-wsgi command."""

import argparse
import json
import os
import subprocess
import sys
from typing import Optional

from .config import DEMO_MODEL_ID, ConfigError, Settings, config_key, read_config, settings_from_config

# How long a first start waits for the hub to answer at all before it looks in the cache alone.
FIRST_PULL_TIMEOUT = 5.0


def _settings(args: argparse.Namespace, flags: dict) -> tuple[Optional[dict], Optional[Settings]]:
    """The configuration and the settings, the flags on top (the environment carries them, as gunicorn's workers
    re-read it); (None, None) once a configuration error is told."""
    if args.config:
        os.environ["KRONK_CONFIG"] = args.config
    for name, value in flags.items():
        if value is not None:
            os.environ[config_key(name)] = ",".join(value) if isinstance(value, list) else str(value)
    try:
        raw = read_config()
        return raw, settings_from_config(raw)
    except ConfigError as exc:
        print(f"kronk-wsgi: {exc}", file=sys.stderr)
        return None, None


def _serve(args: argparse.Namespace) -> int:
    raw, settings = _settings(args, {"bind": args.bind, "workers": args.workers, "parallel": args.parallel,
                                     "models": args.model})
    if settings is None:
        return 2
    if args.demo:
        os.environ[config_key("models")] = json.dumps({DEMO_MODEL_ID: {"demo": "tiny"}})
    elif config_key("models") not in raw and settings.default_pull:
        os.environ[config_key("models")] = json.dumps(_first_run_models(settings.default_pull))

    from .server import KronkApplication, graceful_timeout

    options = {"bind": settings.bind, "workers": settings.workers,
               "graceful_timeout": graceful_timeout(settings.drain_timeout)}
    KronkApplication(options).run()
    return 0


def _grpc(args: argparse.Namespace) -> int:
    from gevent import monkey

    monkey.patch_all()  # before gRPC is imported: its calls run as greenlets
    _, settings = _settings(args, {"parallel": args.parallel, "models": args.model})
    if settings is None:
        return 2
    try:
        from .grpc_worker.server import serve
    except ImportError as exc:
        print(f"kronk-wsgi: the gRPC worker needs its extra (pip install 'kronk_wsgi[grpc]'): {exc}", file=sys.stderr)
        return 2
    return serve(settings, args.bind, args.http, args.protocol or ("sglang", "vllm"))


def _first_run_models(name: str) -> dict:
    """What `serve` serves with no model configured: the ``default_pull`` model, pulled with the hub's progress bar
    on first start and found in its cache after that; the generated demo model if the hub cannot give it."""
    repo_id, _, quant = name.partition(":")
    model_id = repo_id.rpartition("/")[2].removesuffix("-GGUF").lower()
    print(f"kronk-wsgi: no model is configured: serving {name} from the Hugging Face hub "
          "(downloaded on the first start, from the cache after)", file=sys.stderr, flush=True)
    path = _pull_in_child(repo_id, quant or None)
    if path is not None:
        return {model_id: {"path": path}}
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    print(f"kronk-wsgi: could not get {name} from {endpoint}, and it is not in the hub's cache.\n"
          "  Serve a model file:      kronk-wsgi serve --model ID=/path/to/model.gguf\n"
          "  Pull one first:          kronk-wsgi pull OWNER/REPO QUANT   (HF_ENDPOINT for a mirror)\n"
          "  Serve the demo model:    kronk-wsgi serve --demo   (generated here, random text)\n"
          f"kronk-wsgi: serving the generated demo model {DEMO_MODEL_ID!r} now.", file=sys.stderr, flush=True)
    return {DEMO_MODEL_ID: {"demo": "tiny"}}


def _pull_in_child(repo_id: str, quant: Optional[str]) -> Optional[str]:
    """The model file's path from `kronk-wsgi pull` in a child process (its progress bar on this terminal); None if
    it failed. A child, because the hub's client imports ssl, which must not be in gunicorn's master before the
    gevent workers patch it."""
    command = [sys.executable, "-m", "kronk_wsgi.cli", "pull", repo_id, *([quant] if quant else []),
               "--connect-timeout", str(FIRST_PULL_TIMEOUT)]
    pulled = subprocess.run(command, stdout=subprocess.PIPE, text=True)
    lines = pulled.stdout.strip().splitlines()
    return lines[-1] if pulled.returncode == 0 and lines else None


def _make_model(args: argparse.Namespace) -> int:
    from pathlib import Path

    from .engine.demo_model import write_demo_model, write_demo_vision

    if not args.vision:
        print(write_demo_model(args.path, args.size, args.seed, args.architecture))
        return 0
    if args.architecture != "llama":
        print("kronk-wsgi: a vision demo model is of the llama architecture", file=sys.stderr)
        return 2
    model, projector = write_demo_vision(Path(args.path), args.size, args.seed)
    print(f"{model}\n{projector}\nserve it: KRONK_MODELS='{{\"vision\": {{\"path\": \"{model}\", "
          f"\"mmproj\": \"{projector}\"}}}}' kronk-wsgi serve")
    return 0


def _inspect(args: argparse.Namespace) -> int:
    from pathlib import Path

    from .describe import describe
    from .engine.gguf_file import BadModelFile

    try:
        rows = describe(Path(args.path), args.context_length)
    except (OSError, BadModelFile) as exc:
        print(f"kronk-wsgi: {exc}", file=sys.stderr)
        return 2
    width = max(len(label) for label, _ in rows)
    for label, text in rows:
        print(f"{label:<{width}}  " + text.replace("\n", "\n" + " " * (width + 2)))
    return 0


def _pull(args: argparse.Namespace) -> int:
    from . import hub

    if args.connect_timeout is not None and not hub.offline():
        why = hub.unreachable(args.connect_timeout)
        if why is not None:
            print(f"kronk-wsgi: {os.environ.get('HF_ENDPOINT', 'https://huggingface.co')} does not answer ({why}); "
                  "looking in the hub's cache", file=sys.stderr, flush=True)
            hub.go_offline()
    try:
        for path in filter(None, hub.pull_with_projector(args.repo, args.file_or_quant, args.revision)):
            print(path)
    except hub.HubError as exc:
        print(f"kronk-wsgi: {exc}", file=sys.stderr)
        return 1
    return 0


def _models(args: argparse.Namespace) -> int:
    from . import hub
    from .catalog import local_file
    from .describe import summary

    try:
        settings = settings_from_config(read_config(args.config))
    except ConfigError as exc:
        print(f"kronk-wsgi: {exc}", file=sys.stderr)
        return 2
    loaded = _loaded_models(args.url) if args.url else None
    entries = [(model_id, spec.describe(), local_file(spec)) for model_id, spec in settings.models.items()]
    entries += [("-", f"{c.repo_id} {c.filename}", c.path) for c in hub.cached_files()]
    table = [("id", "file", "size", "architecture", "quantization", "context", "engine", "loaded")]
    for model_id, where, path in entries:
        on_disk = path is not None and path.is_file()
        remote = model_id in settings.models and settings.models[model_id].engine == "grpc"
        facts = summary(path) if on_disk else {"architecture": "-", "quantization": "-", "context": "-",
                                                "engine": "grpc" if remote else "not on disk yet"}
        state = "-" if loaded is None or model_id == "-" else "yes" if model_id in loaded else "no"
        size = f"{path.stat().st_size / 1e6:.0f} MB" if on_disk else "-"
        table.append((model_id, where, size, *facts.values(), state))
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    for row in table:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
    return 0


def _loaded_models(url: str) -> set[str]:
    """The models a running server has loaded, from its admin API (KRONK_ADMIN_KEY, if it needs one)."""
    import json
    import urllib.request

    request = urllib.request.Request(url.rstrip("/") + "/admin/models")
    key = os.environ.get("KRONK_ADMIN_KEY")
    if key:
        request.add_header("Authorization", f"Bearer {key}")
    with urllib.request.urlopen(request, timeout=10) as response:
        return {model["id"] for model in json.load(response)["data"] if model["loaded"]}


def _launch(args: argparse.Namespace) -> int:
    from .launch import LaunchError, launch

    try:
        return launch(args.agent, args.url, args.model, args.dry_run, args.extra)
    except LaunchError as exc:
        print(f"kronk-wsgi: {exc}", file=sys.stderr)
        return 1


def _rm(args: argparse.Namespace) -> int:
    from . import hub

    try:
        removed = hub.remove(args.repo, args.file)
    except hub.HubError as exc:
        print(f"kronk-wsgi: {exc}", file=sys.stderr)
        return 1
    for file in removed:
        print(f"removed {file.repo_id} {file.filename} ({file.size / 1e6:.0f} MB)")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="kronk-wsgi", description="A local LLM model server.")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="run the server (gunicorn, gevent worker)")
    serve.add_argument("--bind", help="HOST:PORT (default 127.0.0.1:8000)")
    serve.add_argument("--workers", type=int, help="worker processes (default 1)")
    serve.add_argument("--parallel", type=int, help="slots per model (default 1)")
    serve.add_argument("--config", help="a TOML configuration file")
    serve.add_argument("--model", action="append", metavar="ID=PATH", help="serve a model file (repeatable)")
    serve.add_argument("--demo", action="store_true", help="serve the generated demo model (random text), offline")
    serve.set_defaults(run=_serve)
    worker = commands.add_parser("grpc", help="serve the default model as a gRPC worker (SGLang's and vLLM's engine "
                                              "protocols)")
    worker.add_argument("--bind", default="127.0.0.1:30000", help="HOST:PORT of the gRPC service (default %(default)s)")
    worker.add_argument("--http", metavar="HOST:PORT", help="also serve GET /health and GET /metrics here")
    worker.add_argument("--protocol", action="append", choices=("sglang", "vllm"),
                        help="the service to serve: SglangScheduler, VllmEngine (default: both)")
    worker.add_argument("--parallel", type=int, help="slots (default 1)")
    worker.add_argument("--config", help="a TOML configuration file")
    worker.add_argument("--model", action="append", metavar="ID=PATH", help="serve a model file (the first is the "
                                                                           "default)")
    worker.set_defaults(run=_grpc)
    inspect = commands.add_parser("inspect", help="what a GGUF model file holds, and whether the engine runs it")
    inspect.add_argument("path")
    inspect.add_argument("--context-length", type=int, help="the context to estimate memory for (default: the file's)")
    inspect.set_defaults(run=_inspect)
    pull = commands.add_parser("pull", help="download a GGUF file from the Hugging Face hub into its cache")
    pull.add_argument("repo", help="a hub repository, owner/name")
    pull.add_argument("file_or_quant", nargs="?", help="a file name, or a quantization such as Q4_K_M "
                                                      "(may be left out if the repository has one GGUF file)")
    pull.add_argument("--revision", help="a branch, tag or commit (default: main)")
    pull.add_argument("--connect-timeout", type=float, metavar="SECONDS",
                      help="if the hub does not answer within SECONDS, use its cache alone")
    pull.set_defaults(run=_pull)
    listing = commands.add_parser("models", help="the configured models and the GGUF files in the hub's cache")
    listing.add_argument("--config", help="a TOML configuration file")
    listing.add_argument("--url", help="a running server: say which models it has loaded")
    listing.set_defaults(run=_models)
    start = commands.add_parser("launch", usage="kronk-wsgi launch {claude,codex,opencode} [--url URL] [--model M] "
                                                "[--dry-run] [-- ARGS]",
                                help="start an agent CLI (Claude Code, Codex, opencode) against a running server, with "
                                     "the settings its model needs; ARGS after -- are the agent's own")
    start.add_argument("agent", choices=("claude", "codex", "opencode"))
    start.add_argument("--url", help="the server (default: KRONK_URL, else http://127.0.0.1:8000)")
    start.add_argument("--model", help="the model (default: the server's default model)")
    start.add_argument("--dry-run", action="store_true", help="print the settings as VAR=value lines (and the "
                                                              "command as a comment), and start nothing")
    start.set_defaults(run=_launch)
    rm = commands.add_parser("rm", help="remove a repository's GGUF files from the hub's cache")
    rm.add_argument("repo")
    rm.add_argument("file", nargs="?", help="only this file")
    rm.set_defaults(run=_rm)
    make = commands.add_parser("make-demo-model", help="write a demo GGUF model with random weights")
    make.add_argument("path")
    make.add_argument("--size", choices=["tiny", "medium"], default="tiny")
    make.add_argument("--seed", type=int, default=0)
    make.add_argument("--architecture", choices=["llama", "qwen2"], default="llama")
    make.add_argument("--vision", action="store_true",
                      help="PATH is a folder: write a model and its projector (mmproj), which takes images")
    make.set_defaults(run=_make_model)
    argv = sys.argv[1:] if argv is None else list(argv)
    ours, passed = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    args = parser.parse_args(ours)
    if passed and args.command != "launch":
        parser.error("arguments after -- are an agent's, for kronk-wsgi launch")
    args.extra = passed
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
