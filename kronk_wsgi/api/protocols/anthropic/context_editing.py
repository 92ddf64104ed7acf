"""Anthropic's context editing (``context_management.edits``): applied to a request's conversation before it is
planned, in order, each measured in the model's own tokens on the prompt as the edits before it left it.

``clear_tool_uses_20250919``: once the prompt passes its ``trigger`` (100,000 input tokens unless given, or a
count of tool uses), the results of the oldest tool uses but the last ``keep`` (3 unless given), of the tools not
in ``exclude_tools``, are replaced by a placeholder; with ``clear_tool_inputs``, their calls' inputs too (every
cleared call's, or those of the tools named). If that would clear fewer input tokens than ``clear_at_least``,
nothing is cleared: a cleared prefix leaves the prompt cache, and a small gain is not worth it.

``clear_thinking_20251015``: an earlier turn's thinking never enters the prompt here (as if every turn's were
cleared), so the edit reports the thinking turns beyond ``keep`` (1 unless given, ``"all"`` none) as cleared,
with the input tokens they take here: none.
"""

import copy
import dataclasses
from typing import Optional

from ....serving.pool import LoadedModel
from ...planning import render_chat, tokenize_prompt
from ...schemas import template_variables
from .schemas import ContextEdit, CountTokensRequest

CLEARED = "[tool result cleared to save context]"
DEFAULT_TRIGGER = 100_000  # input tokens
DEFAULT_KEEP_TOOL_USES = 3
DEFAULT_KEEP_THINKING_TURNS = 1


@dataclasses.dataclass(frozen=True)
class EditedContext:
    messages: list[dict]  # the template messages, edited
    applied: list[dict]  # the edits that cleared something, as Anthropic reports them
    original_tokens: int  # the prompt's tokens before the edits
    tokens: int  # and after them


def prompt_tokens(model: LoadedModel, body: CountTokensRequest, messages: list[dict]) -> int:
    """The tokens of the prompt the request's template messages, as given, render to."""
    prompt = render_chat(model, messages, body.template_tools(), body.thinking_switch(),
                         continue_final=messages[-1]["role"] == "assistant",
                         variables=template_variables(body.effort()))
    return len(tokenize_prompt(model, prompt, body.media()))


def edit_context(model: LoadedModel, body: CountTokensRequest) -> EditedContext:
    """The request's conversation with its context-management edits applied."""
    messages = body.template_messages()  # an edit clears a copy of them (their calls' inputs are the body's)
    tokens = original = prompt_tokens(model, body, messages)
    applied = []
    for edit in body.context_management.edits:
        if edit.type.startswith("compact"):
            continue  # a compaction writes a summary: the view's (see compaction_plan)
        if edit.type.startswith("clear_thinking"):
            keep = None if edit.keep == "all" else (edit.keep.value if edit.keep else DEFAULT_KEEP_THINKING_TURNS)
            cleared = 0 if keep is None else max(0, body.thinking_turns() - keep)
            if cleared:
                applied.append({"type": edit.type, "cleared_thinking_turns": cleared, "cleared_input_tokens": 0})
            continue
        edited = _clear_tool_uses(messages, edit, tokens)
        if edited is None:
            continue
        after = prompt_tokens(model, body, edited[0])
        least = edit.clear_at_least.value if edit.clear_at_least else 0
        if tokens - after < least:
            continue
        messages = edited[0]
        applied.append({"type": edit.type, "cleared_tool_uses": edited[1], "cleared_input_tokens": tokens - after})
        tokens = after
    return EditedContext(messages, applied, original, tokens)


def _clear_tool_uses(messages: list[dict], edit: ContextEdit, tokens: int) -> Optional[tuple[list[dict], int]]:
    """``messages`` with the edit's tool uses cleared, and how many; None if it is not triggered or finds none."""
    calls = [call for message in messages for call in message.get("tool_calls", ())]
    trigger = edit.trigger
    reached = calls and (len(calls) if trigger is not None and trigger.type == "tool_uses" else tokens)
    if not reached or reached < (trigger.value if trigger is not None else DEFAULT_TRIGGER):
        return None
    names = {call["id"]: call["function"]["name"] for call in calls}
    excluded = set(edit.exclude_tools or ())
    results = [i for i, m in enumerate(messages) if m["role"] == "tool" and m["content"] != CLEARED
               and names.get(m.get("tool_call_id")) not in excluded]
    keep = edit.keep.value if edit.keep is not None else DEFAULT_KEEP_TOOL_USES
    cleared = results[:max(0, len(results) - keep)]
    if not cleared:
        return None
    edited = copy.deepcopy(messages)
    ids = set()
    for index in cleared:
        edited[index]["content"] = CLEARED
        ids.add(edited[index]["tool_call_id"])
    inputs = edit.clear_tool_inputs
    for message in edited:
        for call in message.get("tool_calls", ()):
            if call["id"] in ids and (inputs is True or isinstance(inputs, list) and call["function"]["name"] in inputs):
                call["function"]["arguments"] = {}
    return edited, len(cleared)
