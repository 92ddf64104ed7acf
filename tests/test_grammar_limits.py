"""Hardening, round three: a client's grammar can neither freeze the worker nor fail after the commit unannounced."""

import requests

from kronk_wsgi.engine.gguf_file import read_gguf
from kronk_wsgi.engine.grammar import Grammar, bounded_integers, json_schema_grammar
from kronk_wsgi.engine.tokenizer import GGUFTokenizer

from .support.liveness import liveness_during

CHAT = "/v1/chat/completions"
HI = [{"role": "user", "content": "hi"}]


def nested(rules: int) -> str:
    """GBNF of ``rules`` nested rules, whose conversion grows far faster than its text."""
    return "\n".join(["root ::= r0"] + [f'r{i} ::= "(" r{i + 1} ")" | "x"' for i in range(rules)] + [f'r{rules} ::= "y"'])


def test_a_grammar_too_large_to_convert_is_a_400_and_the_worker_stays_live(server):
    body = {"model": "tiny", "messages": HI, "max_tokens": 2, "grammar": nested(4000)}  # 118 KB: a worker timeout
    reply, slowest = liveness_during(server, lambda: requests.post(server.url + CHAT, json=body, timeout=120))
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "grammar"
    assert "32000 bytes" in reply.json()["error"]["message"] and slowest < 1.0


def test_a_large_grammar_that_is_taken_is_converted_off_the_event_loop(server):
    body = {"model": "tiny", "messages": HI, "max_tokens": 2, "grammar": nested(1000)}  # 28 KB: ~1-2 s to convert
    reply, slowest = liveness_during(server, lambda: requests.post(server.url + CHAT, json=body, timeout=120))
    assert reply.status_code == 200 and slowest < 0.5, slowest


def test_an_unbounded_integer_is_held_to_16_digits_as_llama_cpp_holds_it(smollm2):
    tokenizer = GGUFTokenizer(read_gguf(smollm2))
    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "m": {"type": ["integer", "null"],
                                                                             "maximum": 10**18}}}
    assert bounded_integers(schema)["properties"]["m"] == {"type": ["integer", "null"], "maximum": 10**18,
                                                           "minimum": -(10**16 - 1)}
    constraint = Grammar(tokenizer, frozenset({2}), json_schema_grammar(schema)).constraint()
    for token in tokenizer.encode('{"n": ' + "1" * 16):  # SmolLM2 writes each digit as a token
        assert constraint.allowed()[token]
        constraint.take(token)
    assert not constraint.allowed()[tokenizer.encode("1")[0]]


def test_a_custom_tools_regex_past_the_engines_limits_is_a_400_that_quotes_nothing(server):
    tool = {"type": "custom", "name": "x", "description": "d",
            "format": {"type": "grammar", "syntax": "regex", "definition": "(a{1000}){1000}"}}
    body = {"model": "tiny", "input": "hi", "tools": [tool], "tool_choice": {"type": "custom", "name": "x"},
            "max_output_tokens": 5}
    reply = requests.post(server.url + "/v1/responses", json=body, timeout=120)
    assert reply.status_code == 400 and reply.json()["error"]["code"] == "grammar_error"
    assert "a{1000}" not in reply.text and max(map(len, server.logs().splitlines())) < 5000
