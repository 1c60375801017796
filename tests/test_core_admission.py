"""The order requests wait in, and the GPU line, in the pool's decision core with a fake clock, in milliseconds.

Classes (interactive, normal, batch), first come first served within one, ageing, class
caps; backfill into free memory, eviction of idle workers (a backfilled one first, kept-warm
ones last, only a set that lets the head fit), recall of a busy backfilled lease after its
request. No process, socket or thread: events in, actions out, as the runtime would see them.
"""

from __future__ import annotations

import pytest

from resident_pool import priority
from resident_pool.server import actions as c
from resident_pool.server import events as ev
from resident_pool.server.actions import Policy, Timings
from resident_pool.server.core import PoolState
from resident_pool.server.replica import Spec
from resident_pool.server.states import ReplicaState, StopCause

R = ReplicaState
CONN = 1
KEPT_ACTIVE_S = Timings().kept_active_s  # a kept lease not heard of this long: idle between calls


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> float:
        self.now += seconds
        return self.now


@pytest.fixture
def clock():
    return Clock()


def of(actions, kind):
    return [a for a in actions if isinstance(a, kind)]


def one(actions, kind):
    found = of(actions, kind)
    assert len(found) == 1, (kind.__name__, actions)
    return found[0]


def gpu(budget: float, **kw) -> Spec:
    return Spec(budget_gb=budget, ping_interval_s=10_000, **kw)


def pool(clock, specs: dict[str, Spec], policy: Policy | None = None, **timings) -> PoolState:
    state = PoolState(Timings(**timings), clock(), policy)
    for key, spec in specs.items():
        state.handle(clock(), ev.ManifestRead(key, key, "v", "f", spec))
    return state


def ask(state: PoolState, clock: Clock, key: str, connection: int, cls: str = "normal"):
    """A request for ``key``: its ticket and what the core answered (a Start, or nothing while it waits)."""
    decision = state.handle(clock(), ev.ClientAsked(key, connection, {}, cls))
    return decision.ticket, decision.actions


def prepare(state: PoolState, clock: Clock, start: c.Start) -> list:
    return state.handle(clock(), ev.StartPrepared(start.rid, state.replicas[start.rid].budget_gb)).actions


def serve(state: PoolState, clock: Clock, place: c.Place, device: int = 0,
          room_after: float = 0.0) -> c.Grant:
    """Place ``place`` on ``device``, spawn and start it: the lease its request gets. A start still waiting
    is tried again at once (the room changed): it finds ``room_after`` GB."""
    actions = state.handle(clock(), ev.BudgetPlaced(place.rid, device, place.backfill)).actions
    spawn = one(actions, c.Spawn)
    for retry in of(actions, c.Place):
        state.handle(clock(), ev.BudgetNotPlaced(retry.rid, {device: room_after}))
    return one(state.handle(clock(), ev.WorkerStarted(spawn.rid, 4000 + spawn.rid)).actions, c.Grant)


def leased(state: PoolState, clock: Clock, key: str, connection: int, cls: str = "normal") -> c.Grant:
    """``key`` started and leased where the card has room: the grant."""
    _, actions = ask(state, clock, key, connection, cls)
    place = one(prepare(state, clock, one(actions, c.Start)), c.Place)
    return serve(state, clock, place)


# -- the order: class, first come first served, ageing, caps ---------------------------------------------------
def test_waiting_requests_are_served_by_class_then_in_arrival_order(clock):
    state = pool(clock, {"m": Spec()})
    held = state.handle(clock(), ev.ClientAsked("m", 99, {})).actions
    held = one(state.handle(clock(), ev.WorkerStarted(one(held, c.Start).rid, 1)).actions, c.Grant)
    tickets = {}
    for connection, cls in ((1, "batch"), (2, "normal"), (3, "interactive"), (4, "normal"), (5, "interactive")):
        clock.advance(0.001)
        tickets[connection] = ask(state, clock, "m", connection, cls)[0]
    served, lease, connection = [], held.lease, 99
    for _ in range(5):
        grant = one(state.handle(clock(), ev.LeaseReleased(lease, connection, "ok")).actions, c.Grant)
        served.append(grant.ticket)
        connection = next(conn for conn, t in tickets.items() if t == grant.ticket)
        lease = grant.lease
    assert served == [tickets[3], tickets[5], tickets[2], tickets[4], tickets[1]]


def test_a_batch_request_ages_one_class_per_aging_s_so_it_is_never_starved(clock):
    state = pool(clock, {"m": Spec()}, Policy(aging_s=0.5))  # 500 ms per class
    held = one(state.handle(clock(), ev.WorkerStarted(one(state.handle(clock(), ev.ClientAsked("m", 99, {})).actions, c.Start).rid, 1)).actions, c.Grant)
    batch, _ = ask(state, clock, "m", 1, "batch")
    clock.advance(0.499)
    assert of(state.handle(clock(), ev.Tick()).actions, c.Announce) == []
    clock.advance(0.002)
    (aged,) = of(state.handle(clock(), ev.Tick()).actions, c.Announce)
    assert aged.event == "request.aged" and dict(aged.fields)["ranks_as"] == "normal"
    clock.advance(0.5)
    (aged,) = of(state.handle(clock(), ev.Tick()).actions, c.Announce)
    assert dict(aged.fields)["ranks_as"] == "interactive"
    interactive, _ = ask(state, clock, "m", 2, "interactive")  # a fresh interactive one comes after it now
    grant = one(state.handle(clock(), ev.LeaseReleased(held.lease, 99, "ok")).actions, c.Grant)
    assert grant.ticket == batch and interactive in state.tickets
    assert of(state.handle(clock(), ev.Tick()).actions, c.Announce) == []  # each rise is announced once


