"""Chat messages to prompt text through a Jinja chat template.

Templates come from model files, which are data, not trusted code: they run in
Jinja's immutable sandbox. Models that ship none get a built-in template,
selectable per model in the configuration.

The template's own markers (``<|im_start|>``) become control tokens when the
prompt is tokenized; the same text inside a message must not. Before
rendering, every control token's text found in what the client sent (contents,
names, tool calls, tool definitions) gets an ``inert`` character inside it, one
that occurs nowhere in the request: the tokenizer does not see a control token
there, and removes the character before it tokenizes that text as plain text.
"""

import datetime
import functools
import itertools
import json
from typing import Any, Iterable, NamedTuple, Optional

import jinja2
import jinja2.meta
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .tokenizer import any_of

# ChatML, with tools and tool calls in the Hermes convention (<tools>, <tool_call>, <tool_response>).
_CHATML = """\
{%- if tools %}
<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}
# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{% for tool in tools %}
{{ tool | tojson }}
{% endfor %}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% endif %}
{% for message in messages %}
{% if message.role == 'tool' %}
<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% elif not (tools and loop.first and message.role == 'system') %}
<|im_start|>{{ message.role }}
{{ message.content }}
{%- for call in message.tool_calls or [] %}

<tool_call>
{"name": {{ call.function.name | tojson }}, "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}
<|im_end|>
{% endif %}
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}
"""

BUILTIN_TEMPLATES = {
    "chatml": _CHATML,
    "llama2": (
        "{% if messages[0]['role'] == 'system' %}"
        "{% set system = '<<SYS>>\\n' + messages[0]['content'] + '\\n<</SYS>>\\n\\n' %}"
        "{% set messages = messages[1:] %}{% else %}{% set system = '' %}{% endif %}"
        "{% for message in messages %}"
        "{% if message['role'] == 'user' %}"
        "{{ bos_token + '[INST] ' + (system if loop.first else '') + message['content'] + ' [/INST]' }}"
        "{% else %}{{ ' ' + message['content'] + ' ' + eos_token }}{% endif %}"
        "{% endfor %}"
    ),
    "plain": (
        "{% for message in messages %}{{ message['role'] + ': ' + message['content'] + '\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
    ),
}
DEFAULT_TEMPLATE = "chatml"


class RenderedPrompt(NamedTuple):
    """Prompt text, and the character that marks control-token text from messages as plain (None: no such text)."""

    text: str
    inert: Optional[str] = None


# Characters no real text uses: Unicode's noncharacters, then the private use area.
_INERT_CANDIDATES = "".join(chr(c) for c in itertools.chain(range(0xFDD0, 0xFDF0), range(0xE000, 0xF900)))
_PROBE = "\ufdd0kronk-probe\ufdd1"


class ChatTemplateError(ValueError):
    """The messages cannot be rendered by this template (its message says why)."""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: Optional[int] = None,
            separators: Optional[tuple] = None, sort_keys: bool = False) -> str:
    """JSON as model templates expect it (Hugging Face's filter): no HTML escaping."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@functools.lru_cache(maxsize=64)
def _compile(source: str) -> tuple[jinja2.Template, frozenset[str]]:
    """The template and the names it reads from its context."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise_exception
    env.filters["tojson"] = _tojson
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    tree = env.parse(source)
    return env.from_string(tree), frozenset(jinja2.meta.find_undeclared_variables(tree))


class ChatTemplate:
    """A compiled chat template with the model's special tokens."""

    def __init__(
        self, source: str, bos_token: str = "<s>", eos_token: str = "</s>", control_tokens: Iterable[str] = (),
    ) -> None:
        try:
            self._template, names = _compile(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ValueError(f"chat template does not compile: {exc}") from None
        self.source = source
        self.supports_tools = "tools" in names
        self.bos_token = bos_token
        self.eos_token = eos_token
        self._control = any_of(t for t in control_tokens if len(t) > 1)  # one character cannot be marked inside

    @classmethod
    def for_model(
        cls, configured: Optional[str], from_file: Optional[str], bos: str, eos: str, control_tokens: Iterable[str] = (),
    ) -> "ChatTemplate":
        """The configured template (a built-in name or Jinja text), else the file's, else the default."""
        source = configured or from_file or DEFAULT_TEMPLATE
        return cls(BUILTIN_TEMPLATES.get(source, source), bos, eos, control_tokens)

    def render(
        self, messages: list[dict[str, Any]], tools: Optional[list[dict]] = None, thinking: Optional[bool] = None,
    ) -> RenderedPrompt:
        """Prompt text for ``messages``, ending where the assistant's reply begins.

        ``thinking`` reaches the template as ``enable_thinking``: templates of reasoning models
        read it to switch thinking on or off; others ignore it.
        """
        inert = None
        if self._control is not None:
            inert = _inert_for(json.dumps([messages, tools], ensure_ascii=False))
            messages, tools = self._mark(messages, inert), self._mark(tools, inert)
        return RenderedPrompt(self._render(messages, tools, add_generation_prompt=True, thinking=thinking), inert)

    def closing_token(self) -> Optional[str]:
        """The control token this template closes an assistant turn with (such as ``<|im_end|>``), if any."""
        if self._control is None:
            return None
        messages = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": _PROBE}]
        try:
            text = self._render(messages, None, add_generation_prompt=False)
        except ChatTemplateError:
            return None
        _, found, after = text.partition(_PROBE)
        match = self._control.match(after.lstrip()) if found else None
        return match.group() if match else None

    def _render(self, messages: list[dict[str, Any]], tools: Optional[list[dict]], add_generation_prompt: bool,
                thinking: Optional[bool] = None) -> str:
        switches = {} if thinking is None else {"enable_thinking": thinking}
        try:
            return self._template.render(
                messages=messages,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
                **switches,
            )
        except ChatTemplateError:
            raise
        except Exception as exc:  # a template can fail in any way on odd input
            raise ChatTemplateError(f"chat template failed on these messages: {exc}") from None

    def _mark(self, value: Any, inert: str) -> Any:
        """``value`` with ``inert`` inside every control token's text in its strings (keys included)."""
        if isinstance(value, str):
            return self._control.sub(lambda m: m.group()[0] + inert + m.group()[1:], value)
        if isinstance(value, dict):
            return {self._mark(k, inert): self._mark(v, inert) for k, v in value.items()}
        if isinstance(value, list):
            return [self._mark(item, inert) for item in value]
        return value


def _inert_for(text: str) -> str:
    """A character that does not occur in ``text``."""
    for candidate in _INERT_CANDIDATES:
        if candidate not in text:
            return candidate
    raise ChatTemplateError("the messages use every private-use character; they cannot be rendered safely")
