"""Chat templates chosen for files that ship none, by their vocabulary's turn markers; tools written into the
messages of templates that render none; a turn's closing marker that ends the reply."""

import pytest

from kronk_wsgi.describe import describe
from kronk_wsgi.engine.chat_template import BUILTIN_TEMPLATES, ChatTemplate
from kronk_wsgi.engine.gguf_file import read_gguf
from kronk_wsgi.engine.tokenizer import GGUFTokenizer
from kronk_wsgi.serving.formats import tool_rendering

from .support.gguf_headers import write_header

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}]

FAMILIES = [
    (("<start_of_turn>", "<end_of_turn>"), "gemma", "<end_of_turn>",
     "<s><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello.<end_of_turn>\n"
     "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n"),
    (("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"), "llama3", "<|eot_id|>",
     "<s><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|><|start_header_id|>user<|end_header_id|>"
     "\n\nHi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nHello.<|eot_id|><|start_header_id|>user"
     "<|end_header_id|>\n\nBye<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"),
    (("<|im_start|>", "<|im_end|>"), "chatml", "<|im_end|>",
     "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello."
     "<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n"),
    (("[INST]", "[/INST]"), "mistral", None, "<s>[INST] Be brief.\n\nHi [/INST]Hello.</s>[INST] Bye [/INST]"),
    (("<|user|>", "<|assistant|>", "<|end|>", "<|system|>"), "phi3", "<|end|>",
     "<|system|>\nBe brief.<|end|>\n<|user|>\nHi<|end|>\n<|assistant|>\nHello.<|end|>\n<|user|>\nBye<|end|>\n"
     "<|assistant|>\n"),
]


@pytest.mark.parametrize("markers, name, closing, rendered", FAMILIES, ids=[f[1] for f in FAMILIES])
def test_a_file_without_a_template_gets_the_one_its_vocabulary_names(tmp_path, markers, name, closing, rendered):
    path = write_header(tmp_path / "m.gguf", markers=markers, eos=0)
    control = GGUFTokenizer(read_gguf(path)).control
    template = ChatTemplate.for_model(None, None, "<s>", "</s>", control)
    assert template.source == BUILTIN_TEMPLATES[name]
    assert template.render(CHAT).text == rendered
    assert template.closing_text() == closing and (closing is None or closing in control)  # an end token
    assert f"the built-in {name}" in dict(describe(path))["chat template"]


def test_a_vocabulary_with_no_known_markers_gets_chatml_and_its_marker_as_text(tmp_path):
    path = write_header(tmp_path / "m.gguf", markers=(), eos=0)
    control = GGUFTokenizer(read_gguf(path)).control
    template = ChatTemplate.for_model(None, None, "<s>", "</s>", control)
    assert template.source == BUILTIN_TEMPLATES["chatml"]
    assert template.closing_text() == "<|im_end|>" and "<|im_end|>" not in control  # text only: a stop


def test_tools_on_a_template_that_renders_none_are_written_into_the_messages():
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    conversation = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
    ]
    plain = ChatTemplate(BUILTIN_TEMPLATES["plain"])
    assert not plain.renders_tools and "Hermes" in tool_rendering(plain)
    text = plain.render(conversation, tools).text
    system, rest = text.split("\nuser: ", 1)
    assert system.startswith("system: Be brief.\n\n# Tools") and '{"type": "function", "function": {"name": ' in system
    assert 'assistant: <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in rest
    assert "user: <tool_response>\nsunny\n</tool_response>" in rest
    assert plain.render(conversation[:2]).text == "system: Be brief.\nuser: Weather?\nassistant: "  # no tools: as is
    assert ChatTemplate(BUILTIN_TEMPLATES["chatml"]).renders_tools


def test_inspect_says_how_tools_reach_the_model(tmp_path):
    path = write_header(tmp_path / "m.gguf", markers=("<start_of_turn>", "<end_of_turn>"), eos=0)
    assert "built-in Hermes text" in dict(describe(path))["tools"]


def test_a_final_assistant_message_is_continued_where_its_text_ends():
    chatml = ChatTemplate(BUILTIN_TEMPLATES["chatml"], control_tokens=["<|im_start|>", "<|im_end|>"])
    prefill = [{"role": "user", "content": "JSON?"}, {"role": "assistant", "content": '{"a": '}]
    text = chatml.render(prefill, continue_final=True).text
    assert text == '<|im_start|>user\nJSON?<|im_end|>\n<|im_start|>assistant\n{"a": '
    gemma = ChatTemplate(BUILTIN_TEMPLATES["gemma"], "<bos>")
    assert gemma.render(prefill, continue_final=True).text.endswith('<start_of_turn>model\n{"a": ')
    with pytest.raises(ValueError):
        chatml.render(prefill[:1], continue_final=True)  # the last message is not the assistant's


def test_templates_compile_as_hugging_face_compiles_them():
    """Loop controls and the generation tag (Command R7B, Kimi, LFM2.5 and Laguna templates use them)."""
    source = ("{% for message in messages %}{% if message.role == 'tool' %}{% continue %}{% endif %}"
              "{% if loop.index > 3 %}{% break %}{% endif %}"
              "{% if message.role == 'assistant' %}{% generation %}A: {{ message.content }}{% endgeneration %}"
              "{% else %}U: {{ message.content }}{% endif %}\n{% endfor %}")
    messages = [{"role": "user", "content": "hi"}, {"role": "tool", "content": "t", "tool_call_id": "1"},
                {"role": "assistant", "content": "hello"}, {"role": "user", "content": "cut"}]
    assert ChatTemplate(source).render(messages).text == "U: hiA: hello"  # trim_blocks takes the newlines