def test_without_ageing_a_batch_request_waits_behind_every_later_interactive_one(clock):
    state = pool(clock, {"m": Spec()}, Policy(aging_s=0))
    held = one(state.handle(clock(), ev.WorkerStarted(one(state.handle(clock(), ev.ClientAsked("m", 99, {})).actions, c.Start).rid, 1)).actions, c.Grant)
    ask(state, clock, "m", 1, "batch")
    clock.advance(3600)
    later, _ = ask(state, clock, "m", 2, "interactive")
    assert one(state.handle(clock(), ev.LeaseReleased(held.lease, 99, "ok")).actions, c.Grant).ticket == later


def test_a_class_this_pool_may_not_claim_is_capped_to_the_highest_it_may(clock):
    state = pool(clock, {"m": Spec()}, Policy(classes=("normal", "batch")))
    held = one(state.handle(clock(), ev.WorkerStarted(one(state.handle(clock(), ev.ClientAsked("m", 99, {})).actions, c.Start).rid, 1)).actions, c.Grant)
    normal, _ = ask(state, clock, "m", 1, "normal")
    clock.advance(0.001)
    claimed, _ = ask(state, clock, "m", 2, "interactive")
    ticket = state.tickets[claimed]
    assert (ticket.asked, ticket.priority) == ("interactive", "normal")
    assert one(state.handle(clock(), ev.LeaseReleased(held.lease, 99, "ok")).actions, c.Grant).ticket == normal  # no jumping the line
    waiting = state.view(clock()).providers["m"].waiting
    assert [(w.asked, w.priority) for w in waiting] == [("interactive", "normal")]


def test_the_order_is_one_pure_function_shared_with_the_host_service():
    items = [("batch", 0.0), ("normal", 1.0), ("interactive", 2.0), ("normal", 0.5)]
    ordered = priority.in_order(items, 3.0, 0.0, lambda i: i[0], lambda i: i[1])
    assert ordered == [("interactive", 2.0), ("normal", 0.5), ("normal", 1.0), ("batch", 0.0)]
    assert priority.in_order(items, 1000.0, 300.0, lambda i: i[0], lambda i: i[1])[0] == ("batch", 0.0)
    assert priority.cap("interactive", ("normal", "batch")) == "normal"
    assert priority.cap("batch", ("interactive",)) == "interactive"


# -- the GPU line: the head, backfill, eviction, recall --------------------------------------------------------
def head_of_line(clock, policy: Policy | None = None):
    """The issue's case on a 9.5 GB card: ``big`` (8) leased, ``big2`` (8) waiting; ``small`` (1) asks."""
    state = pool(clock, {"big": gpu(8), "big2": gpu(8), "small": gpu(1)}, policy)
    big = leased(state, clock, "big", 1)
    _, actions = ask(state, clock, "big2", 2)
    place = one(prepare(state, clock, one(actions, c.Start)), c.Place)
    assert place.backfill is False
    assert state.handle(clock(), ev.BudgetNotPlaced(place.rid, {0: 1.5})).actions == []  # nothing idle to evict, nobody to backfill
    clock.advance(3)
    return state, big, place.rid


def test_a_small_request_that_fits_now_is_backfilled_ahead_of_a_head_that_does_not(clock):
    state, _big, big2 = head_of_line(clock)
    _, actions = ask(state, clock, "small", 3)
    place = one(prepare(state, clock, one(actions, c.Start)), c.Place)
    assert place.backfill and place.rid != big2
    actions = state.handle(clock(), ev.BudgetPlaced(place.rid, 0, place.backfill)).actions
    announced = one(actions, c.Announce)
    assert announced.event == "admission.backfilled" and dict(announced.fields)["ahead_of"] == "big2"
    grant = one(state.handle(clock(), ev.WorkerStarted(one(actions, c.Spawn).rid, 7)).actions, c.Grant)
    assert state.leases[grant.lease].backfilled and state.replicas[grant.rid].backfilled
    assert [entry.key for entry in state.view(clock()).gpu_line] == ["big2"]


def test_with_backfill_off_the_small_request_waits_behind_the_head(clock):
    state, _big, _ = head_of_line(clock, Policy(backfill=False))
    _, actions = ask(state, clock, "small", 3)
    assert of(prepare(state, clock, one(actions, c.Start)), c.Place) == []
    assert [entry.key for entry in state.view(clock()).gpu_line] == ["big2", "small"]


def test_when_the_head_could_start_an_idle_worker_is_evicted_and_the_backfilled_busy_one_is_left_alone(clock):
    state, big, big2 = head_of_line(clock)
    small = serve(state, clock, one(prepare(state, clock, one(ask(state, clock, "small", 3)[1], c.Start)), c.Place))
    actions = state.handle(clock(), ev.LeaseReleased(big.lease, 1, "ok")).actions  # big idle: its 8 GB and the 0.5 left fit big2
    stop = one(actions, c.Stop)
    assert stop.rid == big.rid and stop.cause is StopCause.EVICTED and of(actions, c.Recall) == []
    assert state.replicas[small.rid].state is R.LEASED
    place = one(state.handle(clock(), ev.WorkerStopped(big.rid)).actions, c.Place)  # its budget goes back: the head tries at once
    assert place.rid == big2 and not place.backfill


