"""POST /v1/completions: OpenAI's legacy text completions, streamed or whole."""

import itertools
import time
import uuid
from typing import Annotated, Any, Iterator, Literal, Optional, Union

import pydantic
from flask import Blueprint
from pydantic import Field

from ...serving.events import ChoiceEnd, Event, Finished, Logprobs, TextDelta, TokenLogprob
from ..body import parse_body
from ..planning import Ending, GenerationRequest
from ..protocol import Protocol
from ..response import respond
from ..schemas import SamplingFields, StreamOptions, grammar_fields
from ..sessions import start_generation
from ..sse import sse
from ..state import record
from .openai_chat import FINGERPRINT, OpenAIEncoder, by_choice, token_text, usage_body

bp = Blueprint("openai_completions", __name__)
PROTOCOL = Protocol("openai_completions", bp, prefixes=("/v1/completions",))


Tokens = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]


class CompletionRequest(SamplingFields):
    """``prompt`` as a string or token ids, or a list of several of either: each prompt gets ``n`` choices."""

    model: str
    prompt: Union[str, Tokens, Annotated[list[str], Field(min_length=1)], Annotated[list[Tokens], Field(min_length=1)]]
    max_tokens: Optional[Annotated[int, Field(ge=1)]] = 16
    max_completion_tokens: Optional[Annotated[int, Field(ge=1)]] = None  # what the SGLang gateway renames it to
    continue_final_message: Literal[False] = False  # the gateway writes it here too; a prompt is always continued
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    echo: Literal[False] = False
    suffix: Optional[str] = None
    best_of: Literal[1] = 1
    logprobs: Optional[Annotated[int, Field(ge=0, le=5)]] = None
    # llama-server's, which clients written for it send
    grammar: Optional[str] = None  # GBNF
    json_schema: Optional[dict[str, Any]] = None

    @pydantic.model_validator(mode="after")
    def _checks(self) -> "CompletionRequest":
        if self.suffix:
            raise ValueError("suffix (fill-in-the-middle) is not supported")
        if self.grammar is not None and self.json_schema is not None:
            raise ValueError("give json_schema or grammar, not both")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    def prompts(self) -> list[Union[str, list[int]]]:
        """Each prompt: a text or token ids."""
        if isinstance(self.prompt, str) or isinstance(self.prompt[0], int):
            return [self.prompt]
        return list(self.prompt)

    def generation_request(self) -> GenerationRequest:
        """What the body asks for, as the planner takes it."""
        return GenerationRequest(
            self.model, prompt_param="prompt", prompts=self.prompts(), n=self.n, sampling=self.sampling(),
            sampling_defaulted=self.sampling_defaulted(), stop=self.stop_sequences(),
            max_tokens=self.max_completion_tokens or self.max_tokens,
            top_logprobs=self.logprobs, ending=Ending(ignore_eos=self.ignore_eos),
            reply_format=grammar_fields(self.grammar, self.json_schema),
        )


@bp.post("/v1/completions")
def completions():
    """Continue each prompt."""
    body = parse_body(CompletionRequest)
    prompts = body.prompts()
    session = start_generation(body.generation_request())
    completion_id = record().response_id = "cmpl-" + uuid.uuid4().hex
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    encoder = CompletionEncoder(body.model, completion_id, include_usage, len(prompts) * body.n, body.logprobs is not None)
    return respond(session, encoder, body.stream)


def _logprobs(tokens: list[TokenLogprob], offset: int) -> dict:
    """The legacy logprobs object; text offsets count from ``offset`` characters into the choice's text."""
    texts = [token_text(t.piece) for t in tokens]
    offsets = list(itertools.accumulate((len(t) for t in texts[:-1]), initial=offset))
    return {
        "tokens": texts, "token_logprobs": [t.logprob for t in tokens],
        "top_logprobs": [{token_text(piece): lp for piece, lp in t.top} for t in tokens], "text_offset": offsets,
    }


class CompletionEncoder(OpenAIEncoder):
    """text_completion frames: an empty choice first (the commit), text, finishes, usage, [DONE]."""

    protocol = PROTOCOL

    def __init__(self, model: str, completion_id: str, include_usage: bool, choices: int = 1,
                 logprobs: bool = False) -> None:
        head = {"id": completion_id, "object": "text_completion", "created": int(time.time()), "model": model,
                "system_fingerprint": FINGERPRINT}
        super().__init__(head, include_usage, choices)
        self.with_logprobs = logprobs
        self.offsets: dict[int, int] = {}  # characters of each choice's text sent so far

    def _choice(self, index: int, text: str, finish: Optional[str], tokens: Optional[list[TokenLogprob]]) -> dict:
        offset = self.offsets.get(index, 0)
        self.offsets[index] = offset + sum(len(token_text(t.piece)) for t in tokens or ())
        listed = _logprobs(tokens, offset) if self.with_logprobs and tokens is not None else None
        return {"text": text, "index": index, "logprobs": listed, "finish_reason": finish}

    def _frame(self, index: int, text: str, finish: Optional[str] = None,
               tokens: Optional[list[TokenLogprob]] = None) -> str:
        extra = {"usage": None} if self.include_usage else {}
        return sse({**self.head, "choices": [self._choice(index, text, finish, tokens)], **extra})

    def start(self) -> Iterator[str]:
        yield self._frame(0, "")

    def text(self, event: TextDelta) -> Iterator[str]:
        yield self._frame(event.index, event.text, tokens=self.take_logprobs(event.index))

    def choice_end(self, event: ChoiceEnd) -> Iterator[str]:
        yield self._frame(event.index, "", event.reason, self.take_logprobs(event.index))

    def whole(self, output: list[Event], finished: Finished) -> dict:
        choices = []
        for index, events in enumerate(by_choice(output, self.choices)):
            text = "".join(e.text for e in events if isinstance(e, TextDelta))
            tokens = [t for e in events if isinstance(e, Logprobs) for t in e.tokens]
            end = next(e for e in events if isinstance(e, ChoiceEnd))
            choices.append(self._choice(index, text, end.reason, tokens))
        return {**self.head, "choices": choices, "usage": usage_body(finished.usage)}
