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


def test_a_long_result_is_cut_and_says_so(served):
    text = _call(served, "local_big", size=300_000).json()["plain_text_response"]
    assert text.startswith("x" * 262_144) and text.endswith("[cut: the result had 300000 characters, 262144 are kept]")


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


def _echo_call(message: str) -> str:
    return '<tool_call>\n{"name": "echo", "arguments": {"message": "%s"}}\n</tool_call>' % message


@pytest.fixture(scope="module")
def scripted_mcp(tiny_model, tmp_path_factory, http_mcp):
    from .support.scripted import run_scripted

    tmp = tmp_path_factory.mktemp("mcp-scripted")
    servers = {"local": {"command": sys.executable, "args": [SERVER_SCRIPT], "timeout_ms": 600_000}}
    os.environ["KRONK_MCP_SERVERS"] = json.dumps(servers)
    os.environ["KRONK_MCP_ALLOW"] = http_mcp.removesuffix("mcp")
    try:
        with run_scripted(tmp, {"tiny": {"path": str(tiny_model), "engine": "tests.support.scripted:KIND"}},
                          "tiny") as server:
            yield server
    finally:
        del os.environ["KRONK_MCP_SERVERS"], os.environ["KRONK_MCP_ALLOW"]


def test_responses_mcp_tools_are_listed_called_and_answered_in_one_response(scripted_mcp):
    import openai

    client = openai.OpenAI(base_url=scripted_mcp.url + "/v1", api_key="unused", max_retries=0)
    local = {"type": "mcp", "server_label": "local", "require_approval": "never"}
    scripted_mcp.say(_echo_call("hi"), "The echo said hi.")
    response = client.responses.create(model="tiny", input="Echo hi", tools=[local])
    kinds = [item.type for item in response.output]
    assert kinds == ["mcp_list_tools", "mcp_call", "message"], kinds
    listing, call, _ = response.output
    assert {"echo", "add", "fail"} <= {t.name for t in listing.tools}
    assert (call.name, call.server_label, call.output, call.error) == ("echo", "local", "echo: hi", None)
    assert response.output_text == "The echo said hi."
    scripted_mcp.say(_echo_call("again"), "Done.")
    events = list(client.responses.create(model="tiny", input="Echo again", tools=[local], stream=True))
    kinds = [e.type for e in events]
    for kind in ("response.mcp_list_tools.in_progress", "response.mcp_list_tools.completed",
                 "response.mcp_call.in_progress", "response.mcp_call_arguments.delta",
                 "response.mcp_call_arguments.done", "response.mcp_call.completed", "response.completed"):
        assert kind in kinds, (kind, kinds)
    final = events[-1].response
    assert [i.type for i in final.output] == ["mcp_list_tools", "mcp_call", "message"]
    assert final.output[1].output == "echo: again"
    # The stored conversation has the call and its answer, as the same items handed back would give them.
    def count(**fields) -> int:
        return scripted_mcp.post("/v1/responses/input_tokens", {"model": "tiny", **fields}).json()["input_tokens"]

    handed_back = [{"role": "user", "content": "Echo again"}, final.output[1].model_dump(exclude_none=True),
                   {"role": "assistant", "content": "Done."}, {"role": "user", "content": "Did it work?"}]
    assert count(previous_response_id=final.id, input="Did it work?") == count(input=handed_back)


def test_a_call_waits_for_approval_and_runs_once_approved(scripted_mcp):
    import openai

    client = openai.OpenAI(base_url=scripted_mcp.url + "/v1", api_key="unused", max_retries=0)
    local = {"type": "mcp", "server_label": "local"}  # require_approval: always, as OpenAI's default
    scripted_mcp.say(_echo_call("approve me"))
    asked = client.responses.create(model="tiny", input="Echo", tools=[local])
    assert [i.type for i in asked.output] == ["mcp_list_tools", "mcp_approval_request"]
    request = asked.output[1]
    scripted_mcp.say("It echoed.")
    approved = client.responses.create(model="tiny", previous_response_id=asked.id, tools=[local], input=[
        {"type": "mcp_approval_response", "approval_request_id": request.id, "approve": True}])
    assert [i.type for i in approved.output] == ["mcp_list_tools", "mcp_call", "message"]
    assert approved.output[1].approval_request_id == request.id and approved.output[1].output == "echo: approve me"
    scripted_mcp.say("Declined, then.")
    declined = client.responses.create(model="tiny", previous_response_id=asked.id, tools=[local], input=[
        {"type": "mcp_approval_response", "approval_request_id": request.id, "approve": False}])
    assert [i.type for i in declined.output] == ["mcp_list_tools", "message"]