def test_a_busy_backfilled_lease_is_recalled_after_its_request_when_only_its_memory_lets_the_head_start(clock):
    state = pool(clock, {"big": gpu(8), "big2": gpu(8), "small": gpu(2)})
    big = leased(state, clock, "big", 1)
    big2 = one(prepare(state, clock, one(ask(state, clock, "big2", 2)[1], c.Start)), c.Place)
    state.handle(clock(), ev.BudgetNotPlaced(big2.rid, {0: 2.0}))  # a 10 GB card: 8 held, 2 free
    small = serve(state, clock, one(prepare(state, clock, one(ask(state, clock, "small", 3)[1], c.Start)), c.Place))
    assert state.replicas[small.rid].backfilled
    state.handle(clock(), ev.MemoryFreed())
    state.handle(clock(), ev.BudgetNotPlaced(big2.rid, {0: 0.0}))
    actions = state.handle(clock(), ev.LeaseReleased(big.lease, 1, "ok")).actions
    # big's 8 GB alone would do on the empty card, but small took the 2 GB beside it: big is evicted at once,
    # and small's lease recalled; it finishes the request it runs
    assert one(actions, c.Stop).rid == big.rid
    assert of(actions, c.Recall) == []  # 0 + 8 = 8: enough without small
    assert one(state.handle(clock(), ev.WorkerStopped(big.rid)).actions, c.Place).rid == big2.rid
    actions = state.handle(clock(), ev.BudgetNotPlaced(big2.rid, {0: 6.0})).actions  # another pool took 2 GB meanwhile: 6 + small's 2
    recall = one(actions, c.Recall)
    assert recall.lease == small.lease and "big2" in recall.why
    assert state.replicas[small.rid].state is R.LEASED  # its request runs on: the recall waits for it
    assert one(actions, c.Announce).event == "admission.recalled"
    assert of(state.handle(clock(), ev.Tick()).actions, c.Recall) == []  # told once
    actions = state.handle(clock(), ev.LeaseReleased(small.lease, 3, "ok")).actions  # the client gives it back after its request
    assert one(actions, c.Stop).rid == small.rid and state.replicas[small.rid].state is R.STOPPING
    _, actions = ask(state, clock, "small", 3)  # its next request queues again in its own class: behind big2
    prepare(state, clock, one(actions, c.Start))
    assert [entry.key for entry in state.view(clock()).gpu_line] == ["big2", "small"]
    assert one(state.handle(clock(), ev.WorkerStopped(small.rid)).actions, c.Place).rid == big2.rid


def test_a_backfilled_sessions_lease_is_asked_of_its_worker_too_so_an_idle_session_gives_its_memory_at_once(clock):
    """Review r25: told only to its client, a backfilled session that sits idle between requests (a notebook) held
    the head's memory until its admission timeout. Its worker is asked too (it answers once any request in flight
    is over: at once when idle), and the client is still told, so its next request acquires again."""
    state = pool(clock, {"big": gpu(8), "big2": gpu(9.5), "small": gpu(1)})
    big = leased(state, clock, "big", 1)
    big2 = one(prepare(state, clock, one(ask(state, clock, "big2", 2)[1], c.Start)), c.Place)
    state.handle(clock(), ev.BudgetNotPlaced(big2.rid, {0: 2.0}))  # a 10 GB card: 8 held, 2 free
    _, actions = ask(state, clock, "small", 3)
    place = one(prepare(state, clock, one(actions, c.Start)), c.Place)
    spawn = one(state.handle(clock(), ev.BudgetPlaced(place.rid, 0, place.backfill)).actions, c.Spawn)
    small = one(state.handle(clock(), ev.WorkerStarted(spawn.rid, 4000 + spawn.rid, True)).actions, c.Grant)  # its worker answers recall
    assert state.leases[small.lease].backfilled
    state.handle(clock(), ev.BudgetNotPlaced(big2.rid, {0: 1.0}))
    actions = state.handle(clock(), ev.LeaseReleased(big.lease, 1, "ok")).actions  # big idle: 1 free + big's 8 + small's 1 = 9.5
    assert one(actions, c.Stop).rid == big.rid
    recall = one(actions, c.Recall)
    assert (recall.lease, recall.worker, recall.client) == (small.lease, True, True)  # its worker, and its client
    assert state.replicas[small.rid].deadline is not None  # a worker that never answers is overdue, not waited for
    # the worker answers at once (no request in flight): the lease ends and small is evicted for big2
    stop = one(state.handle(clock(), ev.LeaseRecalled(small.lease, idle_s=5.0, served=1)).actions, c.Stop)
    assert stop.rid == small.rid and stop.cause is StopCause.EVICTED
    assert small.lease not in state.leases
    assert state.handle(clock(), ev.LeaseReleased(small.lease, 3, "ok")).actions == []  # the client's own give-back then finds nothing


