"""A replica shared by several callers (a batching provider, ``max_callers`` > 1), in the decision core with a fake
clock: who gets a slot, when another replica starts, and that taking one caller's lease back, its timeout or its
going away never disturbs the others'. Events in, actions out; no process, socket or thread."""

from __future__ import annotations

import pytest

from resident_pool.server import actions as c
from resident_pool.server import events as ev
from resident_pool.server.actions import Timings
from resident_pool.server.core import PoolState
from resident_pool.server.replica import Spec
from resident_pool.server.states import ReplicaState, StopCause

R = ReplicaState
KEPT_ACTIVE_S = Timings().kept_active_s


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


def shared(clock, **spec) -> PoolState:
    """``b``: a batching provider, three callers a replica, two replicas at most (unless ``spec`` says)."""
    state = PoolState(Timings(), clock())
    fields = {"max_callers": 3, "max_replicas": 2, "ping_interval_s": 10_000, **spec}
    state.handle(clock(), ev.ManifestRead("b", "b", "v", "f", Spec(**fields)))
    return state


def ask(state, clock, connection: int, keep: bool = False) -> ev.Decision:
    return state.handle(clock(), ev.ClientAsked("b", connection, {}, keep=keep))


def started(state, clock, actions) -> c.Grant:
    """The replica ``actions`` start answers its first ping: the grant its request gets."""
    start = one(actions, c.Start)
    return one(state.handle(clock(), ev.WorkerStarted(start.rid, 4000 + start.rid, True)).actions, c.Grant)


def test_callers_share_one_replica_up_to_max_callers_before_another_starts(clock):
    state = shared(clock)
    first = started(state, clock, ask(state, clock, 1).actions)
    grants = [one(ask(state, clock, n).actions, c.Grant) for n in (2, 3)]
    assert {g.rid for g in grants} == {first.rid} and not any(g.cold for g in grants)  # only the first is cold
    assert state.replicas[first.rid].state is R.LEASED and len(state.replicas[first.rid].holds) == 3
    fourth = ask(state, clock, 4).actions
    assert of(fourth, c.Grant) == [] and one(fourth, c.Start).rid != first.rid  # full: a second replica starts
    view = state.view(clock())
    assert [len(r.leases) for r in view.replicas] == [3, 0] and view.replicas[0].max_callers == 3


def test_a_provider_without_batching_still_gives_each_caller_a_replica_of_its_own(clock):
    state = shared(clock, max_callers=1)
    first = started(state, clock, ask(state, clock, 1).actions)
    second = ask(state, clock, 2).actions
    assert of(second, c.Grant) == [] and one(second, c.Start).rid != first.rid


def test_a_new_caller_gets_the_replica_with_the_fewest_callers(clock):
    state = shared(clock)
    a = started(state, clock, ask(state, clock, 1).actions)
    for n in (2, 3):
        one(ask(state, clock, n).actions, c.Grant)
    b = started(state, clock, ask(state, clock, 4).actions)
    state.handle(clock(), ev.LeaseReleased(a.lease, 1, "ok"))  # a: 2 callers, b: 1
    assert one(ask(state, clock, 5).actions, c.Grant).rid == b.rid


def test_a_full_replica_of_kept_leases_gives_one_slot_back_for_a_waiting_client_and_the_rest_serve_on(clock):
    state = shared(clock, max_replicas=1)
    kept = [started(state, clock, ask(state, clock, 1, keep=True).actions)]
    kept += [one(ask(state, clock, n, keep=True).actions, c.Grant) for n in (2, 3)]
    for n, grant in enumerate(kept, start=1):
        clock.advance(0.5)
        state.handle(clock(), ev.LeaseUsed(grant.lease, n, 1))  # each served its first call; 1 the longest ago
    clock.advance(KEPT_ACTIVE_S)
    recall = one(ask(state, clock, 9).actions, c.Recall)
    assert recall.lease == kept[0].lease  # the one used least recently, only
    rid = kept[0].rid
    assert len(state.replicas[rid].holds) == 3 and state.replicas[rid].recalling
    grant = one(state.handle(clock(), ev.LeaseRecalled(kept[0].lease, 0.5, 1)).actions, c.Grant)
    assert grant.rid == rid and sorted(state.replicas[rid].holds) == sorted([kept[1].lease, kept[2].lease, grant.lease])


def test_an_idle_shared_replica_is_evicted_only_once_every_callers_lease_is_back(clock):
    state = PoolState(Timings(), clock())
    state.handle(clock(), ev.ManifestRead("b", "b", "v", "f", Spec(max_callers=2, budget_gb=6, ping_interval_s=10_000)))
    state.handle(clock(), ev.ManifestRead("g", "g", "v", "f", Spec(budget_gb=6, ping_interval_s=10_000)))
    start = one(ask(state, clock, 1, keep=True).actions, c.Start)
    one(state.handle(clock(), ev.StartPrepared(start.rid, 6)).actions, c.Place)
    one(state.handle(clock(), ev.BudgetPlaced(start.rid, 0)).actions, c.Spawn)
    first = one(state.handle(clock(), ev.WorkerStarted(start.rid, 1, True)).actions, c.Grant)
    second = one(ask(state, clock, 2, keep=True).actions, c.Grant)
    clock.advance(KEPT_ACTIVE_S)  # both holders stopped calling
    gpu = one(state.handle(clock(), ev.ClientAsked("g", 3, {})).actions, c.Start)
    place = one(state.handle(clock(), ev.StartPrepared(gpu.rid, 6)).actions, c.Place)
    recalls = of(state.handle(clock(), ev.BudgetNotPlaced(place.rid, {0: 4.0})).actions, c.Recall)
    assert sorted(r.lease for r in recalls) == sorted([first.lease, second.lease])
    assert of(state.handle(clock(), ev.LeaseRecalled(first.lease, 3.0, 0)).actions, c.Stop) == []  # one still out
    stop = one(state.handle(clock(), ev.LeaseRecalled(second.lease, 3.0, 0)).actions, c.Stop)
    assert stop.cause is StopCause.EVICTED and stop.rid == first.rid


