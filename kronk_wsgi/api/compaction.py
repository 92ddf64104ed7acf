"""Compaction: a conversation near its context's end summarized by the model itself, and the shorter
conversation that takes its place (the user's, system and developer messages, then the summary).

The summary's prompt is the conversation as it stands with ``SUMMARY_PROMPT`` after it, so the prompt cache
serves all of the conversation and only the request to summarize is new. docs/PROTOCOLS.rst shows both texts.
"""

import dataclasses
from typing import Callable, Iterator, Optional

import structlog

from ..serving.events import ChoiceEnd, Compacted, Compacting, Event, Failed, Finished, KeepAlive, TextDelta
from ..serving.session import Session
from .errors import ApiError, invalid
from .planning import GenerationRequest
from .response import run_to_end
from .sessions import SessionChain, measure_prompt, start_generation

SUMMARY_PROMPT = (
    "Your context is nearly full, so this conversation will be replaced by a summary that you write now. Write "
    "it for yourself, to carry on the work without the conversation: what the user wants and asked for, what "
    "was decided and why, the facts and results found so far (names, paths, values, what tools returned that "
    "still matters), what is done, and what remains to do next. Write only the summary."
)
SUMMARY_HEADING = "A summary of the conversation before this point, which you wrote when it was compacted:\n\n"
MOST_SUMMARY_TOKENS = 4096  # a summary's length at most (less where the context has less room)
LEAST_SUMMARY_TOKENS = 64  # below this much room for a summary, compacting cannot help: a 400
REPLY_ROOM = 256  # the room for a reply a compacted conversation keeps, at least
KEPT_ROLES = ("user", "system")  # the messages a compacted conversation keeps (developer messages are "system")

log = structlog.get_logger("kronk_wsgi.compaction")


def summary_message(summary: str) -> dict:
    """The chat message a summary is in the conversations it compacted (marked, so a later compaction drops it)."""
    return {"role": "user", "content": SUMMARY_HEADING + summary, "compaction": True}


def kept(message: dict) -> bool:
    """Whether a compacted conversation keeps this earlier message: the user's own and the instructions."""
    return message["role"] in KEPT_ROLES and not message.get("compaction")


def compacted(messages: list[dict], summary: str) -> list[dict]:
    """``messages`` compacted: those kept, then the summary."""
    return [m for m in messages if kept(m)] + [summary_message(summary)]


def summary_request(request: GenerationRequest, max_tokens: int, instructions: Optional[str] = None) -> GenerationRequest:
    """The request for a summary of ``request``'s conversation: its prompt with SUMMARY_PROMPT (and the client's
    ``instructions``) after it, its tools shown but not called, no thinking, at most ``max_tokens``; with the oldest
    turns cut if it does not fit."""
    tools = request.tools and dataclasses.replace(request.tools, choice="none", name=None, allowed=None)
    asked = SUMMARY_PROMPT if instructions is None else f"{SUMMARY_PROMPT}\n\n{instructions}"
    return dataclasses.replace(
        request, messages=request.messages + [{"role": "user", "content": asked}], continue_final=False,
        truncate=True, n=1, tools=tools, reply_format=None, thinking=False, thinking_budget=None, stop=(),
        max_tokens=max_tokens, top_logprobs=None, token_ids=False, not_offered=(), cache_breaks=(),
    )


@dataclasses.dataclass(frozen=True)
class Plan:
    """How a request is compacted: its summary's request, and the reply's once the summary is written (``pause``:
    none, the answer ends with the summary)."""

    summary: GenerationRequest
    reply: Callable[[str], GenerationRequest]
    pause: bool = False


def plan_compaction(request: GenerationRequest, reply: Callable[[str], GenerationRequest],
                    instructions: Optional[str] = None, pause: bool = False) -> Plan:
    """The compaction of ``request``, whose reply once compacted is ``reply(summary)``: the summary may take what
    the context leaves beside the compacted conversation and a reply's room. 400 if that is too little (the kept
    messages alone nearly fill the context)."""
    base, context = measure_prompt(reply(""))
    room = min(MOST_SUMMARY_TOKENS, context - base - REPLY_ROOM)
    if room < LEAST_SUMMARY_TOKENS:
        raise invalid(f"context_management: the user's and system messages alone take {base} of the context's "
                      f"{context} tokens, which leaves no room for a summary and a reply: compacting cannot help",
                      param="context_management")
    return Plan(summary_request(request, room, instructions), reply, pause)


def start_compaction(plan: Plan) -> "CompactingSession":
    """Admit the summary's generation (the reply's follows it, on the same place): before the commit."""
    return CompactingSession(start_generation(plan.summary), None if plan.pause else plan.reply)


def write_summary(plan: Plan) -> tuple[str, Finished]:
    """Write the summary now, whole (before the commit): its text, and how its generation finished."""
    output, finished = run_to_end(start_generation(plan.summary))
    return _summary_text(output), finished


def _summary_text(events: list[Event]) -> str:
    return "".join(e.text for e in events if isinstance(e, TextDelta)).strip()


class CompactingSession(SessionChain):
    """The summary's generation, then the reply's on the conversation it compacted, as one session's events:
    Compacting, the summary's keep-alives, Compacted (the summary), then the reply's own events. The reply is
    planned once its summary is written. With no ``reply``, the answer ends with the summary: a "compaction"
    ChoiceEnd, and the summary's Finished."""

    def __init__(self, summary: Session, reply: Optional[Callable[[str], GenerationRequest]]) -> None:
        super().__init__(summary)
        self.reply = reply

    def _steps(self) -> Iterator[Event]:
        yield Compacting()
        written: list[Event] = []
        for event in self.first:
            if isinstance(event, (KeepAlive, Failed)):
                yield event
                if isinstance(event, Failed):
                    return
            elif isinstance(event, TextDelta):
                written.append(event)
            elif isinstance(event, Finished):
                summary = _summary_text(written)
                usage = event.usage
                log.info("conversation compacted", prompt_tokens=usage.prompt_tokens, cached_tokens=usage.cached_tokens,
                         summary_tokens=usage.completion_tokens)
                yield Compacted(summary, usage)
                if self.reply is None:
                    yield ChoiceEnd("compaction")
                    yield event
                    return
                break
        else:
            return  # the client left, or the request's time ran out: the summary's session said so
        try:
            reply = self.follow(self.reply(summary))
        except ApiError as exc:
            yield Failed(exc.code or "invalid_request_error", exc.message)
            return
        yield from reply
