"""Balancers in front of real servers: nginx running the shipped conf/nginx.conf, and the SGLang gateway's router
(PyPI sglang-router), for the tests and the benchmarks."""

import contextlib
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator, Optional, Sequence

import requests

from . import free_port, wait_until_listening

ROOT = Path(__file__).resolve().parents[2]


@contextlib.contextmanager
def run_nginx(tmp_path: Path, upstream_ports: Sequence[int], read_timeout: Optional[int] = None
              ) -> Iterator[tuple[str, int]]:
    """nginx running conf/nginx.conf as shipped, but for its listen port, its upstream ports and (if given) its
    read timeout; (url, port)."""
    port = free_port()
    conf = (ROOT / "conf" / "nginx.conf").read_text()
    conf, n_listen = re.subn(r"listen 80;", f"listen 127.0.0.1:{port};", conf)
    servers = "\n    ".join(f"server 127.0.0.1:{p} max_fails=0;" for p in upstream_ports)
    conf, n_upstream = re.subn(r"server 127\.0\.0\.1:8000 max_fails=0;", servers, conf)
    if read_timeout is not None:
        conf, n_timeout = re.subn(r"proxy_read_timeout \d+s;", f"proxy_read_timeout {read_timeout}s;", conf)
        assert n_timeout == 1, "conf/nginx.conf changed shape"
    assert n_listen == n_upstream == 1, "conf/nginx.conf changed shape"
    (tmp_path / "kronk.conf").write_text(conf)
    main = tmp_path / "nginx.conf"
    main.write_text(f"""
        user root;
        daemon off;
        worker_processes 1;
        pid {tmp_path}/nginx.pid;
        error_log {tmp_path}/error.log info;
        events {{ worker_connections 256; }}
        http {{
            access_log off;
            client_body_temp_path {tmp_path}/body;
            proxy_temp_path {tmp_path}/proxy;
            include {tmp_path}/kronk.conf;
        }}
    """)
    proc = subprocess.Popen(["nginx", "-c", str(main), "-p", str(tmp_path)], stderr=subprocess.PIPE)
    try:
        wait_until_listening(proc, port, 30, lambda why: f"nginx {why}: {proc.stderr.read().decode()}")
        yield f"http://127.0.0.1:{port}", port
    finally:
        proc.terminate()
        proc.wait(timeout=15)


@contextlib.contextmanager
def run_router(tmp_path: Path, urls: Sequence[str], model: str, policy: str = "round_robin") -> Iterator[str]:
    """The SGLang router over ``urls``, without its circuit breaker (as the README says); its url once it has
    answered a chat request for ``model``."""
    port = free_port()
    log = tmp_path / f"router-{port}.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
                                 "--port", str(port), "--worker-urls", *urls, "--policy", policy,
                                 "--disable-circuit-breaker", "--health-check-interval-secs", "1",
                                 "--worker-startup-timeout-secs", "60"], stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, log.read_text()
            with contextlib.suppress(requests.ConnectionError):
                if requests.post(url + "/v1/chat/completions", timeout=30, json={
                        "model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1,
                }).status_code == 200:
                    break
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)
