"""The models a server answers for: configured ones, and files pulled into the hub's cache under their canonical
names, the same in every worker."""

import time

import pytest
import requests

from kronk_wsgi.config import ModelSpec, Settings
from kronk_wsgi.model_registry import ModelRegistry, canonical_name, hub_source, tag_of
from kronk_wsgi.testing import run_server

from .support.hub import FakeHub

REPO = "someone/tiny-GGUF"


@pytest.mark.parametrize("filename, tag", [
    ("tiny.Q8_0.gguf", "Q8_0"), ("SmolLM2-135M-Instruct-Q4_K_M.gguf", "Q4_K_M"), ("m-IQ2_XXS.gguf", "IQ2_XXS"),
    ("sub/m-Q5_K_S-00001-of-00002.gguf", "Q5_K_S"), ("plain.gguf", "plain.gguf"),
])
def test_a_pulled_files_tag_is_its_quantization(filename, tag):
    assert tag_of(filename) == tag
    assert canonical_name(REPO, filename) == f"hf.co/{REPO}:{tag}"


def test_hub_names_and_the_configuration_is_read_only():
    assert hub_source(f"hf.co/{REPO}:Q8_0") == (REPO, "Q8_0")
    assert hub_source(f"huggingface.co/{REPO}") == (REPO, None) == hub_source(f"hf.co/{REPO}:latest")
    assert hub_source("llama3.2:latest") is None
    registry = ModelRegistry({"a": ModelSpec(path="/x.gguf")})
    with pytest.raises(TypeError):
        registry.configured["b"] = ModelSpec(path="/y.gguf")
    assert registry.get("a") == ModelSpec(path="/x.gguf") and "b" not in registry
    settings = Settings(models={"a": ModelSpec(path="/x.gguf")})
    with pytest.raises(ValueError):
        settings.default_model = "b"  # settings are frozen once made


def test_a_model_pulled_through_one_worker_is_served_by_every_worker(tiny_model, tmp_path):
    with FakeHub() as fake:
        fake.add_file(REPO, tiny_model, "tiny.Q8_0.gguf")
        env = {"HF_ENDPOINT": fake.url, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_DISABLE_TELEMETRY": "1",
               "KRONK_MODELS": f"local={tiny_model}", "KRONK_WORKERS": 2, "KRONK_THREADS": 1}
        with run_server(tmp_path, env) as server:
            name = f"hf.co/{REPO}:Q8_0"
            pulled = requests.post(server.url + "/api/pull", json={"model": name, "stream": False}, timeout=120)
            assert pulled.status_code == 200 and pulled.json()["status"] == "success"
            pids = set()
            deadline = time.monotonic() + 120
            while len(pids) < 2:  # until both workers have answered: each serves the pulled model at once
                assert time.monotonic() < deadline, pids
                listed = requests.get(server.url + "/v1/models", timeout=30).json()["data"]
                assert [m["id"] for m in listed] == ["local", name]
                reply = server.post("/v1/chat/completions", {"model": name, "max_tokens": 2,
                                                             "messages": [{"role": "user", "content": "Hi"}]})
                assert reply.status_code == 200, reply.text
                assert requests.get(f"{server.url}/v1/models/{name}", timeout=30).status_code == 200
                pids.add(requests.get(server.url + "/v1/liveness", timeout=30).json()["pid"])
            missing = server.post("/v1/chat/completions", {"model": f"hf.co/{REPO}:Q2_K", "max_tokens": 2,
                                                           "messages": [{"role": "user", "content": "Hi"}]})
            assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
