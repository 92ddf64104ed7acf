"""Tool calls parsed out of streamed text, whatever the split of the stream."""

import json

import pytest

from kronk_wsgi.engine.chat_template import ChatTemplate
from kronk_wsgi.serving.events import ArgumentsDelta, TextDelta, ToolCall, ToolCallStart
from kronk_wsgi.serving.formats import FORMATS, HERMES, Call, ToolCallRules, format_of, mistral

MISTRAL = mistral.V3

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris"}}'


def parse(form, pieces, accept=lambda name, arguments: True):
    parser = form.reader(ToolCallRules(form, accept))
    events = [e for piece in pieces for e in parser.feed(piece)] + parser.flush()
    text = "".join(e.text for e in events if isinstance(e, TextDelta))
    calls = [(e.name, json.loads(e.arguments)) for e in events if isinstance(e, ToolCall)]
    return text, calls, parser.calls


def splits(text):
    """The text whole, char by char, and in 3-char pieces."""
    return [[text], list(text), [text[i:i + 3] for i in range(0, len(text), 3)]]


@pytest.mark.parametrize("pieces", splits(f"Let me look.\n<tool_call>\n{WEATHER}\n</tool_call>\n"))
def test_hermes_call_after_text(pieces):
    assert parse(HERMES, pieces) == ("Let me look.", [("get_weather", {"city": "Paris"})], 1)


@pytest.mark.parametrize("pieces", splits(
    '<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>{"name": "b", "parameters": {"x": [1, 2]}}</tool_call>'
))
def test_two_hermes_calls_and_the_parameters_spelling(pieces):
    assert parse(HERMES, pieces) == ("", [("a", {}), ("b", {"x": [1, 2]})], 2)


def test_arguments_written_as_a_json_string():
    assert parse(HERMES, ['<tool_call>{"name": "a", "arguments": "{\\"k\\": 1}"}</tool_call>'])[1] == [("a", {"k": 1})]


@pytest.mark.parametrize("text", [
    "<tool_call>{not json}</tool_call>",
    '<tool_call>{"arguments": {}}</tool_call>',
    '<tool_call>{"name": 5, "arguments": {}}</tool_call>',
    '<tool_call>{"name": "a", "arguments": [1]}</tool_call>',
    '<tool_call>{"name": "a", "arguments": "not json"}</tool_call>',
    '<tool_call>{"name": "a", "arguments": {}}',  # never closed
    "a < b and <tool but not a call",
])
def test_malformed_calls_stay_text(text):
    assert parse(HERMES, list(text)) == (text, [], 0)


@pytest.mark.parametrize("pieces", splits('[TOOL_CALLS][{"name": "a", "arguments": {"q": "x"}}, {"name": "b", "arguments": {}}]'))
def test_mistral_calls_run_to_the_end(pieces):
    assert parse(MISTRAL, pieces) == ("", [("a", {"q": "x"}), ("b", {})], 2)


def test_calls_the_tools_do_not_accept_stay_text():
    only_a = lambda name, arguments: name == "a" and arguments == {}  # noqa: E731
    text = '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", "arguments": {}}</tool_call>'
    assert parse(HERMES, [text], only_a) == ('<tool_call>{"name": "b", "arguments": {}}</tool_call>', [("a", {})], 1)
    both = '[TOOL_CALLS][{"name": "a", "arguments": {}}, {"name": "a", "arguments": {"x": 1}}]'
    assert parse(MISTRAL, [both], only_a) == (both, [], 0)  # one body: all of it is a call, or none


def test_text_around_a_call_keeps_its_inner_whitespace():
    text, calls, _ = parse(HERMES, ["Hi  there\n\n", f"<tool_call>{WEATHER}</tool_call>", "\n\nDone. "])
    assert text == "Hi  thereDone. " and len(calls) == 1


def test_forced_opening_continues_inside_a_call():
    for form, rest in ((HERMES, '{"city": "Paris"}}\n</tool_call>'), (MISTRAL, '{"city": "Paris"}}]')):
        assert parse(form, [form.opening("get_weather"), rest])[1] == [("get_weather", {"city": "Paris"})]


def test_format_follows_the_template():
    assert format_of("{{ '[TOOL_CALLS]' }}") is MISTRAL
    assert format_of(ChatTemplate.for_model("chatml", None, "<s>", "</s>").source) is HERMES


