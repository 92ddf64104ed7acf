"""A model's runner process (``python -m kronk_wsgi.grpc_worker.runner``), started by a front (serving/runners.py):
the gRPC worker serving that model on a Unix socket, with its settings from the front. It holds the runner's lock
while it lives: the descriptor the front took it on, inherited, never closed."""

import argparse
import os
import sys
from pathlib import Path

from gevent import monkey

monkey.patch_all()  # before gRPC is imported: its calls run as greenlets

from ..config import Settings  # noqa: E402
from ..serving.runners import SETTINGS_VARIABLE, RunnerFiles  # noqa: E402
from .server import serve  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="kronk_wsgi.grpc_worker.runner")
    parser.add_argument("--model", required=True)
    parser.add_argument("--folder", required=True)
    args = parser.parse_args(argv)
    settings = Settings.model_validate_json(os.environ.pop(SETTINGS_VARIABLE))
    files = RunnerFiles(Path(args.folder), args.model)
    users = os.open(files.path("users"), os.O_RDWR)
    files.socket.unlink(missing_ok=True)
    return serve(settings, f"unix:{files.socket}", None, ("vllm",), runner=(files, users))


if __name__ == "__main__":
    sys.exit(main())
