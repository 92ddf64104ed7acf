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

    print(write_demo_model(args.path, args.size, args.seed))
    return 0


def _inspect(args: argparse.Namespace) -> int:
    from pathlib import Path

    from .catalog import describe
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
    make = commands.add_parser("make-demo-model", help="write a demo GGUF model with random weights")
    make.add_argument("path")
    make.add_argument("--size", choices=["tiny", "medium"], default="tiny")
    make.add_argument("--seed", type=int, default=0)
    make.set_defaults(run=_make_model)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
