"""A model's queue, in process: places and slots go to requests in the order they came, without polling.

The slots here are plain objects with what the scheduler reads of a slot (a local slot's fit: how much of a
prompt its scope and cached tokens hold); the flows through real gunicorn are in tests/test_queueing.py.
"""

import dataclasses
import time

import gevent
import pytest

from kronk_wsgi.engine.base import Slot
from kronk_wsgi.metrics import Metrics
from kronk_wsgi.serving.drain import Drain
from kronk_wsgi.serving.scheduler import ClientGone, Overloaded, QueueFull, Scheduler


@dataclasses.dataclass(eq=False)
class Held:
    """What a slot holds, as the scheduler sees it."""

    cached: list
    scope: str = ""
    fit = Slot.fit


def never() -> bool:
    return False


def scheduler(slots=(), places=1, max_waiting=None) -> Scheduler:
    return Scheduler("m", list(slots) or [Held([])], places, max_waiting, Metrics())


def in_line(queue: Scheduler, waiting: int) -> None:
    """Let the spawned waiters run until ``waiting`` of them are in line."""
    deadline = time.monotonic() + 10
    while queue.waiting < waiting:
        assert time.monotonic() < deadline, "the waiters never got in line"
        gevent.sleep(0)


def test_places_go_to_waiters_in_the_order_they_came():
    queue = scheduler(places=1)
    queue.admit(1, never, Drain())
    order = []

    def wait(i: int) -> None:
        queue.admit(30, never, Drain())
        order.append(i)
        queue.release_place()

    waiters = []
    for i in range(8):
        waiters.append(gevent.spawn(wait, i))
        in_line(queue, i + 1)
    assert queue.waiting == 8
    queue.release_place()
    gevent.joinall(waiters, timeout=10)
    assert order == list(range(8))
    assert queue.held_places == 0 and queue.waiting == 0


def test_a_full_line_refuses_at_once_and_a_timed_out_waiter_leaves_it():
    queue = scheduler(places=1, max_waiting=1)
    queue.admit(1, never, Drain())
    waiter = gevent.spawn(queue.admit, 0.3, never, Drain())
    in_line(queue, 1)
    started = time.monotonic()
    with pytest.raises(QueueFull):  # not Overloaded: it did not wait its 30 s
        queue.admit(30, never, Drain())
    assert time.monotonic() - started < 10
    with pytest.raises(Overloaded):
        waiter.get(timeout=10)
    assert queue.waiting == 0
    queue.release_place()
    assert queue.held_places == 0


def test_a_waiter_whose_client_left_gives_up_its_turn():
    queue = scheduler(places=1)
    queue.admit(1, never, Drain())
    gone = gevent.spawn(queue.admit, 30, lambda: True, Drain())
    staying = gevent.spawn(queue.admit, 30, never, Drain())
    with pytest.raises(ClientGone):
        gone.get(timeout=10)
    queue.release_place()
    staying.get(timeout=10)  # the place went to the one still there
    assert queue.held_places == 1 and queue.waiting == 0


def test_a_prompt_gets_the_slot_its_conversation_is_in():
    mine, other = Held(list(range(100))), Held(list(range(500, 600)))
    queue = scheduler([other, mine], places=2)
    ticket = queue.wait_for_slot(list(range(120)), "")
    assert ticket.granted.is_set() and ticket.slot is mine
    assert queue.states[mine] == "prefilling" and queue.states[other] == "idle"
    stranger = queue.wait_for_slot(list(range(120)), "another key")  # another scope shares nothing
    assert stranger.slot is other


def test_a_next_turn_waits_for_its_finishing_slot_and_others_pass_it():
    busy, empty = Held(list(range(100))), Held([])
    queue = scheduler([busy, empty], places=3)
    first = queue.wait_for_slot(list(range(90)), "")
    assert first.slot is busy
    queue.finishing(busy)  # its answer is out
    next_turn = queue.wait_for_slot(list(range(110)), "")
    assert not next_turn.granted.is_set()  # it waits for its conversation's slot
    newcomer = queue.wait_for_slot([7, 8, 9], "")
    assert newcomer.slot is empty  # behind it, but for the other slot
    queue.give_back(busy)
    assert next_turn.slot is busy


