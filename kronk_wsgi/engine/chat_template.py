"""Chat messages to prompt text through a Jinja chat template.

Templates come from model files, which are data, not trusted code: they run in
Jinja's sandbox, on copies of the request's messages and tools. Models that ship
none get a built-in template, selectable per model in the configuration.

The template's own markers (``<|im_start|>``) become control tokens when the
prompt is tokenized; the same text inside a message must not. Before
rendering, every control token's text found in what the client sent (contents,
names, tool calls, tool definitions) gets an ``inert`` character inside it, one
that occurs nowhere in the request: the tokenizer does not see a control token
there, and removes the character before it tokenizes that text as plain text.
"""

import copy
import datetime
import functools
import itertools
import json
import re
from typing import Any, Iterable, Mapping, NamedTuple, Optional

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.parser
from jinja2.sandbox import SandboxedEnvironment

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

# The templates of the families whose files often ship none, each written out plainly: system text joins the
# first user turn where the family has no system role; tool turns arrive as user turns (see _with_tools_as_text).
_GEMMA = """\
{{ bos_token }}
{%- set system = messages[0].content + '\n\n' if messages and messages[0].role == 'system' else '' %}
{%- for message in messages if message.role != 'system' %}
<start_of_turn>{{ 'model' if message.role == 'assistant' else 'user' }}
{{ (system if loop.first else '') + message.content | trim }}<end_of_turn>
{% endfor %}
{%- if add_generation_prompt %}
<start_of_turn>model
{% endif %}
"""

_LLAMA3 = """\
{{ bos_token }}
{%- for message in messages %}
<|start_header_id|>{{ message.role }}<|end_header_id|>

{{ message.content | trim }}<|eot_id|>
{%- endfor %}
{%- if add_generation_prompt %}
<|start_header_id|>assistant<|end_header_id|>

{% endif %}
"""

_MISTRAL = """\
{{ bos_token }}
{%- set system = messages[0].content + '\n\n' if messages and messages[0].role == 'system' else '' %}
{%- for message in messages if message.role != 'system' %}
{%- if message.role == 'assistant' %}
{{ message.content }}{{ eos_token }}
{%- else %}
[INST] {{ (system if loop.first else '') + message.content }} [/INST]
{%- endif %}
{%- endfor %}
"""

_PHI3 = """\
{%- for message in messages %}
<|{{ message.role }}|>
{{ message.content }}<|end|>
{% endfor %}
{%- if add_generation_prompt %}
<|assistant|>
{% endif %}
"""

BUILTIN_TEMPLATES = {
    "chatml": _CHATML,
    "gemma": _GEMMA,
    "llama3": _LLAMA3,
    "mistral": _MISTRAL,
    "phi3": _PHI3,
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

# For a file without a template: the family its vocabulary's turn markers name, as llama.cpp decides.
VOCABULARY_TEMPLATES = (
    ("<start_of_turn>", "gemma"),
    ("<|start_header_id|>", "llama3"),
    ("<|im_start|>", "chatml"),
    ("[INST]", "mistral"),
    ("<|user|>", "phi3"),
)


def template_for_vocabulary(control_tokens: Iterable[str]) -> str:
    """The built-in template whose markers the vocabulary has as control tokens; ChatML if none."""
    tokens = set(control_tokens)
    return next((name for marker, name in VOCABULARY_TEMPLATES if marker in tokens), DEFAULT_TEMPLATE)


def template_source(configured: Optional[str], from_file: Optional[str], control_tokens: Iterable[str]) -> str:
    """The Jinja text a model is served with: the configured template (a built-in name or Jinja text), else the
    file's, else the built-in one the vocabulary's turn markers name."""
    source = configured or from_file or template_for_vocabulary(control_tokens)
    return BUILTIN_TEMPLATES.get(source, source)


# Fill-in-the-middle markers (before the prefix, before the suffix, where the middle goes), as code models'
# vocabularies name them.
FIM_MARKERS = (
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),  # Qwen 2.5 Coder
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),  # StarCoder 2
    ("<|fim▁begin|>", "<|fim▁hole|>", "<|fim▁end|>"),  # DeepSeek Coder
)


def fill_in_middle(control_tokens: Iterable[str], prefix: str, suffix: str) -> Optional[str]:
    """The prompt asking for the text between ``prefix`` and ``suffix``, in the vocabulary's markers; None if it
    has none."""
    tokens = set(control_tokens)
    for before, after, middle in FIM_MARKERS:
        if {before, after, middle} <= tokens:
            return f"{before}{prefix}{after}{suffix}{middle}"
    return None


# Tools for a template that does not render them: definitions, calls and results as Hermes-style text,
# which the tool-call parser reads back.
_TOOLS_PREAMBLE = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


