"""One response path for every generating protocol: the commit, the stream, the whole answer, the close.

A protocol's ``Encoder`` says how it writes the neutral events as frames
when streamed, and as one object when not; its ``Protocol`` says how they
go on the wire. ``respond`` does the rest, the same
way for every protocol: the first frames go out at once (the commit), each
event becomes frames, a failure after the commit (the engine's, the request
timeout, a shutdown) becomes the protocol's in-band error and a proper end of
the body, and the session is closed however the stream ends.
"""

import abc
import contextlib
import gc
import os
import socket
import time
from typing import Iterable, Iterator, Optional

import flask
import gevent
import structlog
from flask import Response

from ..serving import offload
from ..serving.events import (
    ApprovalAsked, ArgumentsDelta, ChoiceEnd, Compacted, Compacting, Event, Failed, ServerToolCall, ServerToolResult,
    ToolsListed, Finished, KeepAlive, Logprobs, PromptCached, ReasoningDelta, TextDelta,
    TokenIds, TokenLogprob, ToolCall, ToolCallStart, coalesce,
)
from ..serving.session import Session
from .errors import ApiError
from .protocol import Protocol
from .sse import compact_json_pieces
from .state import record, state

# The status of an answer that is not streamed, by how its generation failed.
FAILURE_STATUS = {"timeout": 504, "shutdown": 503, "grammar_error": 400, "model_busy": 429,
                  "context_length_exceeded": 400, "invalid_request_error": 400}
BUSY_RETRY_SECONDS = 5  # Retry-After of a request an engine elsewhere was too busy to run
WHOLE_CHUNK = 1 << 20  # a whole answer goes out a megabyte at a time, each write watched

log = structlog.get_logger("kronk_wsgi.http")


class WriteWatch:
    """Hangs up on a client that stops reading: a write of the body that does not finish within ``timeout``.

    The server writes each piece the body yields before asking for the next, so the time since a yield
    that has not come back is the time its write has taken. Without a socket (another WSGI server) it
    watches nothing.
    """

    def __init__(self, sock: Optional[socket.socket], timeout: float, stats=None) -> None:
        self.sock, self.timeout, self.stats = sock, timeout, stats
        self.since: Optional[float] = None  # when the write under way began
        self._watcher = gevent.spawn(self._watch) if sock is not None else None

    def body(self, pieces: Iterable) -> Iterator:
        """The pieces, each timed while the server writes it."""
        try:
            for piece in pieces:
                self.since = time.monotonic()
                yield piece
                self.since = None
        finally:
            if self._watcher is not None:
                self._watcher.kill(block=False)

    def _watch(self) -> None:
        while True:
            gevent.sleep(min(1.0, self.timeout / 2))
            if self.since is not None and time.monotonic() - self.since > self.timeout:
                log.warning("client stopped reading", write_timeout=self.timeout)
                if self.stats is not None:
                    self.stats.outcome = "write_timeout"
                try:
                    # Through a duplicate of its descriptor: the blocked write then fails as any broken
                    # connection's does (EPIPE), not as a socket closed under it.
                    with socket.socket(fileno=os.dup(self.sock.fileno())) as twin:
                        twin.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                return