@pytest.mark.parametrize("pieces", splits('<tool_call>\n{"name": "sql"}\nSELECT "a"\n  FROM b\n</tool_call>'))
def test_a_raw_input_call_is_read_for_the_tools_called_so(pieces):
    parser = HERMES.reader(ToolCallRules(HERMES, lambda name, arguments: True, raw_inputs=frozenset({"sql"})))
    events = [e for piece in pieces for e in parser.feed(piece)] + parser.flush()
    assert [(e.name, json.loads(e.arguments)) for e in events] == [("sql", {"input": 'SELECT "a"\n  FROM b'})]
    other = '<tool_call>\n{"name": "shell"}\nls\n</tool_call>'  # not a raw-input tool: text, as any bad call
    assert parse(HERMES, [other]) == (other, [], 0)


WRITE_SCHEMA = {"type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"},
                                                 "mode": {"type": "integer"}}}
STREAMED = [f for f in FORMATS if f.streams_calls]


def test_the_formats_most_models_write_stream_their_calls():
    assert {f.name for f in STREAMED} >= {"hermes", "qwen3-coder-xml", "harmony", "mistral-v11", "mistral-v3",
                                         "llama3-json", "glm-xml", "minimax-xml", "deepseek-v3.1", "kimi-k2",
                                         "functionary-v3.2", "deepseek-dsml-tool-calls"}


@pytest.mark.parametrize("form", STREAMED, ids=lambda f: f.name)
def test_a_call_streams_its_arguments_as_they_are_written(form):
    content = "line one\n\tline \"two\" \\ with <angles> & more\n" * 20
    arguments = {"path": "notes/a.txt", "content": content, "mode": 420}
    schemas = {"write_file": WRITE_SCHEMA}
    reply = form.written([Call("write_file", arguments)], schemas)
    reader = form.reader(ToolCallRules(form, lambda name, arguments: True, schemas))
    middle = reply.index("line one")
    events, before_half = [], None
    for at in range(0, len(reply), 3):
        events += reader.feed(reply[at:at + 3])
        if before_half is None and at > middle + len(content) // 2:
            before_half = list(events)
    events += reader.flush()
    starts = [e for e in events if isinstance(e, ToolCallStart)]
    ends = [e for e in events if isinstance(e, ToolCall)]
    assert [(s.id, s.name) for s in starts] == [(e.id, e.name) for e in ends] == [(starts[0].id, "write_file")]
    sent_early = "".join(e.text for e in before_half if isinstance(e, ArgumentsDelta))
    assert len(sent_early) > len(content) // 2, "the arguments wait for the call's end"
    sent = "".join(e.text for e in events if isinstance(e, ArgumentsDelta))
    assert ends[0].arguments.startswith(sent) and json.loads(ends[0].arguments) == arguments
    assert not [e for e in events if isinstance(e, TextDelta) and e.text.strip()]


@pytest.mark.parametrize("form", STREAMED, ids=lambda f: f.name)
def test_a_call_cut_off_by_the_token_limit_ends_with_what_was_written(form):
    schemas = {"write_file": WRITE_SCHEMA}
    reply = form.written([Call("write_file", {"path": "a.txt", "content": "x" * 40})], schemas)
    cut = reply[:reply.index("x" * 20) + 20]
    reader = form.reader(ToolCallRules(form, lambda name, arguments: True, schemas))
    events = [e for at in range(0, len(cut), 3) for e in reader.feed(cut[at:at + 3])] + reader.flush(cut=True)
    call = next(e for e in events if isinstance(e, ToolCall))
    assert not call.complete and call.arguments == "".join(e.text for e in events if isinstance(e, ArgumentsDelta))
    assert '"a.txt"' in call.arguments and "x" * 20 in call.arguments


def test_a_call_of_a_tool_not_offered_is_not_started_and_stays_text():
    schemas = {"write_file": WRITE_SCHEMA}
    text = '<tool_call>\n{"name": "delete_all", "arguments": {"now": true}}\n</tool_call>'
    reader = HERMES.reader(ToolCallRules(HERMES, lambda name, arguments: name in schemas, schemas))
    events = [e for c in text for e in reader.feed(c)] + reader.flush()
    assert not [e for e in events if not isinstance(e, TextDelta)]
    assert "".join(e.text for e in events) == text


def test_only_as_many_calls_start_as_the_reply_may_make():
    schemas = {"write_file": WRITE_SCHEMA}
    one = '{"name": "write_file", "arguments": {"path": "a"}}'
    text = f"[TOOL_CALLS][{one}, {one}]"
    reader = MISTRAL.reader(ToolCallRules(MISTRAL, lambda name, arguments: True, schemas, max_calls=1))
    events = [e for c in text for e in reader.feed(c)]
    assert len([e for e in events if isinstance(e, ToolCallStart)]) == 1
    assert [json.loads(e.arguments) for e in events if isinstance(e, ToolCall)] == [{"path": "a"}]
