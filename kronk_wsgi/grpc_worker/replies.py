"""A generation's neutral events as ``GenerateResponse`` messages, of SGLang's engine protocol or vLLM's (the same
messages, but for a few fields vLLM's lack).

Streamed, each report of new tokens is a chunk (token ids, their logprobs,
cumulative counts; with a ``stream_interval``, once that many tokens are
unsent) and each choice ends with a ``GenerateComplete``; whole, each choice
is one ``GenerateComplete`` with every token. Ids are what the worker sends:
the gateway detokenizes them, so text events are not needed.
"""

import dataclasses
from types import ModuleType
from typing import Optional

from smg_grpc_proto.generated import sglang_scheduler_pb2

from ..serving.events import ChoiceEnd, Event, Logprobs, PromptCached, TokenIds


@dataclasses.dataclass
class _Choice:
    """One choice's tokens: all of them, and those not yet sent in a chunk."""

    ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list = dataclasses.field(default_factory=list)  # TokenLogprob of each sampled token
    sent_ids: int = 0
    sent_logprobs: int = 0
    ended: bool = False
    searched: int = 0  # ids before this are known not to end the thinking
    thinking_ended: Optional[int] = None  # the tokens up to the thinking's end, once it ended


def message(kind, **fields):
    """A message of type ``kind`` with those of ``fields`` its protocol has (the others are of the other's)."""
    have = kind.DESCRIPTOR.fields_by_name
    return kind(**{name: value for name, value in fields.items() if name in have})


class Replies:
    """The messages of one ``Generate`` call, fed its session's events in order."""

    def __init__(self, request_id: str, prompt_tokens: int, stream: bool, end_ids: frozenset[int],
                 logprobs: bool, choices: int = 1, stream_interval: int = 1,
                 thinking_end: tuple[int, ...] = (), pb: ModuleType = sglang_scheduler_pb2) -> None:
        """``thinking_end``: the ids of the tag that ends the model's thinking, to count reasoning tokens by
        (empty: not asked, or the model does not think); ``pb``: the protocol's messages."""
        self.pb = pb
        self.request_id = request_id
        self.choices = choices
        self.prompt_tokens = prompt_tokens
        self.stream = stream
        self.end_ids = end_ids
        self.logprobs = logprobs
        self.stream_interval = stream_interval
        self.thinking_end = thinking_end
        self.cached_tokens = 0
        self._choices: dict[int, _Choice] = {}

    def feed(self, event: Event) -> list:
        """The messages ``event`` completes: a chunk once a report's tokens and logprobs are in, a choice's end."""
        if isinstance(event, PromptCached):
            self.cached_tokens = event.usage.cached_tokens
            return []
        if isinstance(event, Logprobs):
            self._choice(event.index).logprobs.extend(event.tokens)
            return []
        out = self._chunks()  # a report's logprobs follow its ids: whatever comes next, the report is whole
        if isinstance(event, TokenIds):
            self._choice(event.index).ids.extend(event.ids)
        elif isinstance(event, ChoiceEnd):
            out += self._chunks(flush=True)
            out.append(self._complete(event))
        return out

    def aborted(self) -> list:
        """The end of each choice not ended yet, as an Abort call ends it: finish reason "abort"."""
        out = self._chunks(flush=True)
        for index in range(self.choices):
            if not self._choice(index).ended:
                out.append(self._complete(ChoiceEnd("abort", index=index)))
        return out

    def _choice(self, index: int) -> _Choice:
        return self._choices.setdefault(index, _Choice())

    def _completion_tokens(self, choice: _Choice) -> int:
        """Tokens generated, an end token not counted."""
        return len(choice.ids) - (1 if choice.ids and choice.ids[-1] in self.end_ids else 0)

    def _reasoning_tokens(self, choice: _Choice) -> int:
        """Tokens of the thinking, its closing tag included: all so far while it has not ended (as SGLang counts
        them for a call that sets ``require_reasoning``)."""
        end = self.thinking_end
        if not end:
            return 0
        if choice.thinking_ended is None:
            ids = choice.ids
            for start in range(choice.searched, len(ids) - len(end) + 1):
                if tuple(ids[start:start + len(end)]) == end:
                    choice.thinking_ended = start + len(end)
                    break
            else:
                choice.searched = max(choice.searched, len(ids) - len(end) + 1)
                return self._completion_tokens(choice)
        return choice.thinking_ended

    def _chunks(self, flush: bool = False) -> list:
        """A chunk of each choice's unsent tokens (once there are ``stream_interval`` of them, any if ``flush``)."""
        if not self.stream:
            return []
        out = []
        for index, choice in self._choices.items():
            if len(choice.ids) - choice.sent_ids < (1 if flush else self.stream_interval):
                continue
            chunk = message(
                self.pb.GenerateStreamChunk,
                token_ids=choice.ids[choice.sent_ids:], prompt_tokens=self.prompt_tokens,
                completion_tokens=self._completion_tokens(choice), cached_tokens=self.cached_tokens, index=index,
                reasoning_tokens=self._reasoning_tokens(choice),
                output_logprobs=self._output_logprobs(choice.logprobs[choice.sent_logprobs:]),
            )
            choice.sent_ids, choice.sent_logprobs = len(choice.ids), len(choice.logprobs)
            out.append(message(self.pb.GenerateResponse, request_id=self.request_id, chunk=chunk))
        return out

    def _complete(self, end: ChoiceEnd):
        choice = self._choice(end.index)
        choice.ended = True
        matched: dict = {}
        if end.stop_sequence is not None:
            matched["matched_stop_str"] = end.stop_sequence
        elif end.reason == "stop" and choice.ids and choice.ids[-1] in self.end_ids:
            matched["matched_token_id"] = choice.ids[-1]
        complete = message(
            self.pb.GenerateComplete,
            output_ids=[] if self.stream else choice.ids, finish_reason=end.reason,
            prompt_tokens=self.prompt_tokens, completion_tokens=self._completion_tokens(choice),
            cached_tokens=self.cached_tokens, reasoning_tokens=self._reasoning_tokens(choice), index=end.index,
            spec_accepted_tokens=end.accepted,
            spec_draft_tokens=end.drafted,
            output_logprobs=None if self.stream else self._output_logprobs(choice.logprobs), **matched,
        )
        return message(self.pb.GenerateResponse, request_id=self.request_id, complete=complete)

    def _output_logprobs(self, tokens: list):
        if not self.logprobs or not tokens:
            return None
        return self.pb.OutputLogProbs(
            token_logprobs=[t.logprob for t in tokens], token_ids=[t.id for t in tokens],
            top_logprobs=[self.pb.TopLogProbs(values=[lp for _, lp in t.top], token_ids=list(t.top_ids))
                          for t in tokens],
        )