def test_a_backfilled_lease_on_a_worker_that_cannot_answer_recall_is_asked_of_its_client_only(clock):
    state = pool(clock, {"big": gpu(8), "big2": gpu(8), "small": gpu(2)})
    big = leased(state, clock, "big", 1)
    big2 = one(prepare(state, clock, one(ask(state, clock, "big2", 2)[1], c.Start)), c.Place)
    state.handle(clock(), ev.BudgetNotPlaced(big2.rid, {0: 2.0}))
    small = serve(state, clock, one(prepare(state, clock, one(ask(state, clock, "small", 3)[1], c.Start)), c.Place))
    state.handle(clock(), ev.MemoryFreed())
    state.handle(clock(), ev.BudgetNotPlaced(big2.rid, {0: 0.0}))
    state.handle(clock(), ev.LeaseReleased(big.lease, 1, "ok"))
    recall = one(state.handle(clock(), ev.BudgetNotPlaced(one(state.handle(clock(), ev.WorkerStopped(big.rid)).actions, c.Place).rid, {0: 6.0})).actions, c.Recall)
    assert (recall.lease, recall.worker, recall.client) == (small.lease, False, True)


def test_an_idle_backfilled_worker_is_evicted_first(clock):
    state = pool(clock, {"old": gpu(2), "small": gpu(2), "big": gpu(5), "head": gpu(5)})
    old = leased(state, clock, "old", 1)
    state.handle(clock(), ev.LeaseReleased(old.lease, 1, "ok"))  # idle, and the least recently used
    clock.advance(1)
    big = leased(state, clock, "big", 2)
    head = one(prepare(state, clock, one(ask(state, clock, "head", 3)[1], c.Start)), c.Place)
    assert of(state.handle(clock(), ev.BudgetNotPlaced(head.rid, {0: 2.0})).actions, c.Stop) == []  # 2 + old's 2 < 5: nothing evicted
    small = serve(state, clock, one(prepare(state, clock, one(ask(state, clock, "small", 4)[1], c.Start)), c.Place))
    state.handle(clock(), ev.LeaseReleased(small.lease, 4, "ok"))  # idle now, used after old, but backfilled
    retry = one(state.handle(clock(), ev.MemoryFreed()).actions, c.Place)  # someone outside let go of 3 GB
    actions = state.handle(clock(), ev.BudgetNotPlaced(retry.rid, {0: 3.0})).actions
    assert [s.rid for s in of(actions, c.Stop)] == [small.rid]  # either would do: the backfilled one goes
    assert state.replicas[old.rid].state is R.READY and state.replicas[big.rid].state is R.LEASED
    recalled = one(actions, c.Announce)
    assert recalled.event == "admission.recalled" and dict(recalled.fields)["idle"] is True


def test_the_fewest_workers_that_let_the_head_fit_are_evicted(clock):
    state = pool(clock, {"a": gpu(2), "b": gpu(2), "big": gpu(6), "head": gpu(6)})
    for key, connection in (("a", 1), ("b", 2), ("big", 3)):
        grant = leased(state, clock, key, connection)
        state.handle(clock(), ev.LeaseReleased(grant.lease, connection, "ok"))
        clock.advance(1)
    head = one(prepare(state, clock, one(ask(state, clock, "head", 4)[1], c.Start)), c.Place)
    actions = state.handle(clock(), ev.BudgetNotPlaced(head.rid, {0: 0.0})).actions
    # least recently used first would take a, b and big; big alone is enough, so a and b stay warm
    assert [s.rid for s in of(actions, c.Stop)] == [state.replicas[r].rid for r in state.replicas
                                                    if state.replicas[r].key == "big"]


def test_idle_workers_are_evicted_least_recently_used_first_and_never_for_nothing(clock):
    state = pool(clock, {"a": gpu(4), "b": gpu(4), "c": gpu(4), "d": gpu(4), "e": gpu(9)})
    a = leased(state, clock, "a", 1)
    clock.advance(1)
    b = leased(state, clock, "b", 2)
    clock.advance(1)
    c_ = leased(state, clock, "c", 3)
    state.handle(clock(), ev.LeaseReleased(b.lease, 2, "ok"))
    clock.advance(1)
    state.handle(clock(), ev.LeaseReleased(a.lease, 1, "ok"))
    d = one(prepare(state, clock, one(ask(state, clock, "d", 4)[1], c.Start)), c.Place)
    actions = state.handle(clock(), ev.BudgetNotPlaced(d.rid, {0: 0.0})).actions
    assert [s.rid for s in of(actions, c.Stop)] == [b.rid]  # b was used least recently; one is enough
    assert state.replicas[c_.rid].state is R.LEASED
    serve(state, clock, one(state.handle(clock(), ev.WorkerStopped(b.rid)).actions, c.Place))
    e = one(prepare(state, clock, one(ask(state, clock, "e", 5)[1], c.Start)), c.Place)
    actions = state.handle(clock(), ev.BudgetNotPlaced(e.rid, {0: 0.0})).actions
    assert of(actions, c.Stop) == []  # a (4) alone is idle: 4 of the 9 needed; nothing is evicted for nothing


