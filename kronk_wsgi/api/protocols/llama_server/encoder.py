"""llama-server's completion objects: a chunk per piece of text, and each choice's final object with its timings."""

import dataclasses
import time
from typing import Any, Iterator, Optional, Union

from ....serving.events import (
    ChoiceEnd, Event, Failed, Finished, Logprobs, PromptCached, TextDelta, TokenIds, TokenLogprob,
)
from ....serving.session import GenerationStats
from ...errors import ApiError
from ...response import Encoder
from ...sse import sse
from ..openai_chat import by_choice, token_text
from .protocol import PROTOCOL, error_body


@dataclasses.dataclass
class Choice:
    """What one choice (a prompt's reply) has produced so far."""

    prompt_tokens: int
    content: str = ""
    predicted: int = 0
    first_at: Optional[float] = None


def probabilities(tokens: list[TokenLogprob]) -> list[dict]:
    """completion_probabilities: each token with its log probability and the likeliest tokens at its place."""

    def entry(token: int, piece: bytes, logprob: float) -> dict:
        return {"id": token, "logprob": logprob, "token": token_text(piece), "bytes": list(piece)}

    return [{**entry(t.id, t.piece, t.logprob),
             "top_logprobs": [entry(i, p, lp) for i, (p, lp) in zip(t.top_ids, t.top)]} for t in tokens]


def stop_type(end: ChoiceEnd) -> str:
    if end.reason == "length":
        return "limit"
    return "word" if end.stop_sequence is not None else "eos"


