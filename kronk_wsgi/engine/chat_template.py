"""Chat messages to prompt text through a Jinja chat template.

Templates come from model files, which are data, not trusted code: they run in
Jinja's immutable sandbox. Models that ship none get a built-in template,
selectable per model in the configuration.
"""

import datetime
import functools
import json
from typing import Any, Optional

import jinja2
import jinja2.meta
from jinja2.sandbox import ImmutableSandboxedEnvironment

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

    def __init__(self, source: str, bos_token: str = "<s>", eos_token: str = "</s>") -> None:
        try:
            self._template, names = _compile(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ValueError(f"chat template does not compile: {exc}") from None
        self.source = source
        self.supports_tools = "tools" in names
        self.bos_token = bos_token
        self.eos_token = eos_token

    @classmethod
    def for_model(cls, configured: Optional[str], from_file: Optional[str], bos: str, eos: str) -> "ChatTemplate":
        """The configured template (a built-in name or Jinja text), else the file's, else the default."""
        source = configured or from_file or DEFAULT_TEMPLATE
        return cls(BUILTIN_TEMPLATES.get(source, source), bos, eos)

    def render(self, messages: list[dict[str, Any]], tools: Optional[list[dict]] = None) -> str:
        """Prompt text for ``messages``, ending where the assistant's reply begins.

        A leading BOS token is removed: the tokenizer adds it.
        """
        try:
            text = self._template.render(
                messages=messages,
                tools=tools,
                add_generation_prompt=True,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except ChatTemplateError:
            raise
        except Exception as exc:  # a template can fail in any way on odd input
            raise ChatTemplateError(f"chat template failed on these messages: {exc}") from None
        if self.bos_token and text.startswith(self.bos_token):
            text = text[len(self.bos_token) :]
        return text