def test_a_kept_warm_worker_goes_last_and_only_when_that_lets_the_head_fit(clock):
    state = pool(clock, {"kept": gpu(4, min_replicas=1), "other": gpu(4), "seven": gpu(7)})
    kept = leased(state, clock, "kept", 1)
    state.handle(clock(), ev.LeaseReleased(kept.lease, 1, "ok"))
    clock.advance(1)
    other = leased(state, clock, "other", 2)
    state.handle(clock(), ev.LeaseReleased(other.lease, 2, "ok"))  # used after kept, but not kept warm: it goes first
    seven = one(prepare(state, clock, one(ask(state, clock, "seven", 3)[1], c.Start)), c.Place)
    actions = state.handle(clock(), ev.BudgetNotPlaced(seven.rid, {0: -2.0})).actions  # memory held outside: even both give only 6
    assert of(actions, c.Stop) == []  # nothing is evicted for nothing
    state.handle(clock(), ev.MemoryFreed())
    actions = state.handle(clock(), ev.BudgetNotPlaced(seven.rid, {0: 3.0})).actions
    assert [s.rid for s in of(actions, c.Stop)] == [other.rid]  # 3 + 4: the kept-warm one stays
    retry = one(state.handle(clock(), ev.WorkerStopped(other.rid)).actions, c.Place)
    actions = state.handle(clock(), ev.BudgetNotPlaced(retry.rid, {0: 3.0})).actions  # someone outside took other's 4 GB meanwhile
    assert [s.rid for s in of(actions, c.Stop)] == [kept.rid]  # now only the kept-warm one lets it fit


def test_a_backfill_never_takes_the_memory_the_head_is_about_to_get(clock):
    state = pool(clock, {"idle": gpu(4), "head": gpu(6), "fill": gpu(2)})
    idle = leased(state, clock, "idle", 1)
    state.handle(clock(), ev.LeaseReleased(idle.lease, 1, "ok"))
    head = one(prepare(state, clock, one(ask(state, clock, "head", 2)[1], c.Start)), c.Place)
    actions = state.handle(clock(), ev.BudgetNotPlaced(head.rid, {0: 3.0})).actions  # 3 free + 4 idle = 7: evict idle for the head
    assert one(actions, c.Stop).rid == idle.rid
    _, actions = ask(state, clock, "fill", 3)
    # 2 GB fit in the 3 free now, but the head needs 6 of the 3 + 4 coming back: only 1 is spare
    assert of(prepare(state, clock, one(actions, c.Start)), c.Place) == []


def test_a_wait_for_memory_ends_after_admission_timeout_s(clock):
    state = pool(clock, {"a": gpu(8), "b": gpu(8, admission_timeout_s=2)})
    leased(state, clock, "a", 1)
    b = one(prepare(state, clock, one(ask(state, clock, "b", 2)[1], c.Start)), c.Place)
    state.handle(clock(), ev.BudgetNotPlaced(b.rid, {0: 1.5}))
    clock.advance(1.999)
    actions = state.handle(clock(), ev.Tick()).actions
    assert of(actions, c.Withdraw) == []
    state.handle(clock(), ev.BudgetNotPlaced(one(actions, c.Place).rid, {0: 1.5}))  # read again (poll_s): still no room
    clock.advance(0.002)
    withdraw = one(state.handle(clock(), ev.Tick()).actions, c.Withdraw)
    assert (withdraw.rid, withdraw.reason) == (b.rid, "admission_timeout") and withdraw.waited_s >= 2


def test_the_room_is_read_again_every_poll_s_and_a_try_is_never_repeated_without_a_new_reading(clock):
    state = pool(clock, {"a": gpu(8), "b": gpu(8)}, Policy(poll_s=0.25))
    leased(state, clock, "a", 1)
    b = one(prepare(state, clock, one(ask(state, clock, "b", 2)[1], c.Start)), c.Place)
    assert of(state.handle(clock(), ev.BudgetNotPlaced(b.rid, {0: 9.0})).actions, c.Place) == []  # the reading said room, the try did not
    assert of(state.handle(clock(), ev.Tick()).actions, c.Place) == []
    clock.advance(0.25)
    assert one(state.handle(clock(), ev.Tick()).actions, c.Place).rid == b.rid  # memory freed outside the pool is seen


def test_a_warm_up_never_waits_behind_or_ahead_of_a_request_waiting_for_memory(clock):
    state = pool(clock, {"a": gpu(8), "b": gpu(8), "w": gpu(1, min_replicas=1)}, keep_warm_s=1)
    leased(state, clock, "a", 1)
    b = one(prepare(state, clock, one(ask(state, clock, "b", 2)[1], c.Start)), c.Place)
    state.handle(clock(), ev.BudgetNotPlaced(b.rid, {0: 1.5}))
    rids = list(state.handle(clock(), ev.WarmAsked("w", 1, wait=False)).replicas)
    withdraw = one(state.handle(clock(), ev.StartPrepared(rids[0], 1.0, None, False)).actions, c.Withdraw)
    assert withdraw.reason == "no_room"


def test_a_client_gone_while_its_start_waits_for_memory_ends_that_wait(clock):
    state = pool(clock, {"a": gpu(8), "b": gpu(8)})
    leased(state, clock, "a", 1)
    ticket, actions = ask(state, clock, "b", 2)
    b = one(prepare(state, clock, one(actions, c.Start)), c.Place)
    state.handle(clock(), ev.BudgetNotPlaced(b.rid, {0: 1.5}))
    withdraw = one(state.handle(clock(), ev.TicketGone(ticket)).actions, c.Withdraw)
    assert (withdraw.rid, withdraw.reason) == (b.rid, "start_cancelled")
    assert state.view(clock()).gpu_line == ()


