"""A loaded model's one queue: its admission places and its slots, given out first come, first served.

A request is admitted at once when a place is free and nobody waits before
it; else it joins the line and sleeps on its ticket until a place given back
is handed to it (the oldest waiter first), or its wait ends: the admission
timeout (Overloaded), its client leaving (ClientGone), or the server's drain
(ShuttingDown). A line already ``max_waiting`` long refuses at once (QueueFull).

Admitted requests wait in a second line for a slot. Whenever a slot is given
back or a request joins, the line is served in order: each request gets the
free slot that holds most of its prompt in its scope (``Slot.fit``), else the
free one unused longest. A request whose conversation's slot is still
finishing after its answer waits for that slot (its prompt is mostly there), and those
behind it may take the others. Nobody polls for a place or a slot: whoever
frees one hands it over and wakes its new holder.
"""

import collections
import time
from typing import Callable, Optional, Sequence

import gevent.event

from ..engine.base import Slot
from ..metrics import Metrics
from .drain import Drain, ShuttingDown

# How often a waiter looks at its client's socket (the only thing a waiter looks at on a timer).
CLIENT_POLL_SECONDS = 0.5

# A slot's states, each with the states it may move to. Handed out, a slot is prefilling; its first token makes
# it generating; its answer out, it is finishing (its thread saves the prompt's state for the cache, if any, and
# ends); given back, idle. A slot taken away (its gRPC worker removed) is retired once it is given back, and never
# handed out again. Every move is made here (``_move``).
SLOT_STATES = {
    "idle": ("prefilling", "retired"),
    "prefilling": ("generating", "finishing", "idle", "retired"),
    "generating": ("finishing", "idle", "retired"),
    "finishing": ("idle", "retired"),
    "retired": (),
}


class Overloaded(RuntimeError):
    """No admission place came free within the admission timeout."""

    def __init__(self, model_id: str, waited: float) -> None:
        super().__init__(f"model {model_id!r} is busy: no place came free in {waited:.0f} s; retry later")
        self.retry_after = max(1, int(waited))


class QueueFull(RuntimeError):
    """The model's line of waiting requests is full: refused without waiting."""

    def __init__(self, model_id: str, waiting: int) -> None:
        super().__init__(f"model {model_id!r} is busy: {waiting} requests wait for it already; retry later")
        self.retry_after = 5


class ClientGone(Exception):
    """The client closed its connection."""


class _Ticket:
    """One waiter's place in a line; ``granted`` is set by whoever hands it what it waits for."""

    def __init__(self, prefix: Sequence[int] = (), scope: str = "", wanted: Optional[Slot] = None) -> None:
        self.prefix = prefix
        self.scope = scope
        self.wanted = wanted  # the one slot it waits for, if it names one
        self.granted = gevent.event.Event()
        self.slot: Optional[Slot] = None


