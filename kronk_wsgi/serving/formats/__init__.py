"""How each family of models writes tool calls: one module per format, and the registry that tells from a
chat template which one its model was taught.

The first format in ``FORMATS`` whose markers the template has is the model's; a template with none of
them gets Hermes, which the built-in tool text teaches.
"""

import functools
from typing import Optional

from . import deepseek, functionary, gemma4, glm, harmony, hermes, json_lists, kimi, llama3, minimax, mistral, \
    pythonic, xml_attributes, xml_parameters
from ...engine.chat_template import ChatTemplate
from .base import Call, CallFormat, CallReader, ToolCallRules, custom_arguments, custom_input

# Most specific first: Qwen3-Coder's template also has Hermes' <tool_call>, Mistral v11's has v3's [TOOL_CALLS].
FORMATS: tuple[CallFormat, ...] = (
    harmony.FORMAT,
    harmony.MUSE,
    gemma4.FORMAT,
    minimax.M3,
    deepseek.V4,
    deepseek.V3_2,
    xml_attributes.MINICPM5,
    xml_parameters.SEED_OSS,
    xml_parameters.QWEN3_CODER,
    glm.FORMAT,
    minimax.FORMAT,
    kimi.K3,
    kimi.FORMAT,
    deepseek.R1,
    deepseek.V3_1,
    mistral.V11,
    mistral.V3,
    json_lists.COMMAND_R7B,
    json_lists.COMMAND_R_PLUS,
    json_lists.NEMOTRON,
    json_lists.GRANITE,
    json_lists.APERTUS,
    json_lists.FIREFUNCTION,
    json_lists.GIGACHAT,
    json_lists.TOOL_CALLS,
    pythonic.FORMAT,
    functionary.V3_2,
    functionary.V3_1,
    hermes.FORMAT,
    llama3.FORMAT,
)
HERMES = hermes.FORMAT


@functools.lru_cache(maxsize=64)
def format_of(template_source: str) -> CallFormat:
    """The format a chat template teaches its model; Hermes if it teaches none (found once per template: each
    request asks it several times, on the event loop)."""
    return next((f for f in FORMATS if f.recognises(template_source)), HERMES)


def reply_end(template: ChatTemplate) -> Optional[str]:
    """The marker a template closes an assistant turn with, which ends a reply; None where there is none, or
    where the model's format reads it inside replies (Kimi K3's ``<|close|>`` closes each of its sections,
    GigaChat 3 writes its calls after a ``<|message_sep|>``): the vocabulary's end tokens end those."""
    marker = template.closing_text()
    form = format_of(template.source)
    return None if marker in form.tags + form.drops + form.opens else marker


def tool_rendering(template: ChatTemplate) -> str:
    """How tools reach a template's model, and the format its calls are read in (for inspect and /admin)."""
    form = format_of(template.source)
    if template.renders_tools:
        return f"the chat template; calls read as {form.name}"
    if form is HERMES:
        return "built-in Hermes text (<tool_call>), the template has none; calls read as hermes"
    return f"written into the system message, the template has none; calls read as {form.name}"


__all__ = ["Call", "CallFormat", "CallReader", "FORMATS", "HERMES", "ToolCallRules", "custom_arguments",
           "custom_input", "format_of", "reply_end", "tool_rendering"]