def test_the_gpu_line_is_ordered_by_class_and_the_head_is_tried_first(clock):
    state = pool(clock, {"a": gpu(8), "n": gpu(6), "i": gpu(6)})
    leased(state, clock, "a", 1)
    n = one(prepare(state, clock, one(ask(state, clock, "n", 2, "normal")[1], c.Start)), c.Place)
    state.handle(clock(), ev.BudgetNotPlaced(n.rid, {0: 1.5}))
    clock.advance(0.01)
    _, actions = ask(state, clock, "i", 3, "interactive")
    assert of(prepare(state, clock, one(actions, c.Start)), c.Place) == []  # it does not fit either
    line = state.view(clock()).gpu_line
    assert [(e.key, e.priority, e.position) for e in line] == [("i", "interactive", 0), ("n", "normal", 1)]
    place = one(state.handle(clock(), ev.MemoryFreed()).actions, c.Place)
    assert state.replicas[place.rid].key == "i"


def test_the_host_service_recalls_an_idle_backfilled_worker_at_once_and_a_busy_one_after_its_request(clock):
    state = pool(clock, {"a": gpu(8), "b": gpu(8), "s": gpu(1), "t": gpu(1)})
    leased(state, clock, "a", 1)
    b = one(prepare(state, clock, one(ask(state, clock, "b", 2)[1], c.Start)), c.Place)
    state.handle(clock(), ev.BudgetNotPlaced(b.rid, {0: 1.5}))
    s = serve(state, clock, one(prepare(state, clock, one(ask(state, clock, "s", 3)[1], c.Start)), c.Place),
              room_after=1.0)
    state.handle(clock(), ev.LeaseReleased(s.lease, 3, "ok"))
    t = serve(state, clock, one(prepare(state, clock, one(ask(state, clock, "t", 4)[1], c.Start)), c.Place))
    stop = one(state.handle(clock(), ev.HostRecall(s.rid, "bob's interactive request")).actions, c.Stop)
    assert stop.cause is StopCause.EVICTED and "bob's interactive request" in stop.why
    assert one(state.handle(clock(), ev.HostRecall(t.rid, "bob's interactive request")).actions, c.Recall).lease == t.lease


def test_a_free_worker_goes_to_whoever_ranks_first_across_the_lines_not_to_its_own_providers_queue(clock):
    """A campaign (batch) keeps the card full and its next request already waits for a worker; an interactive
    start waits for memory. When a campaign worker frees, its memory goes to the interactive start."""
    state = pool(clock, {"camp": gpu(4, max_replicas=3), "inter": gpu(3)})
    grants = [leased(state, clock, "camp", n, "batch") for n in (1, 2)]
    _, actions = ask(state, clock, "camp", 3, "batch")  # a third worker would not fit: it waits for memory
    third = one(prepare(state, clock, one(actions, c.Start)), c.Place)
    state.handle(clock(), ev.BudgetNotPlaced(third.rid, {0: 2.0}))
    clock.advance(0.01)
    _, actions = ask(state, clock, "inter", 4, "interactive")
    assert of(prepare(state, clock, one(actions, c.Start)), c.Place) == []  # tried first is the head: no room
    actions = state.handle(clock(), ev.LeaseReleased(grants[0].lease, 1, "ok")).actions
    assert of(actions, c.Grant) == []  # not to the waiting batch request
    assert one(actions, c.Stop).rid == grants[0].rid  # evicted for the interactive one


def test_with_every_request_in_one_class_the_oldest_waiting_request_gets_the_free_worker(clock):
    state = pool(clock, {"camp": gpu(4, max_replicas=3), "inter": gpu(3)})
    grants = [leased(state, clock, "camp", n) for n in (1, 2)]
    ticket, actions = ask(state, clock, "camp", 3)
    third = one(prepare(state, clock, one(actions, c.Start)), c.Place)
    state.handle(clock(), ev.BudgetNotPlaced(third.rid, {0: 2.0}))
    clock.advance(0.01)
    _, actions = ask(state, clock, "inter", 4)
    prepare(state, clock, one(actions, c.Start))
    grant = one(state.handle(clock(), ev.LeaseReleased(grants[0].lease, 1, "ok")).actions, c.Grant)
    assert grant.ticket == ticket  # it asked first


def test_a_lease_granted_without_the_backfilled_mark_is_never_recalled_whoever_asks(clock):
    state = pool(clock, {"a": gpu(4)})
    grant = leased(state, clock, "a", 1)
    assert not state.leases[grant.lease].backfilled
    assert state.handle(clock(), ev.HostRecall(grant.rid, "the host service asks")).actions == []  # a stale or wrong recall: nothing
    assert state.replicas[grant.rid].state is R.LEASED


# -- the GPU line and Pool.predict's kept lease: one rule for taking a lease back ------------------------------
def kept_lease(state: PoolState, clock: Clock, key: str, connection: int) -> c.Grant:
    """``key`` started and leased as Pool.predict keeps it (its worker answers ``recall``)."""
    actions = state.handle(clock(), ev.ClientAsked(key, connection, {}, keep=True)).actions
    place = one(prepare(state, clock, one(actions, c.Start)), c.Place)
    spawn = one(state.handle(clock(), ev.BudgetPlaced(place.rid, 0)).actions, c.Spawn)
    grant = one(state.handle(clock(), ev.WorkerStarted(spawn.rid, 4000 + spawn.rid, True)).actions, c.Grant)
    assert grant.kept
    return grant


