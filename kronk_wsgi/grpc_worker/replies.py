"""A generation's neutral events as the SGLang engine protocol's ``GenerateResponse`` messages.

Streamed, each report of new tokens is a chunk (token ids, their logprobs,
cumulative counts) and each choice ends with a ``GenerateComplete``; whole,
each choice is one ``GenerateComplete`` with every token. Ids are what the
worker sends: the gateway detokenizes them, so text events are not needed.
"""

import dataclasses
from typing import Optional

from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from ..serving.events import ChoiceEnd, Event, Logprobs, PromptCached, TokenIds


@dataclasses.dataclass
class _Choice:
    """One choice's tokens: all of them, and those not yet sent in a chunk."""

    ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list = dataclasses.field(default_factory=list)  # TokenLogprob of each sampled token
    sent_ids: int = 0
    sent_logprobs: int = 0
    ended: bool = False


class Replies:
    """The messages of one ``Generate`` call, fed its session's events in order."""

    def __init__(self, request_id: str, prompt_tokens: int, stream: bool, end_ids: frozenset[int],
                 logprobs: bool, choices: int = 1) -> None:
        self.request_id = request_id
        self.choices = choices
        self.prompt_tokens = prompt_tokens
        self.stream = stream
        self.end_ids = end_ids
        self.logprobs = logprobs
        self.cached_tokens = 0
        self._choices: dict[int, _Choice] = {}

    def feed(self, event: Event) -> list[pb.GenerateResponse]:
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
            out += self._chunks()
            out.append(self._complete(event))
        return out

    def aborted(self) -> list[pb.GenerateResponse]:
        """The end of each choice not ended yet, as an Abort call ends it: finish reason "abort"."""
        out = self._chunks()
        for index in range(self.choices):
            if not self._choice(index).ended:
                out.append(self._complete(ChoiceEnd("abort", index=index)))
        return out

    def _choice(self, index: int) -> _Choice:
        return self._choices.setdefault(index, _Choice())

    def _completion_tokens(self, choice: _Choice) -> int:
        """Tokens generated, an end token not counted."""
        return len(choice.ids) - (1 if choice.ids and choice.ids[-1] in self.end_ids else 0)

    def _chunks(self) -> list[pb.GenerateResponse]:
        if not self.stream:
            return []
        out = []
        for index, choice in self._choices.items():
            if choice.sent_ids == len(choice.ids):
                continue
            chunk = pb.GenerateStreamChunk(
                token_ids=choice.ids[choice.sent_ids:], prompt_tokens=self.prompt_tokens,
                completion_tokens=self._completion_tokens(choice), cached_tokens=self.cached_tokens, index=index,
                output_logprobs=self._output_logprobs(choice.logprobs[choice.sent_logprobs:]),
            )
            choice.sent_ids, choice.sent_logprobs = len(choice.ids), len(choice.logprobs)
            out.append(pb.GenerateResponse(request_id=self.request_id, chunk=chunk))
        return out

    def _complete(self, end: ChoiceEnd) -> pb.GenerateResponse:
        choice = self._choice(end.index)
        choice.ended = True
        matched: dict = {}
        if end.stop_sequence is not None:
            matched["matched_stop_str"] = end.stop_sequence
        elif end.reason == "stop" and choice.ids and choice.ids[-1] in self.end_ids:
            matched["matched_token_id"] = choice.ids[-1]
        complete = pb.GenerateComplete(
            output_ids=[] if self.stream else choice.ids, finish_reason=end.reason,
            prompt_tokens=self.prompt_tokens, completion_tokens=self._completion_tokens(choice),
            cached_tokens=self.cached_tokens, index=end.index, spec_accepted_tokens=end.accepted,
            spec_draft_tokens=end.drafted,
            output_logprobs=None if self.stream else self._output_logprobs(choice.logprobs), **matched,
        )
        return pb.GenerateResponse(request_id=self.request_id, complete=complete)

    def _output_logprobs(self, tokens: list) -> Optional[pb.OutputLogProbs]:
        if not self.logprobs or not tokens:
            return None
        return pb.OutputLogProbs(
            token_logprobs=[t.logprob for t in tokens], token_ids=[t.id for t in tokens],
            top_logprobs=[pb.TopLogProbs(values=[lp for _, lp in t.top], token_ids=list(t.top_ids)) for t in tokens],
        )