def test_a_request_names_only_servers_the_operator_allows(scripted_mcp, http_mcp):
    remote = {"type": "mcp", "server_label": "remote", "server_url": http_mcp, "require_approval": "never",
              "allowed_tools": ["add"], "headers": {"X-Secret": "s3cret"}}
    scripted_mcp.say('<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 2}}\n</tool_call>', "Four.")
    answer = scripted_mcp.post("/v1/responses", {"model": "tiny", "input": "2+2", "tools": [remote]})
    assert answer.status_code == 200, answer.text
    listing, call, _ = answer.json()["output"]
    assert [t["name"] for t in listing["tools"]] == ["add"] and call["output"] == "4.0", json.dumps(call)
    assert "s3cret" not in answer.text  # the request's headers are not echoed
    elsewhere = dict(remote, server_url="http://127.0.0.1:9/mcp")
    refused = scripted_mcp.post("/v1/responses", {"model": "tiny", "input": "x", "tools": [elsewhere]})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "tools[0].server_url"
    unknown = scripted_mcp.post("/v1/responses", {"model": "tiny", "input": "x", "tools": [
        {"type": "mcp", "server_label": "nobody"}]})
    assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "tools[0].server_label"


def test_a_failing_tool_is_the_models_to_read_not_a_500(scripted_mcp):
    local = {"type": "mcp", "server_label": "local", "require_approval": "never"}
    scripted_mcp.say('<tool_call>\n{"name": "fail", "arguments": {"reason": "no such city"}}\n</tool_call>',
                     "It failed.")
    answer = scripted_mcp.post("/v1/responses", {"model": "tiny", "input": "x", "tools": [local]})
    assert answer.status_code == 200, answer.text
    call = answer.json()["output"][1]
    assert call["status"] == "failed" and call["error"]["type"] == "mcp_tool_execution_error"
    assert "no such city" in call["error"]["content"][0]["text"]
    assert answer.json()["output_text"] == "It failed."


def test_a_client_gone_during_a_tool_call_ends_the_loop_and_frees_the_slot(scripted_mcp):
    from kronk_wsgi.testing.rawhttp import RawStream

    local = {"type": "mcp", "server_label": "local", "require_approval": "never"}
    scripted_mcp.say('<tool_call>\n{"name": "slow", "arguments": {"seconds": 120}}\n</tool_call>', "Slept.")
    body = {"model": "tiny", "input": "Sleep", "tools": [local], "stream": True}
    raw = RawStream(scripted_mcp.host, scripted_mcp.port, "/v1/responses", body)
    for _, frame in raw.frames():
        if "response.mcp_call.in_progress" in frame:
            break
    raw.close()
    # Noticed within a second or so: waiting for the call would take the tool's 120 s (its timeout is 10 minutes).
    wait_until(lambda: '"outcome": "client_gone"' in scripted_mcp.logs(), 60)
    scripted_mcp.say("Quick.")
    quick = scripted_mcp.post("/v1/responses", {"model": "tiny", "input": "Hi"})
    assert quick.status_code == 200 and quick.json()["output_text"] == "Quick."