class Scheduler:
    """The places and slots of one model, and the two lines of requests waiting for them."""

    def __init__(self, model_id: str, slots: Sequence[Slot], places: int, max_waiting: Optional[int],
                 metrics: Metrics) -> None:
        self.model_id = model_id
        self.metrics = metrics
        self.places = places
        self.max_waiting = max_waiting
        self.held_places = 0
        self.slot_count = len(slots)  # not retired
        self.slots = tuple(slots)  # numbered as given, then as added
        self.states: dict[Slot, str] = {slot: "idle" for slot in slots}
        self._free = list(slots)  # the slot given back longest ago first
        self._retiring: set[Slot] = set()  # held slots that retire when they are given back
        self.idle = gevent.event.Event()  # set while no slot is held
        self.idle.set()
        self._place_line: collections.deque[_Ticket] = collections.deque()
        self._slot_line: list[_Ticket] = []
        self._report()

    # -- admission ------------------------------------------------------------------------------------------------

    @property
    def waiting(self) -> int:
        """Requests waiting for a place."""
        return len(self._place_line)

    @property
    def waiting_for_slot(self) -> int:
        return len(self._slot_line)

    def admit(self, timeout: float, client_gone: Callable[[], bool], drain: Drain) -> None:
        """Take a place, waiting in line up to ``timeout`` seconds; Overloaded, QueueFull, ClientGone or
        ShuttingDown if none is had. Give it back with ``release_place``."""
        if drain.started:
            raise ShuttingDown()
        if self.held_places < self.places and not self._place_line:
            self.held_places += 1
            return
        if self.max_waiting is not None and len(self._place_line) >= self.max_waiting:
            raise QueueFull(self.model_id, len(self._place_line))
        ticket = _Ticket()
        self._place_line.append(ticket)
        self._report()
        deadline = time.monotonic() + timeout
        try:
            while not ticket.granted.is_set():
                left = deadline - time.monotonic()
                if left <= 0:
                    raise Overloaded(self.model_id, timeout)
                if ticket.granted.wait(min(CLIENT_POLL_SECONDS, left)):
                    break
                if drain.started:
                    raise ShuttingDown()
                if client_gone():
                    raise ClientGone()
        except BaseException:
            if ticket.granted.is_set():  # handed a place as the wait ended: pass it on
                self.release_place()
            else:
                self._place_line.remove(ticket)
                self._report()
            raise

    def release_place(self) -> None:
        """Give a place back: to the oldest waiter, if any (unless places were taken away meanwhile)."""
        if self._place_line and self.held_places <= self.places:
            self._place_line.popleft().granted.set()
            self._report()
        else:
            self.held_places -= 1

    # -- slots ------------------------------------------------------------------------------------------------------

    def wait_for_slot(self, prefix: Sequence[int], scope: str, wanted: Optional[int] = None) -> _Ticket:
        """Join the slot line (for the slot numbered ``wanted`` alone, if given); the ticket's ``granted`` is set once
        it holds a slot (``ticket.slot``). Leave the line with ``leave`` if the wait ends first."""
        ticket = _Ticket(prefix, scope, None if wanted is None else self.slots[wanted])
        self._slot_line.append(ticket)
        self._serve()
        self._report()
        return ticket

    def leave(self, ticket: _Ticket) -> None:
        """Stop waiting for a slot; a slot handed to the ticket meanwhile is given back."""
        if ticket in self._slot_line:
            self._slot_line.remove(ticket)
            self._report()
        elif ticket.slot is not None:
            self.give_back(ticket.slot)
            ticket.slot = None

    def generating(self, slot: Slot) -> None:
        """The held slot's first token is out."""
        self._move(slot, "generating")

    def finishing(self, slot: Slot) -> None:
        """The held slot's answer is out: set before the client can send its next turn, which waits for it."""
        self._move(slot, "finishing")

    def add_slots(self, slots: Sequence[Slot], places: int) -> None:
        """Slots added to the model (a gRPC worker added), with ``places`` more admission places: free at once,
        numbered after the others."""
        self.places += places
        while self._place_line and self.held_places < self.places:
            self.held_places += 1
            self._place_line.popleft().granted.set()
        self.slots += tuple(slots)
        self.slot_count += len(slots)
        for slot in slots:
            self.states[slot] = "idle"
        self._free += slots
        self._serve()
        self._report()

    def retire(self, slots: Sequence[Slot], places: int) -> None:
        """Slots taken away (their gRPC worker removed), with ``places`` admission places: a free slot at once, a
        held one when it is given back; a held place when it is given back."""
        self.places -= places
        for slot in slots:
            self.slot_count -= 1
            if slot in self._free:
                self._free.remove(slot)
                self._move(slot, "retired")
            else:
                self._retiring.add(slot)
        if len(self._free) == self.slot_count:
            self.idle.set()

    def give_back(self, slot: Slot) -> None:
        """The slot is idle again: the line is served."""
        if slot in self._retiring:
            self._retiring.discard(slot)
            self._move(slot, "retired")
        else:
            self._move(slot, "idle")
            self._free.append(slot)
        self._serve()
        if len(self._free) == self.slot_count:
            self.idle.set()

    def _move(self, slot: Slot, state: str) -> None:
        """The one place a slot's state changes. A move its state does not lead to is no move: a slot given back
        already (its thread ended before the loop relayed its last event), or of a model closed, stays as it is."""
        if state in SLOT_STATES.get(self.states.get(slot, ""), ()):
            self.states[slot] = state
            self._report()

    def close(self) -> None:
        """The model is unloaded: its gauges go to zero."""
        self.states.clear()
        self._place_line.clear()
        self._slot_line.clear()
        self._report()

    def _report(self) -> None:
        states = list(self.states.values())
        for state in SLOT_STATES.keys() - {"retired"}:
            self.metrics.slots.labels(self.model_id, state).set(states.count(state))
        self.metrics.waiting.labels(self.model_id).set(len(self._place_line) + len(self._slot_line))

    def _serve(self) -> None:
        """Hand out free slots to the line, in order."""
        for ticket in list(self._slot_line):
            if not self._free:
                return
            if ticket.wanted is not None:
                if ticket.wanted not in self._free:
                    continue  # the slot it names is busy: those behind it may take the others
                best = ticket.wanted
            else:
                finishing = [slot for slot, state in self.states.items()
                             if state == "finishing" and slot not in self._retiring]
                # Of equals, the first: the free one unused longest.
                best = max(self._free + finishing, key=lambda slot: slot.fit(ticket.prefix, ticket.scope))
                if best in finishing:
                    continue  # its conversation's slot is still finishing after its answer: it waits for that one
            self._free.remove(best)
            self.idle.clear()
            self._slot_line.remove(ticket)  # before the move, which reports the line
            self._move(best, "prefilling")
            ticket.slot = best
            ticket.granted.set()