def test_the_gpu_line_takes_an_idle_kept_lease_back_from_its_worker_then_evicts_it_after_a_ready_worker(clock):
    state = pool(clock, {"k": gpu(4), "r": gpu(4), "head": gpu(8)})
    kept = kept_lease(state, clock, "k", 1)
    state.handle(clock(), ev.LeaseUsed(kept.lease, 1, 1))  # it served its call, then its holder stopped calling: idle
    clock.advance(KEPT_ACTIVE_S)
    ready = leased(state, clock, "r", 2)
    state.handle(clock(), ev.LeaseReleased(ready.lease, 2, "ok"))  # used after the kept lease, but surely idle
    head = one(prepare(state, clock, one(ask(state, clock, "head", 3)[1], c.Start)), c.Place)
    actions = state.handle(clock(), ev.BudgetNotPlaced(head.rid, {0: 4.0})).actions  # 4 free + one 4 GB worker: enough
    assert [s.rid for s in of(actions, c.Stop)] == [ready.rid] and of(actions, c.Recall) == []
    actions = state.handle(clock(), ev.BudgetNotPlaced(one(state.handle(clock(), ev.WorkerStopped(ready.rid)).actions, c.Place).rid, {0: 4.0})).actions
    recall = one(actions, c.Recall)  # someone outside took 4 GB: now the kept lease gives way
    assert (recall.lease, recall.client) == (kept.lease, False)  # asked of its worker, not its client
    assert of(state.handle(clock(), ev.Tick()).actions, c.Recall) == []  # asked once
    assert one(state.handle(clock(), ev.LeaseRecalled(kept.lease, served=1)).actions, c.Stop).cause is StopCause.EVICTED


def test_the_gpu_line_leaves_a_kept_lease_just_granted_to_serve_its_one_request(clock):
    state = pool(clock, {"k": gpu(8), "head": gpu(8)})
    kept = kept_lease(state, clock, "k", 1)
    head = one(prepare(state, clock, one(ask(state, clock, "head", 2)[1], c.Start)), c.Place)
    assert of(state.handle(clock(), ev.BudgetNotPlaced(head.rid, {0: 1.5})).actions, c.Recall) == []  # not used yet
    clock.advance(0.1)
    assert of(state.handle(clock(), ev.Tick()).actions, c.Recall) == []
    assert of(state.handle(clock(), ev.LeaseUsed(kept.lease, 1, 1)).actions, c.Recall) == []  # served its call; its holder may call again
    clock.advance(KEPT_ACTIVE_S)  # it did not: idle between calls now
    retry = one(state.handle(clock(), ev.Tick()).actions, c.Place)  # the room is read again, and still short
    recall = one(state.handle(clock(), ev.BudgetNotPlaced(retry.rid, {0: 1.5})).actions, c.Recall)
    assert recall.lease == kept.lease and state.replicas[kept.rid].eviction.need_gb == 8


def test_a_kept_warm_worker_goes_after_an_idle_kept_lease_of_another_provider(clock):
    """Kept warm (min_replicas) is evicted last of all idle workers, a kept lease between calls included: the
    merged order put every ready worker, kept warm too, before any kept lease."""
    state = pool(clock, {"warm": gpu(4, min_replicas=1), "k": gpu(4), "big": gpu(6)})
    warm = leased(state, clock, "warm", 1)
    state.handle(clock(), ev.LeaseReleased(warm.lease, 1, "ok"))
    clock.advance(1)
    kept = kept_lease(state, clock, "k", 2)
    state.handle(clock(), ev.LeaseUsed(kept.lease, 2, 1))
    clock.advance(KEPT_ACTIVE_S)  # its holder stopped calling: idle between calls now
    big = one(prepare(state, clock, one(ask(state, clock, "big", 3)[1], c.Start)), c.Place)
    actions = state.handle(clock(), ev.BudgetNotPlaced(big.rid, {0: 2.0})).actions  # 2 free + one 4 GB worker: enough
    assert of(actions, c.Stop) == [] and one(actions, c.Recall).lease == kept.lease  # the kept-warm one stays
    assert state.replicas[warm.rid].state is R.READY


# -- a kept lease whose holder is still calling: evicting it costs a restart (docs/admission.md) -----------------
def _calling_holder_and_a_head(clock, head_class: str = "normal", policy: Policy | None = None):
    """``k`` (8 GB) held by a kept lease whose client calls back to back; ``head`` (8 GB) waits in ``head_class``
    on a 10 GB card with 1.5 GB free."""
    state = pool(clock, {"k": gpu(8), "head": gpu(8)}, policy)
    kept = kept_lease(state, clock, "k", 1)
    state.handle(clock(), ev.LeaseUsed(kept.lease, 1, 1))
    head = one(prepare(state, clock, one(ask(state, clock, "head", 2, head_class)[1], c.Start)), c.Place)
    first = state.handle(clock(), ev.BudgetNotPlaced(head.rid, {0: 1.5})).actions
    return state, kept, head, first


