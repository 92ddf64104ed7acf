"""Ollama's NDJSON lines for a generation's events."""

import json
import time
from typing import Any, Iterator, Optional


from ....serving.events import ChoiceEnd, Event, Failed, Finished, Logprobs, ReasoningDelta, TextDelta, ToolCall
from ....serving.session import GenerationStats
from ...response import Encoder
from ..openai_chat import by_choice, token_text
from .protocol import PROTOCOL, line, nanoseconds, timestamp

def _tool_call(event: ToolCall, number: int) -> dict:
    try:
        arguments = json.loads(event.arguments)
    except ValueError:  # a call cut short by max_tokens: its text as it is
        arguments = {"": event.arguments}
    return {"id": "call_" + event.id, "function": {"index": number, "name": event.name, "arguments": arguments}}


class OllamaEncoder(Encoder):
    """NDJSON lines: a delta per piece of text, thinking or tool call, then a last line with done, done_reason and
    Ollama's statistics in nanoseconds; a failure after the first line is one more line with ``error``."""

    protocol = PROTOCOL

    def __init__(self, name: str, chat: bool, logprobs: bool, stats: GenerationStats, started: float,
                 load_seconds: float) -> None:
        """``stats`` are the session's, filled in as it runs; ``started`` is when the request began (monotonic)."""
        super().__init__()
        self.name = name
        self.chat = chat
        self.with_logprobs = logprobs
        self.stats = stats
        self.started = started
        self.load_seconds = load_seconds
        self.reason = "stop"
        self.calls = 0

    def _delta(self, content: str = "", thinking: str = "", calls: Optional[list[dict]] = None,
               logprobs: Optional[list[dict]] = None, done: bool = False) -> dict:
        line: dict[str, Any] = {"model": self.name, "created_at": timestamp()}
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if thinking:
                message["thinking"] = thinking
            if calls:
                message["tool_calls"] = calls
            line["message"] = message
        else:
            line["response"] = content
            if thinking:
                line["thinking"] = thinking
        if logprobs:
            line["logprobs"] = logprobs
        line["done"] = done
        return line

    def _logprobs(self) -> Optional[list[dict]]:
        if not self.with_logprobs:
            return None
        return [{"token": token_text(t.piece), "logprob": t.logprob, "bytes": list(t.piece),
                 "top_logprobs": [{"token": token_text(p), "logprob": lp, "bytes": list(p)} for p, lp in t.top]}
                for t in self.take_logprobs()]

    def _stats(self, finished: Finished) -> dict:
        elapsed = time.monotonic() - self.started
        return {
            "done_reason": self.reason, "total_duration": nanoseconds(elapsed),
            "load_duration": nanoseconds(self.load_seconds), "prompt_eval_count": finished.usage.prompt_tokens,
            "prompt_eval_duration": nanoseconds(self.stats.prompt_seconds(elapsed)),
            "eval_count": finished.usage.completion_tokens,
            "eval_duration": nanoseconds(max(0.0, elapsed - self.stats.first_token(elapsed))),
        }

    def start(self) -> Iterator[str]:
        yield line(self._delta())

    def text(self, event: TextDelta) -> Iterator[str]:
        yield line(self._delta(event.text, logprobs=self._logprobs()))

    def reasoning(self, event: ReasoningDelta) -> Iterator[str]:
        yield line(self._delta(thinking=event.text))

    def tool_call(self, event: ToolCall) -> Iterator[str]:
        self.calls += 1
        yield line(self._delta(calls=[_tool_call(event, self.calls - 1)]))

    def choice_end(self, event: ChoiceEnd) -> Iterator[str]:
        self.reason = "length" if event.reason == "length" else "stop"
        rest = self._logprobs()
        if rest:
            yield line(self._delta(logprobs=rest))

    def finished(self, event: Finished) -> Iterator[str]:
        yield line({**self._delta(done=True), **self._stats(event)})

    def failed(self, event: Failed) -> Iterator[str]:
        yield line({"model": self.name, "created_at": timestamp(), "error": event.message, "done": True})

    def whole(self, output: list[Event], finished: Finished) -> dict:
        events = by_choice(output, 1)[0]
        text = "".join(e.text for e in events if isinstance(e, TextDelta))
        thought = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
        calls = [_tool_call(e, n) for n, e in enumerate(e for e in events if isinstance(e, ToolCall))]
        end = next(e for e in events if isinstance(e, ChoiceEnd))
        self.reason = "length" if end.reason == "length" else "stop"
        for event in events:
            if isinstance(event, Logprobs):
                self.logprobs(event)
        return {**self._delta(text, thought, calls, self._logprobs(), done=True), **self._stats(finished)}


