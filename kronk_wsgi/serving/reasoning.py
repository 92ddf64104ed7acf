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


@dataclasses.dataclass(frozen=True)
class ReasoningSyntax:
    """The tags around a model's thinking."""

    open: str
    close: str


SYNTAXES = (
    ReasoningSyntax("<think>", "</think>"),
    ReasoningSyntax("<|START_THINKING|>", "<|END_THINKING|>"),
    ReasoningSyntax("[THINK]", "[/THINK]"),
)


def reasoning_of(template_source: str) -> Optional[ReasoningSyntax]:
    """The thinking tags a chat template uses, if it uses any."""
    return next((s for s in SYNTAXES if s.close in template_source), None)


def opens_thinking(prompt: str, syntax: ReasoningSyntax) -> bool:
    """Whether a rendered prompt leaves the reply inside an open thinking block."""
    return prompt.rstrip().endswith(syntax.open)


_START, _THINKING, _ANSWER = "start", "thinking", "answer"


class ReasoningSplitter:
    """Splits streamed text into thinking and answer deltas.

    Text that could still be the opening tag (at the start) or the closing
    tag (while thinking) is held back until it is known; white space right
    after either tag is left out.
    """

    def __init__(self, syntax: ReasoningSyntax, inside: bool) -> None:
        self.syntax = syntax
        self._state = _THINKING if inside else _START
        self._skip_space = inside
        self._pending = ""

    def feed(self, text: str) -> list[ReasoningDelta | TextDelta]:
        out: list[ReasoningDelta | TextDelta] = []
        self._pending += text
        if self._skip_space:
            self._pending = self._pending.lstrip()
            self._skip_space = not self._pending
        if self._state == _START:
            head = self._pending.lstrip()
            if head.startswith(self.syntax.open):
                self._state, self._pending = _THINKING, head[len(self.syntax.open):].lstrip()
                self._skip_space = not self._pending
            elif self.syntax.open.startswith(head):
                return out  # still possibly the opening tag
            else:
                self._state = _ANSWER
        if self._state == _THINKING:
            close = self.syntax.close
            at = self._pending.find(close)
            if at < 0:
                cut = len(self._pending) - partial_tag(self._pending, (close,))
                if cut:
                    out.append(ReasoningDelta(self._pending[:cut]))
                self._pending = self._pending[cut:]
                return out
            if at:
                out.append(ReasoningDelta(self._pending[:at]))
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
        return [ReasoningDelta(text) if self._state == _THINKING else TextDelta(text)]