def _seconds_of_calls(state, clock, kept, seconds: float) -> list:
    """The holder calls on for ``seconds``, telling the pool once a second; the GPU line looks at each tick."""
    actions = []
    for _ in range(int(seconds / 0.25)):
        clock.advance(0.25)
        looked = state.handle(clock(), ev.LeaseUsed(kept.lease, 1, 40)).actions if clock.now % 1.0 == 0 else []
        looked += state.handle(clock(), ev.Tick()).actions
        actions += looked
        for retry in of(looked, c.Place):
            actions += state.handle(clock(), ev.BudgetNotPlaced(retry.rid, {0: 1.5})).actions
    return actions


def test_a_kept_lease_whose_holder_keeps_calling_is_not_evicted_for_a_head_of_its_class(clock):
    """The bench's "2 of 3 fit": evicting a stream's kept lease between its calls made it restart later, and the
    three streams took up to 1.61x the makespan of running two to the end, then the third."""
    state, kept, _, first = _calling_holder_and_a_head(clock)
    assert of(first, c.Recall) == []
    assert of(_seconds_of_calls(state, clock, kept, 30.0), c.Recall) == []
    clock.advance(KEPT_ACTIVE_S)  # the holder stopped calling: its worker does not stay pinned
    retry = one(state.handle(clock(), ev.Tick()).actions, c.Place)
    recall = one(state.handle(clock(), ev.BudgetNotPlaced(retry.rid, {0: 1.5})).actions, c.Recall)
    assert recall.lease == kept.lease and state.replicas[kept.rid].eviction.need_gb == 8


def test_a_head_of_a_higher_class_takes_a_calling_kept_lease(clock):
    state, kept, _, first = _calling_holder_and_a_head(clock, head_class="interactive")
    recall = one(first, c.Recall)  # its holder called a moment ago; the head outranks its class
    assert recall.lease == kept.lease
    assert one(state.handle(clock(), ev.LeaseRecalled(kept.lease, served=3)).actions, c.Stop).cause is StopCause.EVICTED


def test_a_head_that_aged_into_a_higher_class_takes_a_calling_kept_lease(clock):
    state, kept, _, _ = _calling_holder_and_a_head(clock, policy=Policy(aging_s=10.0))
    actions = _seconds_of_calls(state, clock, kept, 9.75)
    assert of(actions, c.Recall) == []  # still normal, as the lease is
    actions = _seconds_of_calls(state, clock, kept, 1.0)  # waited 10 s: it ranks as interactive now
    assert one(actions, c.Recall).lease == kept.lease


def test_a_kept_lease_running_one_long_request_is_not_evicted_though_its_holder_has_not_told_of_it(clock):
    """Its client tells the pool of calls once they return: a 60 s request is seen only on its worker's
    in-flight board, which the runtime reads at each tick."""
    state, kept, _, _ = _calling_holder_and_a_head(clock)
    for _ in range(240):
        clock.advance(0.25)
        for retry in of(state.handle(clock(), ev.Tick(in_flight={kept.rid: clock.now - 1000.0})).actions, c.Place):
            assert of(state.handle(clock(), ev.BudgetNotPlaced(retry.rid, {0: 1.5})).actions, c.Recall) == []
    clock.advance(0.25)
    retry = one(state.handle(clock(), ev.Tick(in_flight={})).actions, c.Place)  # it returned; the holder called no more
    assert one(state.handle(clock(), ev.BudgetNotPlaced(retry.rid, {0: 1.5})).actions, c.Recall).lease == kept.lease


def test_a_backfilled_kept_lease_is_taken_back_though_its_holder_keeps_calling(clock):
    """It went ahead of the head: what it took is given back as soon as the head could use it."""
    state = pool(clock, {"big": gpu(8), "big2": gpu(8), "small": gpu(2)})
    big = leased(state, clock, "big", 1)
    big2 = one(prepare(state, clock, one(ask(state, clock, "big2", 2)[1], c.Start)), c.Place)
    state.handle(clock(), ev.BudgetNotPlaced(big2.rid, {0: 2.0}))  # a 10 GB card: 8 held, 2 free
    actions = state.handle(clock(), ev.ClientAsked("small", 3, {}, keep=True)).actions
    place = one(prepare(state, clock, one(actions, c.Start)), c.Place)
    assert place.backfill
    spawn = one(state.handle(clock(), ev.BudgetPlaced(place.rid, 0, place.backfill)).actions, c.Spawn)
    small = one(state.handle(clock(), ev.WorkerStarted(spawn.rid, 4000 + spawn.rid, True)).actions, c.Grant)
    assert small.kept and state.leases[small.lease].backfilled
    clock.advance(Timings().kept_active_s / 2)
    state.handle(clock(), ev.LeaseUsed(small.lease, 3, 5))  # its holder calls on
    state.handle(clock(), ev.MemoryFreed())
    state.handle(clock(), ev.BudgetNotPlaced(big2.rid, {0: 0.0}))
    assert one(state.handle(clock(), ev.LeaseReleased(big.lease, 1, "ok")).actions, c.Stop).rid == big.rid
    actions = state.handle(clock(), ev.BudgetNotPlaced(one(state.handle(clock(), ev.WorkerStopped(big.rid)).actions, c.Place).rid, {0: 6.0})).actions
    assert one(actions, c.Recall).lease == small.lease  # 6 free + small's 2: the head starts once it is back