def _with_tools_as_text(messages: list[dict[str, Any]], tools: list[dict]) -> list[dict[str, Any]]:
    """The conversation with its tools written into it: the definitions in the system message, each call in its
    assistant message's text, each result as a user turn."""
    preamble = _TOOLS_PREAMBLE.format(tools="\n".join(_tojson(tool) for tool in tools))
    rest = messages
    if messages and messages[0]["role"] == "system":
        preamble, rest = messages[0]["content"] + "\n\n" + preamble, messages[1:]
    out: list[dict[str, Any]] = [{"role": "system", "content": preamble}]
    for message in rest:
        if message["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{message['content']}\n</tool_response>"})
            continue
        calls = "".join(
            "\n<tool_call>\n" + _tojson({"name": c["function"]["name"], "arguments": c["function"]["arguments"]})
            + "\n</tool_call>" for c in message.get("tool_calls") or ())
        out.append({"role": message["role"], "content": (message["content"] + calls).strip() if calls
                    else message["content"]})
    return out


def _with_system(messages: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    """The conversation with ``text`` at the end of its system message (a new one if it has none)."""
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": messages[0]["content"] + "\n\n" + text}] + messages[1:]
    return [{"role": "system", "content": text}] + messages


class RenderedPrompt(NamedTuple):
    """Prompt text, and the character that marks control-token text from messages as plain (None: no such text)."""

    text: str
    inert: Optional[str] = None


# Characters no real text uses: Unicode's noncharacters, then the private use area.
_INERT_CANDIDATES = "".join(chr(c) for c in itertools.chain(range(0xFDD0, 0xFDF0), range(0xE000, 0xF900)))
_PROBE = "\ufdd0kronk-probe\ufdd1"
_MARKER = re.compile(r"<[|/]?[A-Za-z_|]{2,30}[|]?>|\[/?[A-Z_]{2,20}\]")  # <|im_end|>, <end_of_turn>, </s>, [/INST]


class ChatTemplateError(ValueError):
    """The messages cannot be rendered by this template (its message says why); ``variables``: the request's
    template variables are the cause."""

    def __init__(self, message: str, variables: bool = False) -> None:
        super().__init__(message)
        self.variables = variables


# What the server itself gives a template; a request's variables cannot set these.
RESERVED_VARIABLES = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"})


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: Optional[int] = None,
            separators: Optional[tuple] = None, sort_keys: bool = False) -> str:
    """JSON as model templates expect it (Hugging Face's filter): no HTML escaping; what a filter such as ``map``
    gives (a generator) is a list."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys,
                      default=_listed)


def _listed(value: Any) -> list:
    if isinstance(value, Iterable) and not isinstance(value, (str, bytes, dict)):
        return list(value)
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


class _Lenient(jinja2.ChainableUndefined):
    """An undefined value as llama-server's templates see it: its attributes are undefined too, and joined to
    text it is empty."""

    def __add__(self, other: Any) -> Any:
        return other

    def __radd__(self, other: Any) -> Any:
        return other


class _Generation(jinja2.ext.Extension):
    """Hugging Face's ``{% generation %}...{% endgeneration %}`` (it marks the assistant's part of a training
    example): rendered as its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller) -> str:
        return caller()


