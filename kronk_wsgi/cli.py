"""The kronk-wsgi command."""

import argparse
import os
import sys

from .config import ConfigError, config_key, read_config, settings_from_config


def _serve(args: argparse.Namespace) -> int:
    if args.config:
        os.environ["KRONK_CONFIG"] = args.config
    # Flags are the top layer: the workers re-read the environment, so flags go there.
    flags = {"bind": args.bind, "workers": args.workers, "parallel": args.parallel, "models": args.model}
    for name, value in flags.items():
        if value is not None:
            os.environ[config_key(name)] = ",".join(value) if isinstance(value, list) else str(value)
    try:
        settings = settings_from_config(read_config())
    except ConfigError as exc:
        print(f"kronk-wsgi: {exc}", file=sys.stderr)
        return 2
    from .server import KronkApplication, graceful_timeout

    options = {"bind": settings.bind, "workers": settings.workers,
               "graceful_timeout": graceful_timeout(settings.drain_timeout)}
    KronkApplication(options).run()
    return 0


def _make_model(args: argparse.Namespace) -> int:
    from .engine.demo_model import write_demo_model

    print(write_demo_model(args.path, args.size, args.seed, args.architecture))
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

    try:
        print(hub.pull(args.repo, args.file_or_quant, args.revision))
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
        facts = summary(path) if on_disk else {"architecture": "-", "quantization": "-", "context": "-",
                                                "engine": "not on disk yet"}
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
    serve.set_defaults(run=_serve)
    inspect = commands.add_parser("inspect", help="what a GGUF model file holds, and whether the engine runs it")
    inspect.add_argument("path")
    inspect.add_argument("--context-length", type=int, help="the context to estimate memory for (default: the file's)")
    inspect.set_defaults(run=_inspect)
    pull = commands.add_parser("pull", help="download a GGUF file from the Hugging Face hub into its cache")
    pull.add_argument("repo", help="a hub repository, owner/name")
    pull.add_argument("file_or_quant", nargs="?", help="a file name, or a quantization such as Q4_K_M "
                                                      "(may be left out if the repository has one GGUF file)")
    pull.add_argument("--revision", help="a branch, tag or commit (default: main)")
    pull.set_defaults(run=_pull)
    listing = commands.add_parser("models", help="the configured models and the GGUF files in the hub's cache")
    listing.add_argument("--config", help="a TOML configuration file")
    listing.add_argument("--url", help="a running server: say which models it has loaded")
    listing.set_defaults(run=_models)
    rm = commands.add_parser("rm", help="remove a repository's GGUF files from the hub's cache")
    rm.add_argument("repo")
    rm.add_argument("file", nargs="?", help="only this file")
    rm.set_defaults(run=_rm)
    make = commands.add_parser("make-demo-model", help="write a demo GGUF model with random weights")
    make.add_argument("path")
    make.add_argument("--size", choices=["tiny", "medium"], default="tiny")
    make.add_argument("--seed", type=int, default=0)
    make.add_argument("--architecture", choices=["llama", "qwen2"], default="llama")
    make.set_defaults(run=_make_model)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
