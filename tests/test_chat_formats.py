"""Replies read as llama.cpp reads them, family by family: the cases of llama.cpp's tests/test-chat.cpp that a
chat request can express (tests/data/chat_replies.json, written from it by tests/support/chat_cases.py), each
run on its real chat template.

A case's template is rendered for a user's turn (with the case's tools and thinking switch), the reply is read
as the server reads it (the template's format and thinking tags, the prompt's open thinking block, the case's
reasoning_format, the reply ending at the turn's closing marker) whole and in 3-character pieces, and the
reply's text, reasoning and calls must be llama.cpp's: text and reasoning compared
without the white space at their ends (which the server trims around calls), arguments as JSON values.
"""

import dataclasses
import json
from pathlib import Path

import pytest

from kronk_wsgi.api.planning import call_format, reply_reading
from kronk_wsgi.engine.chat_template import ChatTemplate
from kronk_wsgi.engine.gguf_file import read_gguf
from kronk_wsgi.engine.grammar import Grammar, lark_after, lark_json
from kronk_wsgi.engine.tokenizer import GGUFTokenizer
from kronk_wsgi.serving.events import ArgumentsDelta, ReasoningDelta, TextDelta, ToolCall, ToolCallStart
from kronk_wsgi.serving.formats import FORMATS, Call, ToolCallRules, reply_end
from kronk_wsgi.serving.jobs import ReplyReader
from kronk_wsgi.testing import fetch_llama_cpp_templates

from .support.gguf_headers import write_header

DATA = json.loads((Path(__file__).parent / "data" / "chat_replies.json").read_text(encoding="utf-8"))
TOOLS = {name: {"type": "function", "function": tool} for name, tool in DATA["tools"].items()}


# What the server does not read as llama.cpp does yet, by case (template without .jinja, and line).
NOT_YET = dict.fromkeys(
    ["google-gemma-4-31B-it:3011", "openai-gpt-oss-120b:6458"],
    "reasoning_format none: llama.cpp writes a channel format's thinking frame back into the answer (Gemma 4's "
    "thought channel, Harmony's analysis message); here the answer is the reply's text, its format's markers left out")
NOT_YET["inclusionai-ling-3.0-flash:4716"] = (
    "reasoning_format none: Ling 3's parser leaves out the <think> its prompt opened, where GLM's keeps it in the "
    "answer; both are read as glm-xml here, which keeps it")


def case_id(case: dict) -> str:
    return f"{case['template'].removesuffix('.jinja')}:{case['line']}"


@pytest.fixture(scope="module")
def templates() -> Path:
    return fetch_llama_cpp_templates()


def read(template: ChatTemplate, case: dict, size: int) -> dict:
    """What the reply reads as, fed in pieces of ``size`` characters."""
    tools = [TOOLS[name] for name in case["tools"]]
    rendered = template.render([{"role": "user", "content": "Hey there!"}], tools or None, case["enable_thinking"])
    reading = reply_reading(template, rendered.text, case["reasoning_format"] not in (None, "none"))
    if tools:
        rules = ToolCallRules(call_format(template), lambda name, arguments: True,
                              {t["function"]["name"]: t["function"]["parameters"] for t in tools})
        reading = dataclasses.replace(reading, tool_rules=rules)
    reader = ReplyReader(reading)
    end = reply_end(template)  # the server ends a reply there, as at an end token
    reply = case["reply"].partition(end)[0] if end else case["reply"]
    pieces = [reply[i:i + size] for i in range(0, len(reply), size)]
    events = [e for piece in pieces for e in reader.feed(piece)] + reader.finish()
    assert_streamed_calls_add_up(events)
    return {
        "content": "".join(e.text for e in events if isinstance(e, TextDelta)).strip(),
        "reasoning_content": "".join(e.text for e in events if isinstance(e, ReasoningDelta)).strip(),
        "tool_calls": [{"name": e.name, "arguments": json.loads(e.arguments)} for e in events
                       if isinstance(e, ToolCall)],
    }


def assert_streamed_calls_add_up(events: list) -> None:
    """A started call ends, once, and its argument deltas are the start of its arguments."""
    sent: dict[str, str] = {}
    for event in events:
        if isinstance(event, ToolCallStart):
            assert event.id not in sent
            sent[event.id] = ""
        elif isinstance(event, ArgumentsDelta):
            sent[event.id] += event.text
        elif isinstance(event, ToolCall) and event.id in sent:
            assert event.arguments.startswith(sent.pop(event.id))
    assert not sent, "started calls that never ended"


def expected(case: dict) -> dict:
    want = case["expect"]
    return {
        "content": want["content"].strip(),
        "reasoning_content": want["reasoning_content"].strip(),
        "tool_calls": [{"name": c["name"], "arguments": json.loads(c["arguments"] or "{}")} for c in want["tool_calls"]],
    }


@pytest.mark.parametrize("case", [
    pytest.param(case, marks=pytest.mark.xfail(reason=NOT_YET[case_id(case)], strict=True))
    if case_id(case) in NOT_YET else case for case in DATA["cases"]], ids=case_id)
