"""What the SGLang model gateway asks of a worker, on a real server: its probes, and the fields it writes into
every body it routes."""

import requests

SGLANG_CHAT = {"no_stop_trim": False, "ignore_eos": False, "continue_final_message": False,
               "skip_special_tokens": True, "separate_reasoning": True, "stream_reasoning": True,
               "return_hidden_states": False}
HELLO = [{"role": "user", "content": "Hello there"}]


def test_the_gateways_probes(server):
    assert requests.get(server.url + "/health", timeout=10).status_code == 200
    for path in ("/server_info", "/get_server_info"):
        info = requests.get(server.url + path, timeout=10).json()
        assert info["served_model_name"] == "tiny" and info["max_running_requests"] == 1 and info["dp_size"] == 1
    for path in ("/model_info", "/get_model_info"):
        info = requests.get(server.url + path, timeout=10).json()
        assert info["is_generation"] is True and info["model_type"] == "llama"
    (load,) = requests.get(server.url + "/get_load", timeout=10).json()
    assert load["dp_rank"] == 0 and load["num_reqs"] == 0 and load["num_waiting_reqs"] == 0


def test_the_fields_the_gateway_writes_are_taken_at_their_defaults(server):
    chat = server.post("/v1/chat/completions", {"model": "tiny", "messages": HELLO, "max_completion_tokens": 3,
                                                **SGLANG_CHAT})
    assert chat.status_code == 200, chat.text
    completion = server.post("/v1/completions", {"model": "tiny", "prompt": "Once", "max_completion_tokens": 3,
                                                 **SGLANG_CHAT})
    assert completion.status_code == 200 and completion.json()["usage"]["completion_tokens"] <= 3
    response = server.post("/v1/responses", {"model": "tiny", "input": "hi", "max_output_tokens": 3, "priority": 0,
                                             "top_k": -1, "min_p": 0, "repetition_penalty": 1})
    assert response.status_code == 200, response.text
    changed = server.post("/v1/chat/completions", {"model": "tiny", "messages": HELLO, "skip_special_tokens": False})
    assert changed.status_code == 400 and changed.json()["error"]["param"] == "skip_special_tokens"


def test_ignore_eos_runs_to_max_tokens(server):
    reply = server.post("/v1/chat/completions", {"model": "tiny", "messages": HELLO, "max_tokens": 40,
                                                 "ignore_eos": True})
    assert reply.json()["usage"]["completion_tokens"] == 40 and reply.json()["choices"][0]["finish_reason"] == "length"