def test_a_callers_timeout_in_a_shared_queue_costs_only_its_slot_but_a_model_call_past_the_limit_stops_it(clock):
    state = shared(clock, request_timeout_s=60)
    a = started(state, clock, ask(state, clock, 1).actions)
    b = one(ask(state, clock, 2).actions, c.Grant)
    clock.advance(61)
    # Its current model call began 5 s ago: a waits in the queue past the limit.
    assert of(state.handle(clock(), ev.LeaseReleased(a.lease, 1, "timeout", in_flight_s=5.0)).actions, c.Stop) == []
    assert state.replicas[a.rid].state is R.LEASED and list(state.replicas[a.rid].holds) == [b.lease]
    clock.advance(60)
    # One model call has run past request_timeout_s.
    stop = one(state.handle(clock(), ev.LeaseReleased(b.lease, 2, "timeout", in_flight_s=65.0)).actions, c.Stop)
    assert stop.cause is StopCause.TIMEOUT and stop.kill


def test_a_timeout_is_judged_by_the_model_calls_age_when_it_came_not_by_the_last_ticks(clock):
    """The last tick saw a long model call (another caller's, since answered); the timed-out caller's own model
    call began a moment ago. The release carries the age measured then: the worker is not stopped."""
    state = shared(clock, request_timeout_s=4)
    a = started(state, clock, ask(state, clock, 1).actions)
    b = one(ask(state, clock, 2).actions, c.Grant)
    clock.advance(3.5)
    state.handle(clock(), ev.Tick(in_flight={a.rid: 3.5}))  # b's model call, 3.5 s old
    clock.advance(1.0)  # b answered; a's own model call began 0.5 s ago (the tick's figure would say 4.5 s)
    released = state.handle(clock(), ev.LeaseReleased(a.lease, 1, "timeout", in_flight_s=0.5))
    assert of(released.actions, c.Stop) == [] and list(state.replicas[a.rid].holds) == [b.lease]
    stop = one(state.handle(clock(), ev.LeaseReleased(b.lease, 2, "timeout", in_flight_s=4.5)).actions, c.Stop)
    assert stop.cause is StopCause.TIMEOUT


def test_a_caller_gone_mid_batch_frees_its_slot_and_never_drains_the_others(clock):
    state = shared(clock)
    a = started(state, clock, ask(state, clock, 1).actions)
    b = one(ask(state, clock, 2).actions, c.Grant)
    actions = state.handle(clock(), ev.ConnectionClosed(1)).actions
    assert of(actions, c.Ping) == [] and state.replicas[a.rid].state is R.LEASED  # no drain: b's items run on
    assert list(state.replicas[a.rid].holds) == [b.lease]
    state.handle(clock(), ev.LeaseReleased(b.lease, 2, "ok"))
    assert state.replicas[a.rid].state is R.READY


def test_a_new_version_takes_kept_callers_back_lets_sessions_finish_and_stops_after_the_last(clock):
    state = shared(clock)
    session = started(state, clock, ask(state, clock, 1).actions)
    kept = one(ask(state, clock, 2, keep=True).actions, c.Grant)
    actions = state.handle(clock(), ev.ManifestRead("b", "b", "v2", "f2", Spec(max_callers=3, max_replicas=2,
                                                                              ping_interval_s=10_000))).actions
    assert one(actions, c.Recall).lease == kept.lease and state.replicas[session.rid].state is R.DRAINING
    assert of(state.handle(clock(), ev.LeaseRecalled(kept.lease)).actions, c.Stop) == []  # the session's runs on
    stop = one(state.handle(clock(), ev.LeaseReleased(session.lease, 1, "ok")).actions, c.Stop)
    assert stop.cause is StopCause.DRAINED


def test_a_shared_replica_is_idle_only_when_none_of_its_callers_has_an_item_in_flight(clock):
    state = shared(clock)
    a = started(state, clock, ask(state, clock, 1, keep=True).actions)
    one(ask(state, clock, 2, keep=True).actions, c.Grant)
    assert state.view(clock()).replica(a.rid).idle
    state.handle(clock(), ev.Tick(in_flight={a.rid: 0.2}))
    view = state.view(clock()).replica(a.rid)
    assert not view.idle and view.in_flight_s == 0.2


def test_another_replica_starts_when_every_worker_reports_a_queue_wait_past_its_bound(clock):
    state = shared(clock, max_queue_wait_s=0.5)
    a = started(state, clock, ask(state, clock, 1, keep=True).actions)
    assert of(state.handle(clock(), ev.LeaseUsed(a.lease, 1, 10, 0.2)).actions, c.Start) == []  # under the bound
    start = one(state.handle(clock(), ev.LeaseUsed(a.lease, 1, 10, 0.9)).actions, c.Start)
    assert start.ticket is None and start.rid != a.rid
    assert of(state.handle(clock(), ev.LeaseUsed(a.lease, 1, 10, 0.9)).actions, c.Start) == []  # one is starting