class CompletionEncoder(Encoder):
    """/completion's and /infill's objects. Streamed: ``data:`` chunks of content and token ids (``stop`` false),
    each choice's final object (``stop`` true), no end marker. Whole: the final object, with the content; a list of
    them for several prompts or completions."""

    protocol = PROTOCOL
    waits_for_prompt = True  # the first chunk can say how much of the prompt the cache serves

    def __init__(self, model: str, prompts: list[list[int]], prompt_texts: list[str], n: int, settings: dict,
                 options: dict, stats: GenerationStats, started: float) -> None:
        """``options``: return_tokens, n_probs, timings_per_token, return_progress, response_fields as asked;
        ``settings`` the generation settings echoed back; ``stats`` the session's; ``started`` when the request
        began (monotonic)."""
        super().__init__()
        self.model = model
        self.prompt_texts = prompt_texts
        self.n = n
        self.settings = settings
        self.options = options
        self.stats = stats
        self.started = started
        self.choices = [Choice(len(prompt)) for prompt in prompts for _ in range(n)]
        self.cached = 0

    def prompt_cached(self, event: PromptCached) -> None:
        self.cached = event.usage.cached_tokens

    def _slot(self) -> int:
        return self.stats.slot if self.stats.slot is not None else -1

    def _timings(self, choice: Choice) -> dict:
        first = choice is self.choices[0]  # the prompt's time and cache are the first choice's
        cache = self.cached if first else choice.prompt_tokens
        prompt_n = choice.prompt_tokens - cache
        prompt_ms = self.stats.prompt_seconds(time.monotonic() - self.started) * 1000 if first else 0.0
        predicted_ms = (time.monotonic() - choice.first_at) * 1000 if choice.first_at is not None else 0.0

        def per(count: int, ms: float) -> tuple[float, float]:
            return (ms / count if count else 0.0), (count * 1000 / ms if ms > 0 else 0.0)

        prompt_per_token, prompt_per_second = per(prompt_n, prompt_ms)
        # over the decode steps: the first token comes with the prompt's last batch, as llama-server counts it
        predicted_per_token, predicted_per_second = per(max(0, choice.predicted - 1), predicted_ms)
        return {"cache_n": cache, "prompt_n": prompt_n, "prompt_ms": prompt_ms,
                "prompt_per_token_ms": prompt_per_token, "prompt_per_second": prompt_per_second,
                "predicted_n": choice.predicted, "predicted_ms": predicted_ms,
                "predicted_per_token_ms": predicted_per_token, "predicted_per_second": predicted_per_second}

    def _chunk(self, index: int, content: str, ids: list[int], tokens: list[TokenLogprob]) -> dict:
        choice = self.choices[index]
        chunk: dict[str, Any] = {"index": index, "content": content, "tokens": ids, "stop": False,
                                 "id_slot": self._slot(),
                                 "tokens_predicted": choice.predicted, "tokens_evaluated": choice.prompt_tokens}
        if self.options["timings_per_token"]:
            chunk["timings"] = self._timings(choice)
        if self.options["n_probs"] and tokens:
            chunk["completion_probabilities"] = probabilities(tokens)
        return chunk

    def _final(self, index: int, end: ChoiceEnd, content: str, ids: list[int],
               tokens: Optional[list[TokenLogprob]]) -> dict:
        choice = self.choices[index]
        final = {
            "index": index, "content": content, "tokens": ids if self.options["return_tokens"] else [],
            "id_slot": self._slot(),
            "stop": True, "model": self.model, "tokens_predicted": choice.predicted,
            "tokens_evaluated": choice.prompt_tokens, "generation_settings": self.settings,
            "prompt": self.prompt_texts[index // self.n], "has_new_line": "\n" in choice.content,
            "truncated": False, "stop_type": stop_type(end), "stopping_word": end.stop_sequence or "",
            "tokens_cached": choice.prompt_tokens + max(0, choice.predicted - 1),  # what the slot holds now
            "timings": self._timings(choice),
        }
        if end.drafted:  # as llama-server reports speculation
            final["timings"].update(draft_n=end.drafted, draft_n_accepted=end.accepted)
        if tokens:
            final["completion_probabilities"] = probabilities(tokens)
        fields = self.options["response_fields"]
        return pick_fields(final, fields) if fields else final

    def _produced(self, index: int, text: str, ids: list[int]) -> None:
        choice = self.choices[index]
        if choice.first_at is None and (text or ids):
            choice.first_at = time.monotonic()
        choice.content += text
        choice.predicted += len(ids)

    def start(self) -> Iterator[str]:
        if self.options["return_progress"]:
            total = self.choices[0].prompt_tokens
            progress = {"total": total, "cache": self.cached, "processed": self.cached, "time_ms": 0}
            yield sse({**self._chunk(0, "", [], []), "prompt_progress": progress})
        else:
            yield ": prompt\n\n"  # the commit: a comment, which SSE readers skip

    def text(self, event: TextDelta) -> Iterator[str]:
        ids = self.take_token_ids(event.index)
        self._produced(event.index, event.text, ids)
        yield sse(self._chunk(event.index, event.text, ids, self.take_logprobs(event.index)))

    def choice_end(self, event: ChoiceEnd) -> Iterator[str]:
        ids = self.take_token_ids(event.index)
        self._produced(event.index, "", ids)
        tokens = self.take_logprobs(event.index)
        if ids or tokens:  # tokens that added no text (an end token's, a stop sequence's part)
            yield sse(self._chunk(event.index, "", ids, tokens))
        yield sse(self._final(event.index, event, "", [], None))

    def finished(self, event: Finished) -> Iterator[str]:
        return iter(())

    def failed(self, event: Failed) -> Iterator[str]:
        yield sse(error_body(ApiError(500, event.message, code=event.code)))

    def whole(self, output: list[Event], finished: Finished) -> Union[dict, list]:
        answers = []
        self.cached = finished.usage.cached_tokens
        first = self.stats.time_to_first_token
        for choice in self.choices:
            choice.first_at = self.started + first if first is not None else None
        for index, events in enumerate(by_choice(output, len(self.choices))):
            text = "".join(e.text for e in events if isinstance(e, TextDelta))
            ids = [i for e in events if isinstance(e, TokenIds) for i in e.ids]
            tokens = [t for e in events if isinstance(e, Logprobs) for t in e.tokens]
            end = next(e for e in events if isinstance(e, ChoiceEnd))
            self._produced(index, text, ids)
            answers.append(self._final(index, end, text, ids, tokens))
        return answers[0] if len(answers) == 1 else answers


def pick_fields(answer: dict, fields: list[str]) -> dict:
    """The fields asked for, those that exist; a path ``a/b`` brings ``b`` of ``a`` up, named by the path."""
    picked = {}
    for field in fields:
        value: Any = answer
        for part in field.split("/"):
            if not isinstance(value, dict) or part not in value:
                break
            value = value[part]
        else:
            picked[field] = value
    return picked
