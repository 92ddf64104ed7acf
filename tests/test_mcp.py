"""The operator's MCP servers through real gunicorn: a stdio server and a streamable HTTP one, both made with the
mcp package's own server (tests/support/mcp_server.py), listed and called at llama-server's /tools."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import requests

from kronk_wsgi.testing import free_port, wait_until

from .conftest import run_server

SERVER_SCRIPT = str(Path(__file__).parent / "support" / "mcp_server.py")


@pytest.fixture(scope="module")
def http_mcp():
    port = free_port()
    proc = subprocess.Popen([sys.executable, SERVER_SCRIPT, "http", str(port)], stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}/mcp"

    def up() -> bool:
        try:
            requests.get(url, timeout=1)
        except requests.ConnectionError:
            return False
        return True

    wait_until(up, 30)
    yield url
    proc.kill()
    proc.wait()


@pytest.fixture(scope="module")
def served(tiny_model, tmp_path_factory, http_mcp):
    servers = {"mcpServers": {
        "local": {"command": sys.executable, "args": [SERVER_SCRIPT], "timeout_ms": 1500},
        "remote": {"url": http_mcp, "headers": {"X-Test": "1"}},
        "broken": {"command": "no_such_mcp_server_command"},
    }}
    env = {"KRONK_MODELS": json.dumps({"tiny": {"path": str(tiny_model)}}), "KRONK_MCP_SERVERS": json.dumps(servers)}
    with run_server(tmp_path_factory.mktemp("mcp"), env) as server:
        yield server


def _call(server, tool: str, **params) -> requests.Response:
    return server.post("/tools", {"tool": tool, "params": params})


def test_every_servers_tools_are_listed_by_server_and_name(served):
    listed = requests.get(served.url + "/tools", timeout=60)
    assert listed.status_code == 200, listed.text
    names = {t["tool"] for t in listed.json()}
    assert {"local_echo", "local_add", "local_slow", "remote_echo", "remote_add"} <= names
    assert not any(name.startswith("broken_") for name in names)  # it did not start: logged, not fatal
    echo = next(t for t in listed.json() if t["tool"] == "local_echo")
    assert echo["type"] == "mcp" and echo["definition"]["function"]["parameters"]["required"] == ["message"]
    assert "did not start" in served.logs() and "no_such_mcp_server_command" in served.logs()


def test_tools_are_called_over_stdio_and_http(served):
    assert _call(served, "local_echo", message="hello").json() == {"plain_text_response": "echo: hello"}
    assert _call(served, "remote_add", a=3, b=5).json() == {"plain_text_response": "8.0"}


def test_a_tools_failure_and_a_timeout_are_errors_not_500s(served):
    failed = _call(served, "local_fail", reason="no such city")
    assert failed.status_code == 200 and "no such city" in failed.json()["error"]
    slow = _call(served, "local_slow", seconds=10)  # its server's timeout_ms is 1500
    assert slow.status_code == 200 and "did not answer within 1.5 s" in slow.json()["error"]
    assert _call(served, "local_echo", message="after").json() == {"plain_text_response": "echo: after"}
    unknown = _call(served, "local_nothing")
    assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "tool"
    bad = served.post("/tools", {"params": {}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tool"
    assert "Traceback" not in served.logs()


def test_a_server_whose_process_ended_is_started_again(served):
    first = int(_call(served, "local_pid").json()["plain_text_response"])
    os.kill(first, signal.SIGKILL)
    again = _call(served, "local_pid").json()
    assert "error" not in again, again
    assert int(again["plain_text_response"]) != first


def test_bad_mcp_settings_stop_the_server_at_its_start(tiny_model, tmp_path):
    for value in ("not json", str(tmp_path / "missing.json"), '{"mcpServers": {"x": {}}}'):
        env = {"KRONK_MODELS": json.dumps({"tiny": {"path": str(tiny_model)}}), "KRONK_MCP_SERVERS": value}
        with pytest.raises(Exception, match="mcp_servers"):
            with run_server(tmp_path, env):
                pass