class Encoder(abc.ABC):
    """One protocol's way of writing a generation."""

    protocol: Protocol  # whose framing the frames go out in

    def __init__(self) -> None:
        self._held_logprobs: dict[int, list[TokenLogprob]] = {}
        self._held_ids: dict[int, list[int]] = {}

    @abc.abstractmethod
    def start(self) -> Iterator[str]:
        """The first frames: they commit the response."""

    @abc.abstractmethod
    def text(self, event: TextDelta) -> Iterator[str]:
        """Frames for new text."""

    def reasoning(self, event: ReasoningDelta) -> Iterator[str]:
        """Frames for new thinking (only chat protocols get any)."""
        raise NotImplementedError(f"{type(self).__name__} takes no chat")

    def logprobs(self, event: Logprobs) -> Iterator[str]:
        """No frames: log probabilities are held, per choice, for the frames of the text they belong to."""
        self._held_logprobs.setdefault(event.index, []).extend(event.tokens)
        return iter(())

    def take_logprobs(self, index: int = 0) -> list[TokenLogprob]:
        """The log probabilities held for a choice, since the last take."""
        return self._held_logprobs.pop(index, [])

    def token_ids(self, event: TokenIds) -> Iterator[str]:
        """No frames: token ids are held, per choice, for the frames of the text they belong to."""
        self._held_ids.setdefault(event.index, []).extend(event.ids)
        return iter(())

    def take_token_ids(self, index: int = 0) -> list[int]:
        """The token ids held for a choice, since the last take."""
        return self._held_ids.pop(index, [])

    def compacting(self, event: Compacting) -> Iterator[str]:
        """Frames for the start of a compaction (only protocols that compact get one)."""
        raise NotImplementedError(f"{type(self).__name__} does not compact")

    def compacted(self, event: Compacted) -> Iterator[str]:
        """Frames for a compaction's written summary."""
        raise NotImplementedError(f"{type(self).__name__} does not compact")

    def tools_listed(self, event: ToolsListed) -> Iterator[str]:
        """Frames for the listing of a server's tools the server runs (only protocols that run tools get one)."""
        raise NotImplementedError(f"{type(self).__name__} runs no tools")

    def server_call(self, event: ServerToolCall) -> Iterator[str]:
        """Frames for a call of a tool the server runs."""
        raise NotImplementedError(f"{type(self).__name__} runs no tools")

    def server_result(self, event: ServerToolResult) -> Iterator[str]:
        """Frames for its result."""
        raise NotImplementedError(f"{type(self).__name__} runs no tools")

    def approval_asked(self, event: ApprovalAsked) -> Iterator[str]:
        """Frames for a call that waits for the client's approval."""
        raise NotImplementedError(f"{type(self).__name__} runs no tools")

    def call_start(self, event: ToolCallStart) -> Iterator[str]:
        """Frames for the start of a tool call whose arguments follow; none where the protocol sends calls whole
        (the ToolCall that ends it has them all)."""
        return iter(())

    def call_arguments(self, event: ArgumentsDelta) -> Iterator[str]:
        """Frames for more of a started call's arguments; none where the protocol sends calls whole."""
        return iter(())

    def tool_call(self, event: ToolCall) -> Iterator[str]:
        """Frames for a tool call, or the end of a started one (only protocols that take tools get one)."""
        raise NotImplementedError(f"{type(self).__name__} takes no tools")

    @abc.abstractmethod
    def choice_end(self, event: ChoiceEnd) -> Iterator[str]:
        """Frames for the end of one choice."""

    @abc.abstractmethod
    def finished(self, event: Finished) -> Iterator[str]:
        """The last frames of a generation that ended normally."""

    @abc.abstractmethod
    def failed(self, event: Failed) -> Iterator[str]:
        """The in-band error of a generation that failed after the commit."""

    @abc.abstractmethod
    def whole(self, output: list[Event], finished: Finished) -> dict:
        """The answer as one object, when it is not streamed; ``output`` has text runs merged. Built in a worker
        thread: it touches nothing but its arguments and the encoder."""

    # Whether the first frames wait for PromptCached, to carry the prompt's cache split (keep-alives may come first).
    waits_for_prompt = False

    def prompt_cached(self, event: PromptCached) -> None:
        """Take the prompt's cache split, known before it is evaluated (no frames of its own)."""

    def store_whole(self, answer: dict) -> None:
        """Store a whole answer where the protocol stores answers (on the event loop, before the client has it)."""

    def frames(self, events: Iterator[Event]) -> Iterator[str]:
        """Every frame of a streamed answer, from the start to the protocol's end or its in-band error."""
        started = not self.waits_for_prompt
        if started:
            yield from self.start()
        writers = {
            TextDelta: self.text, ReasoningDelta: self.reasoning, Logprobs: self.logprobs, TokenIds: self.token_ids,
            ToolCallStart: self.call_start, ArgumentsDelta: self.call_arguments, ToolCall: self.tool_call,
            ChoiceEnd: self.choice_end, Finished: self.finished, Failed: self.failed, Compacting: self.compacting,
            Compacted: self.compacted, ToolsListed: self.tools_listed, ServerToolCall: self.server_call,
            ServerToolResult: self.server_result, ApprovalAsked: self.approval_asked,
        }
        for event in events:
            if isinstance(event, KeepAlive):
                yield self.protocol.framing.keepalive
                continue
            if isinstance(event, PromptCached):
                self.prompt_cached(event)
            if not started:
                started = True
                yield from self.start()
            if not isinstance(event, PromptCached):
                yield from writers[type(event)](event)


def respond(session: Session, encoder: Encoder, stream: bool) -> Response:
    """The response to a generation: a stream in the protocol's framing, or the whole answer once it is done."""
    record().session = None  # this response closes it
    if stream:
        response = encoder.protocol.stream(watched(_closing(session, encoder), session.stats))
        response.call_on_close(session.close)
        return response
    output, finished = run_to_end(session)
    # Off the event loop: n choices of long answers with their log probabilities are hundreds of thousands of
    # objects, tens of megabytes of JSON.
    with _collector_paused():
        answer = offload.call(state().body_thread, encoder.whole, output, finished)
        encoder.store_whole(answer)
        body = offload.call(state().body_thread, _json_bytes, answer)
        del answer  # freed before the collector runs again, or its first pass would walk all of it
    pieces = (body[i:i + WHOLE_CHUNK] for i in range(0, len(body), WHOLE_CHUNK))
    response = Response(watched(pieces, record()), mimetype="application/json")
    response.headers["Content-Length"] = str(len(body))
    return response


def _json_bytes(value: dict) -> bytes:
    return "".join(compact_json_pieces(value)).encode()


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Python's cycle collector paused for a moment. A whole answer is up to millions of new containers: each
    collection they set off walks the growing heap holding the GIL, and stalled the event loop up to half a
    second a time. Reference counting frees them once the answer is out."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def watched(pieces: Iterable, stats=None) -> Iterator:
    """A response body whose writes time out after the write_timeout setting (see WriteWatch); ``stats`` (a
    session's, or the request's record) gets the outcome."""
    sock = flask.request.environ.get("gunicorn.socket")
    return WriteWatch(sock, state().settings.write_timeout, stats).body(pieces)


def _closing(session: Session, encoder: Encoder) -> Iterator[str]:
    try:
        yield from encoder.frames(iter(session))
    finally:
        session.close()


def run_to_end(session: Session) -> tuple[list[Event], Finished]:
    """Run a session whose answer is not streamed: its output events and how it finished.

    Each run of one choice's text comes back merged (``coalesce``). An engine failure becomes a 500 (the
    request timeout a 504, a shutdown a 503, an engine elsewhere busy past its admission wait a 429), a client
    that left a 499; the session is closed in every case.
    """
    output: list[Event] = []
    try:
        for event in session:
            if isinstance(event, Finished):
                return coalesce(output), event
            if isinstance(event, Failed):
                raise ApiError(FAILURE_STATUS.get(event.code, 500), event.message, code=event.code,
                               headers={"Retry-After": str(BUSY_RETRY_SECONDS)} if event.code == "model_busy" else None)
            if not isinstance(event, (KeepAlive, PromptCached)):
                output.append(event)
    finally:
        session.close()
    raise ApiError(499, "client closed the connection")
