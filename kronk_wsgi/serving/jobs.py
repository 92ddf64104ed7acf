"""The work a slot does for one request, run in the slot's worker thread.

A job yields neutral events and ends with Finished; it knows nothing of
gevent, HTTP or protocols.
"""

import itertools
from typing import Callable, Iterator, Optional, Protocol

import numpy as np

from ..engine.base import Slot
from ..engine.generate import Generation
from ..engine.sampling import SamplingParams
from ..engine.tokenizer import Tokenizer
from .events import Embedding, Event, Finished, TextDelta, ToolCall, Usage
from .tool_calls import ToolCallParser, ToolCallRules


class Job(Protocol):
    """Work for one slot, run in the slot's worker thread as a stream of events ending in Finished."""

    prompt_tokens: int

    @property
    def completion_tokens(self) -> int: ...

    def run(self, slot: Slot, context_length: int, cancelled: Callable[[], bool]) -> Iterator[Event]: ...


class GenerationJob:
    """Generate text for one prompt; with tool-call rules, tool calls are parsed out of it.

    ``reply_start`` is text at the end of the prompt that belongs to the reply
    (the opening of a forced tool call): the parser reads it first. With
    ``one_tool_call`` generation ends at the first tool call.
    """

    def __init__(
        self,
        prompt: list[int],
        *,
        tokenizer: Tokenizer,
        end_ids: frozenset[int],
        max_tokens: int,
        sampling: SamplingParams,
        stop: tuple[str, ...] = (),
        tool_rules: Optional[ToolCallRules] = None,
        reply_start: str = "",
        one_tool_call: bool = False,
    ) -> None:
        self.prompt = prompt
        self.prompt_tokens = len(prompt)
        self.tokenizer = tokenizer
        self.end_ids = end_ids
        self.max_tokens = max_tokens
        self.sampling = sampling
        self.stop = stop
        self.tool_rules = tool_rules
        self.reply_start = reply_start
        self.one_tool_call = one_tool_call
        self._generation: Optional[Generation] = None

    @property
    def completion_tokens(self) -> int:
        # A plain int the worker thread writes: reading it needs no lock.
        return self._generation.completion_tokens if self._generation else 0

    def run(self, slot: Slot, context_length: int, cancelled: Callable[[], bool]) -> Iterator[Event]:
        generation = self._generation = Generation(
            slot, self.prompt, tokenizer=self.tokenizer, end_ids=self.end_ids, shown=self._shown(),
            max_tokens=self.max_tokens,
            context_length=context_length,
            sampling=self.sampling, stop=self.stop, cancelled=cancelled,
        )
        if self.tool_rules is None:
            yield from map(TextDelta, generation)
            yield Finished(generation.finish_reason, self._usage(), generation.stop_sequence)
            return
        parser = ToolCallParser(self.tool_rules)
        for text in itertools.chain([self.reply_start], generation):
            for event in parser.feed(text):
                yield event
                if self.one_tool_call and isinstance(event, ToolCall):
                    yield Finished("tool_calls", self._usage())
                    return
        yield from parser.flush()
        reason = generation.finish_reason
        if parser.calls and reason == "stop" and generation.stop_sequence is None:
            reason = "tool_calls"
        yield Finished(reason, self._usage(), generation.stop_sequence)

    def _shown(self) -> frozenset[int]:
        """The tool-call tags that are control tokens: the parser must read them in the text."""
        if self.tool_rules is None:
            return frozenset()
        syntax = self.tool_rules.syntax
        return frozenset(self.tokenizer.control[tag] for tag in (syntax.open, syntax.close) if tag in self.tokenizer.control)

    def _usage(self) -> Usage:
        generation = self._generation
        return Usage(self.prompt_tokens, generation.completion_tokens, generation.cached_tokens)


class EmbeddingJob:
    """Embed each input: the final hidden state of its last token, scaled to unit length."""

    completion_tokens = 0

    def __init__(self, inputs: list[list[int]]) -> None:
        self.inputs = inputs
        self.prompt_tokens = sum(len(tokens) for tokens in inputs)

    def run(self, slot: Slot, context_length: int, cancelled: Callable[[], bool]) -> Iterator[Event]:
        for index, tokens in enumerate(self.inputs):
            slot.prefill(tokens, cancelled)
            vector = slot.embedding()
            norm = float(np.linalg.norm(vector))
            yield Embedding(index, vector / norm if norm > 0 else vector)
        yield Finished("stop", Usage(self.prompt_tokens, 0))
