"""The browser console in a real headless Chromium against a real server: chat, streaming, stop, models.

Chromium comes from Debian (chromium-headless-shell; .ci/run installs it). Without
it these tests are skipped, unless KRONK_TEST_REQUIRE_BROWSER=1 (as in CI) makes
that a failure. The page's screenshot is kept in test-artifacts/console.png.
"""

import json
import os
import time
from pathlib import Path

import pytest
import requests

from .conftest import FAULTY, ROOT, run_server
from .support.browser import Browser, find_chromium

ARTIFACTS = Path(os.environ.get("KRONK_TEST_ARTIFACTS") or ROOT / "test-artifacts")


@pytest.fixture(scope="module")
def chromium():
    binary = find_chromium()
    if binary is None:
        if os.environ.get("KRONK_TEST_REQUIRE_BROWSER") == "1":
            pytest.fail("Chromium is required (KRONK_TEST_REQUIRE_BROWSER=1) but not installed")
        pytest.skip("Chromium is not installed (apt-get install chromium-headless-shell)")
    browser = Browser(binary)
    yield browser
    browser.close()


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    """The tiny model, and "slow": the same, writing a token every 50 ms."""
    models = {"tiny": {"path": str(tiny_model)}, "slow": {"path": str(tiny_model), "engine": FAULTY}}
    env = {"KRONK_MODELS": json.dumps(models), "KRONK_DEFAULT_MODEL": "tiny", "KRONK_TEST_STEP_DELAY": "0.05"}
    with run_server(tmp_path_factory.mktemp("console"), env) as server:
        yield server


def ask(browser: Browser, model: str, prompt: str, max_tokens: int) -> None:
    browser.js(f"document.getElementById('model').value = {json.dumps(model)}")
    browser.js(f"document.getElementById('max-tokens').value = {max_tokens}")
    browser.js(f"document.getElementById('prompt').value = {json.dumps(prompt)}")
    browser.js("document.getElementById('send').click()")


LAST_REPLY = "document.querySelector('#transcript .message.assistant:last-child')"


def test_a_prompt_typed_streams_its_reply(chromium, server):
    chromium.goto(server.url + "/console")  # redirected to /console/
    assert chromium.js("location.pathname") == "/console/"
    chromium.wait_for("document.querySelectorAll('#model option').length === 2")
    assert chromium.js("[...document.querySelectorAll('#model option')].map(o => o.value)") == ["tiny", "slow"]
    ask(chromium, "tiny", "Hello there", 24)
    meta = chromium.wait_for(f"{LAST_REPLY} && {LAST_REPLY}.querySelector('.meta').textContent")
    assert "tokens in" in meta and "finish:" in meta
    text = chromium.js(f"{LAST_REPLY}.querySelector('span').textContent")
    assert text.strip()
    assert chromium.js("document.querySelector('#transcript .message.user').textContent") == "Hello there"
    assert 1 <= int(meta.split()[0]) <= 24  # "N tokens in ...": the usage chunk of the stream


def test_stop_ends_the_stream_and_frees_the_model(chromium, server):
    ask(chromium, "slow", "Tell me a long story", 1500)
    chromium.wait_for(f"{LAST_REPLY}.querySelector('span').textContent.length > 20")  # streaming: text arrives
    assert chromium.js("document.getElementById('stop').disabled") is False
    chromium.js("document.getElementById('stop').click()")
    assert chromium.wait_for(f"{LAST_REPLY}.querySelector('.meta').textContent") == "stopped"
    assert chromium.js("document.getElementById('send').disabled") is False
    partial = chromium.js(f"{LAST_REPLY}.querySelector('span').textContent")
    # the server saw the client go and freed the slot: a new request on "slow" is served at once
    deadline = time.monotonic() + 30
    while not any('"outcome": "client_gone"' in line and '"model": "slow"' in line for line in server.logs().splitlines()):
        assert time.monotonic() < deadline, "the server never logged the stopped stream"
        time.sleep(0.1)
    reply = requests.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": "slow", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert reply.status_code == 200 and len(partial) > 20


def test_the_models_list_shows_what_is_loaded(chromium, server):
    chromium.js("loadAdminModels()")
    rows = chromium.wait_for("(() => { const r = [...document.querySelectorAll('#models tr')]"
                             ".map(tr => [...tr.cells].map(c => c.textContent)); return r.length === 2 && r; })()")
    states = {row[0]: row[2] for row in rows}
    assert states["tiny"].startswith("yes") and states["slow"].startswith("yes")
    assert "slots busy" in states["tiny"]
    chromium.screenshot(ARTIFACTS / "console.png")
    assert (ARTIFACTS / "console.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