def test_anthropics_mcp_connector_runs_the_servers_tools_in_the_message(scripted_mcp, http_mcp):
    import anthropic

    client = anthropic.Anthropic(base_url=scripted_mcp.url, api_key="unused", max_retries=0)
    servers = [{"type": "url", "url": http_mcp, "name": "remote", "authorization_token": "t0ken"}]
    toolset = {"type": "mcp_toolset", "mcp_server_name": "remote", "default_config": {"enabled": False},
               "configs": {"echo": {"enabled": True}}}
    ask = [{"role": "user", "content": "Echo hi"}]
    scripted_mcp.say(_echo_call("hi"), "It said hi.")
    message = client.beta.messages.create(model="tiny", max_tokens=200, messages=ask, mcp_servers=servers,
                                          tools=[toolset], betas=["mcp-client-2025-11-20"])
    assert [b.type for b in message.content] == ["mcp_tool_use", "mcp_tool_result", "text"]
    use, result, text = message.content
    assert (use.name, use.server_name, use.input) == ("echo", "remote", {"message": "hi"})
    assert result.tool_use_id == use.id and not result.is_error and result.content[0].text == "echo: hi"
    assert text.text == "It said hi." and message.stop_reason == "end_turn"
    scripted_mcp.say(_echo_call("again"), "Again.")
    with client.beta.messages.stream(model="tiny", max_tokens=200, messages=ask, mcp_servers=servers,
                                     tools=[toolset], betas=["mcp-client-2025-11-20"]) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["mcp_tool_use", "mcp_tool_result", "text"]
    assert final.content[0].input == {"message": "again"} and final.content[1].content[0].text == "echo: again"
    # Handed back, the turn's blocks are the call and its answer: counted as the same conversation written out.
    history = ask + [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in message.content]},
                     {"role": "user", "content": "Thanks"}]
    counted = client.beta.messages.count_tokens(model="tiny", messages=history, mcp_servers=servers, tools=[toolset],
                                                betas=["mcp-client-2025-11-20"])
    echo = next(t for t in requests.get(scripted_mcp.url + "/tools", timeout=60).json() if t["tool"] == "local_echo")
    function = echo["definition"]["function"]  # the same server's echo, run by the operator
    written_out = ask + [
        {"role": "assistant", "content": [{"type": "tool_use", "id": use.id, "name": "echo", "input": use.input}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "echo: hi"}]},
        {"role": "assistant", "content": "It said hi."}, {"role": "user", "content": "Thanks"}]
    plain = client.messages.count_tokens(model="tiny", messages=written_out, tools=[
        {"name": "echo", "description": function["description"], "input_schema": function["parameters"]}])
    assert counted.input_tokens == plain.input_tokens
    elsewhere = scripted_mcp.post("/v1/messages", {"model": "tiny", "max_tokens": 5, "messages": ask, "mcp_servers": [
        {"type": "url", "url": "http://127.0.0.1:9/mcp", "name": "x"}]})
    assert elsewhere.status_code == 400 and elsewhere.json()["error"]["message"].startswith("mcp_servers[0].url")


NODE_MODULES = Path(os.environ.get("KRONK_TEST_NODE_MODULES", "/nonexistent"))
FILESYSTEM = NODE_MODULES / ".bin" / "mcp-server-filesystem"


@pytest.fixture(scope="module")
def with_files(tiny_model, tmp_path_factory):
    if not FILESYSTEM.exists():
        if os.environ.get("KRONK_TEST_REQUIRE_NPM"):
            raise RuntimeError("@modelcontextprotocol/server-filesystem is required (KRONK_TEST_REQUIRE_NPM)")
        pytest.skip("@modelcontextprotocol/server-filesystem is not installed (KRONK_TEST_NODE_MODULES)")
    folder = tmp_path_factory.mktemp("files")
    (folder / "note.txt").write_text("the key is under the mat\n")
    servers = {"files": {"command": str(FILESYSTEM), "args": [str(folder)]}}
    env = {"KRONK_MODELS": json.dumps({"tiny": {"path": str(tiny_model)}}), "KRONK_MCP_SERVERS": json.dumps(servers)}
    with run_server(tmp_path_factory.mktemp("files-server"), env) as server:
        yield server, folder


def test_an_npm_stdio_server_reads_its_folder_and_nothing_outside_it(with_files):
    server, folder = with_files
    names = {t["tool"] for t in requests.get(server.url + "/tools", timeout=60).json()}
    assert {"files_read_text_file", "files_list_directory"} <= names, names
    read = _call(server, "files_read_text_file", path=str(folder / "note.txt")).json()
    assert read == {"plain_text_response": "the key is under the mat\n"}
    listed = _call(server, "files_list_directory", path=str(folder)).json()
    assert "note.txt" in listed["plain_text_response"]
    outside = _call(server, "files_read_text_file", path="/etc/passwd").json()
    assert "error" in outside and "denied" in outside["error"].lower(), outside