def test_a_slot_given_back_before_its_last_event_was_relayed_stays_free():
    slot = Held(list(range(100)))
    queue = scheduler([slot], places=2)
    first = queue.wait_for_slot(list(range(90)), "")
    queue.give_back(first.slot)  # its thread ended ...
    queue.finishing(slot)  # ... before the loop relayed its answer's end
    next_turn = queue.wait_for_slot(list(range(110)), "")
    assert next_turn.slot is slot


def test_slots_go_in_order_and_a_leaver_hands_on_what_it_got():
    slot = Held([])
    queue = scheduler([slot], places=4)
    holder = queue.wait_for_slot([1], "")
    tickets = [queue.wait_for_slot([i], "") for i in range(3)]
    queue.leave(tickets[0])  # gave up before its turn
    queue.give_back(holder.slot)
    assert tickets[1].slot is slot and not tickets[2].granted.is_set()
    queue.leave(tickets[1])  # granted as it gave up: the slot goes on
    assert tickets[2].slot is slot
    assert queue.waiting_for_slot == 0


def test_the_states_are_counted_in_the_metrics():
    slots = [Held([]), Held([])]
    queue = scheduler(slots, places=2)
    metrics = queue.metrics
    ticket = queue.wait_for_slot([1], "")

    def count(state: str) -> float:
        return metrics.registry.get_sample_value("kronk_slots", {"model": "m", "state": state})

    assert (count("idle"), count("prefilling")) == (1, 1)
    queue.generating(ticket.slot)
    assert (count("idle"), count("prefilling"), count("generating")) == (1, 0, 1)
    queue.finishing(ticket.slot)
    queue.generating(ticket.slot)  # no move back: the answer is out
    assert (count("generating"), count("finishing")) == (0, 1)
    queue.give_back(ticket.slot)
    assert (count("idle"), count("finishing")) == (2, 0)
    queue.finishing(ticket.slot)  # given back already: it stays idle
    assert count("idle") == 2


def test_the_line_is_one_gauge_shown_under_llama_servers_name_too():
    queue = scheduler([Held([])], places=2)  # one slot: the second request waits for it
    first = queue.wait_for_slot([1], "")
    second = queue.wait_for_slot([2], "")
    page = queue.metrics.exposition()
    assert b'kronk_requests_waiting{model="m"} 1.0' in page and b'llamacpp:requests_deferred{model="m"} 1.0' in page
    queue.give_back(first.slot)  # the second is served: the line is empty
    assert second.granted.is_set()
    page = queue.metrics.exposition()
    assert b'kronk_requests_waiting{model="m"} 0.0' in page and b'llamacpp:requests_deferred{model="m"} 0.0' in page


def test_slots_added_serve_the_line_and_their_places_admit_waiters_at_once():
    first = Held([])
    queue = scheduler([first], places=1)
    queue.admit(1, never, Drain())
    waiter = gevent.spawn(queue.admit, 30, never, Drain())
    in_line(queue, 1)
    holder = queue.wait_for_slot([1], "")
    blocked = queue.wait_for_slot([2], "")
    assert holder.slot is first and not blocked.granted.is_set()
    added = Held([])
    queue.add_slots([added], places=1)
    waiter.get(timeout=10)  # the new place went to the waiter
    assert blocked.slot is added and queue.slots == (first, added) and queue.held_places == 2


def test_a_retired_slot_is_never_handed_out_again_and_a_held_one_retires_when_given_back():
    free, held = Held([]), Held([])
    queue = scheduler([free, held], places=4)
    holder = queue.wait_for_slot([1], "")
    assert holder.slot is free
    other = queue.wait_for_slot([2], "")
    assert other.slot is held
    queue.give_back(free)
    queue.retire([free, held], places=2)
    assert queue.states[free] == "retired" and queue.states[held] == "prefilling"  # held: it retires later
    waiting = queue.wait_for_slot([3], "")
    queue.give_back(held)
    assert queue.states[held] == "retired" and not waiting.granted.is_set()
    assert queue.slot_count == 0 and queue.idle.is_set() and queue.places == 2
    queue.add_slots([Held([])], places=2)
    assert waiting.granted.is_set() and waiting.slot is queue.slots[2]
