"""A reasoning model's thinking, told apart from its answer in the generated text.

Such models open their reply with a thinking block, ``<think> ... </think>``
or the like, as their chat template shows; some templates open the block in
the prompt already, so the reply starts inside it. Only a block at the start
of the reply is thinking: the same tag later on is answer text.
"""

import dataclasses
from typing import Optional

from ..engine.generate import partial_tag
from .events import ReasoningDelta, TextDelta
from .formats import format_of


@dataclasses.dataclass(frozen=True)
class ReasoningSyntax:
    """The tags around a model's thinking; ``answers``: tags that end it too, opening the answer (kept in its
    text, for the call format to read); ``marker``: what a template that uses them has (the closing tag, unless
    the template writes its tags through a macro); ``spoken``: the opening is words of the thinking, which
    llama.cpp reads as part of it."""

    open: str
    close: str
    answers: tuple[str, ...] = ()
    marker: str = ""
    spoken: bool = False  # the opening is part of the thinking, also where the prompt wrote it

    def used_by(self, template_source: str) -> bool:
        return (self.marker or self.close) in template_source


SYNTAXES = (
    ReasoningSyntax("<think>", "</think>"),
    ReasoningSyntax("<|START_THINKING|>", "<|END_THINKING|>"),
    ReasoningSyntax("[THINK]", "[/THINK]"),
    ReasoningSyntax("<seed:think>", "</seed:think>"),
    ReasoningSyntax("<|inner_prefix|>", "<|inner_suffix|>"),
    ReasoningSyntax("<|channel>thought", "<channel|>"),  # Gemma 4
    ReasoningSyntax("<mm:think>", "</mm:think>"),  # MiniMax M3
    # Kimi K3: a reply may leave its thinking without closing it, its answer opening instead
    ReasoningSyntax("<|open|>think<|sep|>", "<|close|>think<|sep|>", ("<|open|>response<|sep|>",),
                    "close_tag('think')"),
    # Apriel 1.6: its prompt opens the thinking with these words
    ReasoningSyntax("Here are my reasoning steps:\n", "[BEGIN FINAL RESPONSE]", marker="reasoning_asst_turn_start",
                    spoken=True),
)


def reasoning_of(template_source: str) -> Optional[ReasoningSyntax]:
    """The thinking tags a chat template uses, if it uses any."""
    return next((s for s in SYNTAXES if s.used_by(template_source)), None)


def reasons(template_source: str) -> bool:
    """Whether a chat template's model writes its reasoning apart from its answer (in thinking tags, or in a
    channel of its format's)."""
    return reasoning_of(template_source) is not None or format_of(template_source).reader.reads_reasoning


def opens_thinking(prompt: str, syntax: ReasoningSyntax) -> bool:
    """Whether a rendered prompt leaves the reply inside an open thinking block."""
    return prompt.rstrip().endswith(syntax.open.rstrip())


_START, _THINKING, _HELD, _ANSWER = "start", "thinking", "held", "answer"  # held: thinking, or a call


class ReasoningSplitter:
    """Splits streamed text into thinking and answer deltas.

    Text that could still be the opening tag (at the start) or the closing
    tag (while thinking) is held back until it is known; white space right
    after either tag is left out. A model may call a tool straight from its
    thinking: from one of ``ends`` (the openings of tool calls) on, the text is
    held; if the closing tag follows, it was thinking, and if the reply ends
    first, the thinking ended there and the rest is the answer.
    """

    def __init__(self, syntax: ReasoningSyntax, inside: bool, ends: tuple[str, ...] = ()) -> None:
        self.syntax = syntax
        self._ends = ends
        self._state = _THINKING if inside else _START
        self._skip_space = inside
        self._pending = ""
        self._spoken = syntax.open if inside and syntax.spoken else ""  # said before the first reasoning

    def feed(self, text: str) -> list[ReasoningDelta | TextDelta]:
        out: list[ReasoningDelta | TextDelta] = []
        self._pending += text
        if self._skip_space:
            self._pending = self._pending.lstrip()
            self._skip_space = not self._pending
        close, answers = self.syntax.close, self.syntax.answers
        if self._state == _START:
            head = self._pending.lstrip()
            if head.startswith(self.syntax.open):
                self._state, self._pending = _THINKING, head[len(self.syntax.open):].lstrip()
                self._skip_space = not self._pending
                self._spoken = self.syntax.open if self.syntax.spoken else ""
            elif head.startswith(close):  # a reply without thinking, said so (MiniMax M3 writes a bare close)
                self._state, self._pending = _ANSWER, head[len(close):].lstrip()
                self._skip_space = not self._pending
            elif self.syntax.open.startswith(head) or close.startswith(head):
                return out  # still possibly one of the tags
            else:
                self._state = _ANSWER
        if self._state == _THINKING:
            marks = (close,) + answers + self._ends
            found = [(at, end) for end in marks if (at := self._pending.find(end)) >= 0]
            if not found:
                cut = len(self._pending) - partial_tag(self._pending, marks)
                if cut:
                    self._think(self._pending[:cut], out)
                self._pending = self._pending[cut:]
                return out
            at, mark = min(found)
            if at:
                self._think(self._pending[:at], out)
            self._pending = self._pending[at:]
            self._state = _ANSWER if mark in answers else _HELD if mark != close else _THINKING
        if self._state in (_THINKING, _HELD):  # the pending text starts with the close, or is held
            at = self._pending.find(close)
            if at < 0:
                return out
            if at:
                self._think(self._pending[:at], out)
            self._state, self._pending = _ANSWER, self._pending[at + len(close):].lstrip()
            self._skip_space = not self._pending
        if self._pending:
            out.append(TextDelta(self._pending))
            self._pending = ""
        return out

    def flush(self) -> list[ReasoningDelta | TextDelta]:
        """What is held back when the text ends."""
        text, self._pending = self._pending, ""
        if not text:
            return []
        if self._state != _THINKING:
            return [TextDelta(text)]
        out: list[ReasoningDelta | TextDelta] = []
        self._think(text, out)
        return out

    def _think(self, text: str, out: list) -> None:
        out.append(ReasoningDelta(self._spoken + text))
        self._spoken = ""
