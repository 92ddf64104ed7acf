"""The work a slot does for one request, run in the slot's worker thread.

A job yields neutral events and ends with Finished; it knows nothing of
gevent, HTTP or protocols.
"""

import dataclasses
import itertools
from typing import Callable, Iterator, Optional, Protocol

import numpy as np

from ..engine.base import Media, Slot
from ..engine.generate import DecodeOptions, Generation
from ..engine.speculation import Drafting
from ..engine.tokenizer import Tokenizer
from .events import (
    ChoiceEnd, Embedding, Event, Finished, Logprobs, PromptCached, TextDelta, TokenIds, TokenLogprob, ToolCall,
    Usage,
)
from .formats import ToolCallRules
from .reasoning import ReasoningSplitter, ReasoningSyntax


class Job(Protocol):
    """Work for one slot, run in the slot's worker thread as a stream of events ending in Finished."""

    prompt_tokens: int
    scope: str  # whose cached prefixes it may reuse (Slot.enter)
    slot: Optional[int]  # the slot it must run on, by number; None: the one the scheduler picks

    @property
    def prefix(self) -> list[int]:
        """The tokens the job evaluates first: the slot whose cache starts with most of them is taken."""

    @property
    def completion_tokens(self) -> int: ...

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens reused from a cache so far (known once the prefill starts)."""

    def run(self, slot: Slot, context_length: int, cancelled: Callable[[], bool]) -> Iterator[Event]: ...


@dataclasses.dataclass(frozen=True)
class ReplyReading:
    """How a reply's text is read: tool calls parsed out of it, thinking told apart from the answer.

    With ``tool_rules``, tool calls are read out of the answer in the rules'
    format (a format that reads reasoning too reads every reply); with a
    ``reasoning`` syntax, the model's thinking is told apart from its answer
    (``inside_thinking``: the prompt leaves the reply inside the thinking
    block). ``reply_start`` is text added to the prompt that belongs to the
    reply (the opening of a forced tool call), and ``prompt_tail`` the end of
    the prompt the reply's text starts with (an opened thinking block, where
    thinking stays in the text): both are read first. A reply ends at the
    rules' ``max_calls`` tool calls.
    """

    tool_rules: Optional[ToolCallRules] = None
    reply_start: str = ""
    prompt_tail: str = ""
    reasoning: Optional[ReasoningSyntax] = None
    inside_thinking: bool = False

    def shown(self, tokenizer: Tokenizer) -> frozenset[int]:
        """The tags a parser reads (tool-call and thinking tags) that are control tokens: they must be in the text."""
        tags = []
        if self.tool_rules is not None:
            tags += self.tool_rules.format.tags
        if self.reasoning is not None:
            tags += [self.reasoning.open, self.reasoning.close]
        return frozenset(tokenizer.control[tag] for tag in tags if tag in tokenizer.control)


class ReplyReader:
    """A reply's text as the reading says: thinking split from the answer first, then the answer's tool calls
    read out of it (the reply's start, text at the end of the prompt, read first)."""

    def __init__(self, reading: ReplyReading) -> None:
        ends = reading.tool_rules.format.opens + reading.tool_rules.format.kept if reading.tool_rules else ()
        self._reasoning = ReasoningSplitter(reading.reasoning, reading.inside_thinking, ends) \
            if reading.reasoning else None
        self._tools = reading.tool_rules.format.reader(reading.tool_rules) if reading.tool_rules else None
        self._start = reading.prompt_tail + reading.reply_start

    @property
    def calls(self) -> int:
        return self._tools.calls if self._tools else 0

    def feed(self, text: str) -> list[Event]:
        parts: list[Event] = self._reasoning.feed(text) if self._reasoning else [TextDelta(text)]
        return self._answer(parts)

    def finish(self, cut: bool = False) -> list[Event]:
        """What is held back when the reply ends (``cut``: by the token limit)."""
        out = self._answer(self._reasoning.flush() if self._reasoning else [])
        return out + (self._tools.flush(cut=cut) if self._tools else [])

    def _answer(self, parts: list[Event]) -> list[Event]:
        if self._start:
            parts, self._start = [TextDelta(self._start), *parts], ""
        if self._tools is None:
            return parts
        out: list[Event] = []
        for part in parts:
            out.extend(self._tools.feed(part.text) if isinstance(part, TextDelta) else [part])
        return out


class GenerationJob:
    """Generate ``n`` replies to each of the ``prompts``, one after another on one slot.

    Replies are numbered in order (prompt by prompt); each reply after the
    first to one prompt finds that prompt in the slot's cache. Each is decoded
    as ``decode`` says and read as ``reading`` says.
    """

    def __init__(self, prompts: list[list[int]], n: int, tokenizer: Tokenizer, decode: DecodeOptions,
                 reading: ReplyReading = ReplyReading(), save_at: tuple[int, ...] = (), scope: str = "",
                 slot: Optional[int] = None, media: tuple[Media, ...] = ()) -> None:
        self.prompts = prompts
        self.media = media  # the images its prompts hold: their engine keeps what evaluates them while they are held
        self.scope = scope
        self.slot = slot
        self.save_at = save_at  # the first prompt's lengths at which its prefix is saved (Slot.prefill)
        self.n = n
        self.prompt_tokens = sum(len(prompt) for prompt in prompts)
        self.tokenizer = tokenizer
        self.decode = decode
        self.reading = reading
        self._generations: list[Generation] = []

    @property
    def prefix(self) -> list[int]:
        return self.prompts[0]

    @property
    def completion_tokens(self) -> int:
        # Plain ints the worker thread writes: reading them needs no lock.
        return sum(generation.completion_tokens for generation in self._generations)

    @property
    def cached_tokens(self) -> int:
        return sum(generation.cached_tokens for generation in self._generations if generation.choice == 0)

    @property
    def drafting(self) -> Drafting:
        """Speculation's drafts and the tokens taken of them, over the replies so far."""
        total = Drafting()
        for generation in self._generations:
            total.add(generation.drafting)
        return total

    def run(self, slot: Slot, context_length: int, cancelled: Callable[[], bool]) -> Iterator[Event]:
        slot.enter(self.scope)
        written = 0
        for index, (prompt, choice) in enumerate(itertools.product(self.prompts, range(self.n))):
            generation = slot.generation(prompt, self.tokenizer, self.decode, context_length, cancelled, choice,
                                         save_at=self.save_at if index == 0 else ())
            self._generations.append(generation)
            if index == 0:
                generation.reuse()
                yield PromptCached(Usage(self.prompt_tokens, 0, generation.cached_tokens, generation.cache_written))
            for event in self._reply(generation):
                yield dataclasses.replace(event, index=index) if index else event
            if choice == 0:
                written += generation.cache_written
        yield Finished(Usage(self.prompt_tokens, self.completion_tokens, self.cached_tokens, written))

    def _reply(self, generation: Generation) -> Iterator[Event]:
        """One reply's events, ending with its ChoiceEnd."""
        reader = ReplyReader(self.reading)
        limit = self.reading.tool_rules.max_calls if self.reading.tool_rules else None
        for text in generation:
            yield from self._reported(generation)
            for event in reader.feed(text):
                yield event
                if limit is not None and isinstance(event, ToolCall) and reader.calls >= limit:
                    yield ChoiceEnd("tool_calls", drafted=generation.drafting.drafted,
                                    accepted=generation.drafting.accepted)
                    return
        yield from self._reported(generation)
        yield from reader.finish(cut=generation.finish_reason == "length")
        reason = generation.finish_reason
        if reader.calls and reason == "stop" and generation.stop_sequence is None:
            reason = "tool_calls"
        yield ChoiceEnd(reason, generation.stop_sequence, window_full=generation.window_full,
                        drafted=generation.drafting.drafted, accepted=generation.drafting.accepted)

    def _reported(self, generation: Generation) -> Iterator[Event]:
        """What the request asked to know of the tokens sampled since the last report: their ids, their log
        probabilities."""
        if generation.token_ids:
            ids, generation.token_ids = generation.token_ids, []
            yield TokenIds(tuple(ids))
        if generation.sampled:
            yield self._logprobs(generation)

    def _logprobs(self, generation: Generation) -> Logprobs:
        """The tokens sampled since the last report, as bytes with their log probabilities."""
        sampled, generation.sampled = generation.sampled, []

        def piece(token: int) -> bytes:  # a token that adds no text (a control token) shows its own
            return self.tokenizer.piece(token) or self.tokenizer.token_text(token).encode("utf-8", "surrogateescape")

        return Logprobs(tuple(
            TokenLogprob(piece(s.token), s.logprob, tuple((piece(t), lp) for t, lp in s.top), s.token,
                         tuple(t for t, _ in s.top))
            for s in sampled
        ))


class EmbeddingJob:
    """Embed each input: the final hidden state of its last token, scaled to unit length."""

    completion_tokens = 0
    cached_tokens = 0
    slot = None

    def __init__(self, inputs: list[list[int]], scope: str = "") -> None:
        self.inputs = inputs
        self.scope = scope
        self.prompt_tokens = sum(len(tokens) for tokens in inputs)

    @property
    def prefix(self) -> list[int]:
        return self.inputs[0]

    def run(self, slot: Slot, context_length: int, cancelled: Callable[[], bool]) -> Iterator[Event]:
        slot.enter(self.scope)
        for index, tokens in enumerate(self.inputs):
            slot.prefill(tokens, cancelled)
            vector = slot.embedding()
            norm = float(np.linalg.norm(vector))
            yield Embedding(index, vector / norm if norm > 0 else vector)
        yield Finished(Usage(self.prompt_tokens, 0))


class RerankJob:
    """Score each prompt (a query and one document) with a reranker: its classification head's output."""

    completion_tokens = 0
    cached_tokens = 0
    slot = None
    prefix: list[int] = []  # nothing is reused (Slot.rank): any slot will do

    def __init__(self, inputs: list[list[int]], scope: str = "") -> None:
        self.inputs = inputs
        self.scope = scope
        self.prompt_tokens = sum(len(tokens) for tokens in inputs)

    def run(self, slot: Slot, context_length: int, cancelled: Callable[[], bool]) -> Iterator[Event]:
        slot.keep_state(waited_for=True)  # what the slot held stays findable: ranking overwrites it
        for index, tokens in enumerate(self.inputs):
            yield Embedding(index, slot.rank(tokens, cancelled))
        yield Finished(Usage(self.prompt_tokens, 0))