def test_a_reply_reads_as_llama_cpp_reads_it(case, templates):
    template = ChatTemplate((templates / case["template"]).read_text(encoding="utf-8"), "<s>", "</s>")
    assert read(template, case, len(case["reply"]) or 1) == expected(case)
    assert read(template, case, 3) == expected(case)


WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                            "units": {"type": "string", "enum": ["c", "f"]}},
           "required": ["city", "days"]}
WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "", "parameters": WEATHER}}


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2):
    return GGUFTokenizer(read_gguf(smollm2))


def walk(tokenizer, grammar: str, text: str) -> bool:
    """Whether ``text`` is what the grammar holds a reply to, token by token, to its end."""
    constraint = Grammar(tokenizer, frozenset({tokenizer.eos_id}), grammar).constraint()
    for token in tokenizer.encode(text):
        if not constraint.allowed()[token]:
            return False
        constraint.take(token)
    return constraint.complete or bool(constraint.allowed()[tokenizer.eos_id])


@pytest.mark.parametrize("form", FORMATS, ids=lambda f: f.name)
def test_a_forced_call_is_held_to_what_the_format_reads_back(form, smollm2_tokenizer):
    call = Call("get_weather", {"city": "Paris <b>", "days": 3})
    schemas = {"get_weather": WEATHER}
    text = form.written([call], schemas)
    reader = form.reader(ToolCallRules(form, lambda name, arguments: True, schemas))
    events = reader.feed(text) + reader.flush()
    assert [(e.name, json.loads(e.arguments)) for e in events if isinstance(e, ToolCall)] == \
        [("get_weather", call.arguments)], events
    opening = form.opening("get_weather")
    assert text.startswith(opening)
    forced = form.grammar([WEATHER_TOOL], frozenset({"get_weather"}), {}, "get_weather")
    assert walk(smollm2_tokenizer, forced, text[len(opening):])
    assert not walk(smollm2_tokenizer, forced, text[len(opening):].replace("3", '"3"'))  # against the schema
    held = form.grammar([WEATHER_TOOL], frozenset({"get_weather"}), {}, forced=False)  # after opens[0]
    assert walk(smollm2_tokenizer, held, text.partition(form.opens[0])[2] if form.opens[0] in text else text)


@pytest.mark.parametrize("form", [f for f in FORMATS if f.opens[0] in f.written([Call("f", {})], {})],
                         ids=lambda f: f.name)
def test_a_grammar_held_after_a_tag_holds_a_whole_reply_as_it_is_held_here(form, smollm2_tokenizer):
    """What a worker elsewhere is sent for a call the model may open (lark_after): free text until the format's
    opening, then the calls' grammar, as a reply with ``constrain_after`` is held here."""
    text = form.written([Call("get_weather", {"city": "Paris", "days": 3})], {"get_weather": WEATHER})
    held = form.grammar([WEATHER_TOOL], frozenset({"get_weather"}), {}, forced=False)
    whole = lark_after(form.opens[0], held, {})
    assert walk(smollm2_tokenizer, whole, "Let me look that up.\n" + text)
    assert walk(smollm2_tokenizer, whole, "It is sunny in Paris, 3 days long.")  # no call: free to the end
    assert not walk(smollm2_tokenizer, whole, "Let me look.\n" + text.replace("3", '"3"'))  # a call held to it
    assert not walk(smollm2_tokenizer, whole, "One: " + text + " and " + text)  # text between calls: not theirs


def test_a_schema_held_after_a_control_token_starts_at_the_token_or_its_text(smollm2_tokenizer):
    """A thinking model's answer held to a schema once the thinking closes: the tag written as its control token
    (here ChatML's) or as text starts the schema."""
    tag = "<|im_start|>"
    control = {tag: smollm2_tokenizer.control[tag]}
    whole = lark_after(tag, "start: " + lark_json(WEATHER), control)
    tokens = smollm2_tokenizer.encode("thinking ") + [control[tag]] + smollm2_tokenizer.encode('{"city": "Rome", "days": 2}')
    constraint = Grammar(smollm2_tokenizer, frozenset({smollm2_tokenizer.eos_id}), whole).constraint()
    for token in tokens:
        assert constraint.allowed()[token]
        constraint.take(token)
    assert constraint.complete or constraint.allowed()[smollm2_tokenizer.eos_id]
    assert walk(smollm2_tokenizer, whole, 'thinking <|im_start|>{"city": "Rome", "days": 2}')
    assert not walk(smollm2_tokenizer, whole, "thinking <|im_start|>Rome")


def test_gpt_oss_replies_end_at_return_or_call_not_at_the_end_of_a_message(tmp_path):
    harmony = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>")
    tokenizer = GGUFTokenizer(read_gguf(write_header(tmp_path / "oss.gguf", eos=0, markers=harmony)))
    assert {tokenizer.token_text(i) for i in tokenizer.end_ids} == {"<|endoftext|>", "<|return|>", "<|call|>"}
    chatml = GGUFTokenizer(read_gguf(write_header(tmp_path / "phi.gguf", eos=0, markers=("<|end|>",))))
    assert {chatml.token_text(i) for i in chatml.end_ids} == {"<|endoftext|>", "<|end|>"}