@functools.lru_cache(maxsize=64)
def _compile(source: str) -> tuple[jinja2.Template, frozenset[str]]:
    """The template and the names it reads from its context, in the environment Hugging Face's transformers
    renders chat templates in (loop controls, the ``generation`` tag), lists and dicts as mutable as
    llama-server's templates have them (``append``, ``update``: each render gets its own copies)."""
    env = SandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _Generation],
                               undefined=_Lenient)
    env.globals["raise_exception"] = _raise_exception
    env.filters["tojson"] = _tojson
    env.filters["safe"] = str  # nothing is escaped here: "safe" text joins other text as it is
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
        # Whether the template renders tools itself; if not, they are written into the messages.
        self.renders_tools = "tools" in names
        self.bos_token = bos_token
        self.eos_token = eos_token
        self._control = any_of(t for t in control_tokens if len(t) > 1)  # one character cannot be marked inside

    @classmethod
    def for_model(
        cls, configured: Optional[str], from_file: Optional[str], bos: str, eos: str, control_tokens: Iterable[str] = (),
    ) -> "ChatTemplate":
        """The configured template (a built-in name or Jinja text), else the file's, else the one the vocabulary's
        turn markers name."""
        control_tokens = list(control_tokens)
        return cls(template_source(configured, from_file, control_tokens), bos, eos, control_tokens)

    def render(
        self, messages: list[dict[str, Any]], tools: Optional[list[dict]] = None, thinking: Optional[bool] = None,
        continue_final: bool = False, tool_text: Optional[str] = None, variables: Optional[Mapping[str, Any]] = None,
        generation_prompt: bool = True,
    ) -> RenderedPrompt:
        """Prompt text for ``messages``, ending where the assistant's reply begins (without ``generation_prompt``,
        where the messages end).

        A template that renders no tools gets them written into the messages:
        ``tool_text`` (the model's own way of calling them) joins the system
        message, the template rendering the calls and results itself; without
        it, definitions, calls and results are written as Hermes text.
        ``variables`` are more of the template's variables (``reasoning_effort``,
        ``enable_thinking``, ...), as a request names them.

        ``thinking`` reaches the template as ``enable_thinking`` (true if not given, as
        llama-server passes it): templates of reasoning models read it to switch thinking on
        or off; others ignore it. With ``continue_final`` the last message is the assistant's
        and the prompt ends inside it, where its text ends: the reply continues it (as the
        Messages API does with a final assistant message).
        """
        reserved = RESERVED_VARIABLES & set(variables or ())
        if reserved:
            raise ChatTemplateError(f"the template variable {min(reserved)!r} is the server's to set", variables=True)
        if tools and not self.renders_tools:
            messages = _with_tools_as_text(messages, tools) if tool_text is None else _with_system(messages, tool_text)
            tools = None
        messages = self._adapted(messages)
        inert = None
        if self._control is not None:
            inert = _inert_for(json.dumps([messages, tools], ensure_ascii=False))
            messages, tools = self._mark(messages, inert), self._mark(tools, inert)
        variables = dict(variables or {})
        if thinking is not None:
            variables.setdefault("enable_thinking", thinking)
        if isinstance(variables.get("reasoning_effort"), str):
            variables.setdefault("reasoning_strength", variables["reasoning_effort"])  # some templates' name
        if continue_final:
            return RenderedPrompt(self._continued(messages, tools, variables), inert)
        return RenderedPrompt(self._render(messages, tools, add_generation_prompt=generation_prompt,
                                           variables=variables), inert)

    def _continued(self, messages: list[dict[str, Any]], tools: Optional[list[dict]], variables: dict) -> str:
        """The conversation rendered up to the end of its final (assistant) message's text."""
        final = messages[-1]
        if final["role"] != "assistant" or final.get("tool_calls"):
            raise ChatTemplateError("only a final assistant message of text can be continued")
        text = self._render(messages[:-1] + [{**final, "content": _PROBE}], tools, add_generation_prompt=False,
                            variables=variables)
        head, found, _ = text.partition(_PROBE)
        if not found:
            raise ChatTemplateError("this chat template drops a final assistant message: it cannot be continued")
        return head + final["content"]

    def closing_text(self) -> Optional[str]:
        """The marker this template closes an assistant turn with (``<|im_end|>``, ``<end_of_turn>``), if any,
        whether or not the vocabulary has it as a control token."""
        messages = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": _PROBE}]
        try:
            text = self._render(messages, None, add_generation_prompt=False)
        except ChatTemplateError:
            return None
        _, found, after = text.partition(_PROBE)
        match = _MARKER.match(after.lstrip()) if found else None
        return match.group() if match else None

    @functools.cached_property
    def _takes_system(self) -> bool:
        """Whether the template renders a system message (Gemma 2's raises, some drop it)."""
        try:
            text = self._render([{"role": "system", "content": _PROBE}, {"role": "user", "content": "Hi"}], None,
                                add_generation_prompt=True)
        except ChatTemplateError:
            return False
        return _PROBE in text

    @functools.cached_property
    def _object_arguments(self) -> bool:
        """Whether the template reads a past call's arguments as an object (else they are given as JSON text)."""
        call = {"id": "call_1", "type": "function", "function": {"name": "probe", "arguments": {"arg": _PROBE}}}
        try:
            text = self._render([{"role": "user", "content": "Hi"},
                                 {"role": "assistant", "content": "", "tool_calls": [call]}], None,
                                add_generation_prompt=False)
        except ChatTemplateError:
            return False
        return _PROBE in text and "{'arg'" not in text  # not the dict's Python repr

    def _adapted(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The messages as llama-server adapts them to what the template takes: a system message it does not
        render joins the next message (or goes, if alone); calls' arguments as JSON text where it reads text."""
        if messages and messages[0]["role"] == "system" and not self._takes_system:
            system, rest = messages[0], messages[1:]
            messages = [{**rest[0], "content": system["content"] + "\n" + rest[0]["content"]}] + rest[1:] if rest \
                else []
        if not self._object_arguments:
            messages = [{**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": json.dumps(
                c["function"]["arguments"], ensure_ascii=False)}} for c in m["tool_calls"]]}
                if m.get("tool_calls") else m for m in messages]
        return messages

    def _render(self, messages: list[dict[str, Any]], tools: Optional[list[dict]], add_generation_prompt: bool,
                variables: Optional[dict] = None) -> str:
        now = datetime.datetime.now()
        variables = {  # what llama-server gives every template, unless the request sets it
            "enable_thinking": True, "date_string": now.strftime("%d %b %Y"), "datetime": now.strftime("%b %d %Y"),
            "preserve_thinking": True, "clear_thinking": False, "truncate_history_thinking": False,
            "drop_thinking": False, **(variables or {})}
        try:
            return self._template.render(
                **variables,
                messages=copy.deepcopy(messages),
                **({"tools": copy.deepcopy(tools)} if tools else {}),  # none: undefined, as llama-server leaves it
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
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
