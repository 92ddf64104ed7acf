"""The work a slot does for one request, run in the slot's worker thread.

A job yields neutral events and ends with Finished; it knows nothing of
gevent, HTTP or protocols.
"""

import dataclasses
import itertools
from typing import Callable, Iterator, Optional, Protocol

import numpy as np

from ..engine.base import Slot
from ..engine.generate import Generation
from ..engine.grammar import Grammar
from ..engine.sampling import SamplingParams
from ..engine.tokenizer import Tokenizer
from .events import ChoiceEnd, Embedding, Event, Finished, Logprobs, TextDelta, TokenLogprob, ToolCall, Usage
from .reasoning import ReasoningSplitter, ReasoningSyntax
from .tool_calls import ToolCallParser, ToolCallRules


class Job(Protocol):
    """Work for one slot, run in the slot's worker thread as a stream of events ending in Finished."""

    prompt_tokens: int

    @property
    def prefix(self) -> list[int]:
        """The tokens the job evaluates first: the slot whose cache starts with most of them is taken."""

    @property
    def completion_tokens(self) -> int: ...

    def run(self, slot: Slot, context_length: int, cancelled: Callable[[], bool]) -> Iterator[Event]: ...


class GenerationJob:
    """Generate ``n`` replies to each of the ``prompts``, one after another on one slot.

    Replies are numbered in order (prompt by prompt); each reply after the
    first to one prompt finds that prompt in the slot's cache. With tool-call
    rules, tool calls are parsed out of the answer; with a ``reasoning``
    syntax, the model's thinking is told apart from its answer (``inside_thinking``:
    the prompt leaves the reply inside the thinking block). ``reply_start`` is
    text at the end of the prompt that belongs to the reply (the opening of a
    forced tool call): the tool-call parser reads it first. With
    ``one_tool_call`` a reply ends at its first tool call. A ``grammar``
    constrains every reply, from where its text reaches ``grammar_after`` if
    that is given (the end of the thinking, a tool call's opening tag). A
    ``thinking_budget`` closes the thinking after that many tokens, where the
    prompt opened it; ``top_logprobs`` (0 or more) reports each
    generated token's log probability.
    """

    def __init__(
        self,
        prompts: list[list[int]],
        *,
        n: int = 1,
        tokenizer: Tokenizer,
        end_ids: frozenset[int],
        max_tokens: int,
        sampling: SamplingParams,
        stop: tuple[str, ...] = (),
        tool_rules: Optional[ToolCallRules] = None,
        reply_start: str = "",
        one_tool_call: bool = False,
        reasoning: Optional[ReasoningSyntax] = None,
        inside_thinking: bool = False,
        grammar: Optional[Grammar] = None,
        grammar_after: str = "",
        thinking_budget: Optional[int] = None,
        top_logprobs: Optional[int] = None,
    ) -> None:
        self.prompts = prompts
        self.n = n
        self.prompt_tokens = sum(len(prompt) for prompt in prompts)
        self.tokenizer = tokenizer
        self.end_ids = end_ids
        self.max_tokens = max_tokens
        self.sampling = sampling
        self.stop = stop
        self.tool_rules = tool_rules
        self.reply_start = reply_start
        self.one_tool_call = one_tool_call
        self.reasoning = reasoning
        self.inside_thinking = inside_thinking
        self.grammar = grammar
        self.grammar_after = grammar_after
        self.thinking_budget = thinking_budget
        self.top_logprobs = top_logprobs
        self._generations: list[Generation] = []

    @property
    def prefix(self) -> list[int]:
        return self.prompts[0]

    @property
    def completion_tokens(self) -> int:
        # Plain ints the worker thread writes: reading them needs no lock.
        return sum(generation.completion_tokens for generation in self._generations)

    def run(self, slot: Slot, context_length: int, cancelled: Callable[[], bool]) -> Iterator[Event]:
        cached = 0
        for index, (prompt, choice) in enumerate(itertools.product(self.prompts, range(self.n))):
            generation = Generation(
                slot, prompt, tokenizer=self.tokenizer, end_ids=self.end_ids, shown=self._shown(),
                max_tokens=self.max_tokens, context_length=context_length, sampling=self.sampling,
                stop=self.stop, cancelled=cancelled, constraint=self.grammar.constraint() if self.grammar else None,
                constrain_after=self.grammar_after,
                thinking_close=self.reasoning.close if self.reasoning and self.inside_thinking else "",
                thinking_budget=self.thinking_budget,
                top_logprobs=self.top_logprobs, choice=choice,
            )
            self._generations.append(generation)
            for event in self._reply(generation):
                yield dataclasses.replace(event, index=index) if index else event
            if choice == 0:
                cached += generation.cached_tokens
        yield Finished(Usage(self.prompt_tokens, self.completion_tokens, cached))

    def _reply(self, generation: Generation) -> Iterator[Event]:
        """One reply's events, ending with its ChoiceEnd."""
        reasoning = ReasoningSplitter(self.reasoning, self.inside_thinking) if self.reasoning else None
        tools = ToolCallParser(self.tool_rules) if self.tool_rules else None

        def split(text: str) -> list[Event]:
            parts: list[Event] = reasoning.feed(text) if reasoning else [TextDelta(text)]
            if tools is None:
                return parts
            out: list[Event] = []
            for part in parts:
                out.extend(tools.feed(part.text) if isinstance(part, TextDelta) else [part])
            return out

        if tools:
            yield from tools.feed(self.reply_start)
        for text in generation:
            if generation.sampled:
                yield self._logprobs(generation)
            for event in split(text):
                yield event
                if self.one_tool_call and isinstance(event, ToolCall):
                    yield ChoiceEnd("tool_calls")
                    return
        if generation.sampled:
            yield self._logprobs(generation)
        ending = reasoning.flush() if reasoning else []
        for part in ending:
            if isinstance(part, TextDelta) and tools:
                yield from tools.feed(part.text)
            else:
                yield part
        if tools:
            yield from tools.flush()
        reason = generation.finish_reason
        if tools and tools.calls and reason == "stop" and generation.stop_sequence is None:
            reason = "tool_calls"
        yield ChoiceEnd(reason, generation.stop_sequence)

    def _logprobs(self, generation: Generation) -> Logprobs:
        """The tokens sampled since the last report, as bytes with their log probabilities."""
        sampled, generation.sampled = generation.sampled, []

        def piece(token: int) -> bytes:  # a token that adds no text (a control token) shows its own
            return self.tokenizer.piece(token) or self.tokenizer.token_text(token).encode("utf-8", "surrogateescape")

        return Logprobs(tuple(
            TokenLogprob(piece(s.token), s.logprob, tuple((piece(t), lp) for t, lp in s.top)) for s in sampled
        ))

    def _shown(self) -> frozenset[int]:
        """The tags a parser reads (tool-call and thinking tags) that are control tokens: they must be in the text."""
        tags = []
        if self.tool_rules is not None:
            tags += [self.tool_rules.syntax.open, self.tool_rules.syntax.close]
        if self.reasoning is not None:
            tags += [self.reasoning.open, self.reasoning.close]
        return frozenset(self.tokenizer.control[tag] for tag in tags if tag in self.tokenizer.control)


class EmbeddingJob:
    """Embed each input: the final hidden state of its last token, scaled to unit length."""

    completion_tokens = 0

    def __init__(self, inputs: list[list[int]]) -> None:
        self.inputs = inputs
        self.prompt_tokens = sum(len(tokens) for tokens in inputs)

    @property
    def prefix(self) -> list[int]:
        return self.inputs[0]

    def run(self, slot: Slot, context_length: int, cancelled: Callable[[], bool]) -> Iterator[Event]:
        for index, tokens in enumerate(self.inputs):
            slot.prefill(tokens, cancelled)
            vector = slot.embedding()
            norm = float(np.linalg.norm(vector))
            yield Embedding(index, vector / norm if norm > 0 else vector)
        yield Finished(Usage(self.prompt_tokens, 0))
