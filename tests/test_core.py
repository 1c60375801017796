"""The pool's decision core, driven with a fake clock: every lifecycle rule, in milliseconds.

No process, socket or thread here: each test feeds the core events and reads the actions
it returns, as the runtime would carry them out.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import resident_pool
from resident_pool.errors import AdmissionTimeout, BreakerOpen, PoolStopping, WorkerStartError
from resident_pool.server import actions as c
from resident_pool.server.actions import Timings
from resident_pool.server.core import PoolState
from resident_pool.server.lifecycle import STOP_ATTEMPTS
from resident_pool.server.replica import Spec
from resident_pool.server.states import ReplicaState, StopCause

R = ReplicaState
CONN, OTHER = 1, 2


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


def make(clock, spec: Spec | None = None, key: str = "m", **timings) -> PoolState:
    state = PoolState(Timings(**timings), clock())
    state.register(clock(), key, key, "v1", "fp1", spec or Spec())
    return state


def of(actions, kind):
    return [a for a in actions if isinstance(a, kind)]


def one(actions, kind):
    found = of(actions, kind)
    assert len(found) == 1, (kind.__name__, actions)
    return found[0]


def lease_one(state: PoolState, clock: Clock, key: str = "m", connection: int = CONN, keep: bool = False,
              can_recall: bool = True) -> c.Grant:
    """Acquire, start (cold) or reuse (warm) a replica, and return the Grant."""
    ticket, actions = state.acquire(clock(), key, connection, {}, keep=keep)
    grants = [a for a in of(actions, c.Grant) if a.ticket == ticket]
    if grants:
        return grants[0]
    start = one(actions, c.Start)
    actions = state.started(clock(), start.rid, 4242, can_recall)
    return next(a for a in of(actions, c.Grant) if a.ticket == ticket)


def replica(state: PoolState, rid: int):
    return state.replicas[rid]


# -- leases and idle time --------------------------------------------------------------------------
def test_a_leased_worker_is_never_retired_however_long_its_session_runs(clock):
    state = make(clock, Spec(idle_timeout_s=2))
    grant = lease_one(state, clock)
    for _ in range(100):  # a day-long session, ticked every 15 minutes
        clock.advance(900)
        assert of(state.tick(clock()), c.Stop) == []
    assert replica(state, grant.rid).state is R.LEASED


def test_idle_time_counts_only_while_ready_and_an_idle_worker_is_retired_after_its_idle_timeout(clock):
    state = make(clock, Spec(idle_timeout_s=2, ping_interval_s=100))
    grant = lease_one(state, clock)
    clock.advance(50)
    assert replica(state, grant.rid).idle_s(clock()) == 0.0
    state.released(clock(), grant.lease, CONN, "ok")
    clock.advance(1.9)
    assert of(state.tick(clock()), c.Stop) == []
    clock.advance(0.2)
    stop = one(state.tick(clock()), c.Stop)
    assert stop.cause is StopCause.IDLE and "idle_timeout_s = 2" in stop.why and not stop.kill
    assert replica(state, grant.rid).state is R.STOPPING
    assert one(state.stopped(clock(), grant.rid), c.Gone).cause is StopCause.IDLE
    assert state.replicas == {}


def test_a_released_worker_goes_to_the_next_waiter_before_any_new_start(clock):
    state = make(clock)
    first = lease_one(state, clock)
    ticket, actions = state.acquire(clock(), "m", OTHER, {})
    assert actions == []  # max_replicas = 1: it waits, nothing starts
    actions = state.released(clock(), first.lease, CONN, "ok")
    grant = one(actions, c.Grant)
    assert grant.ticket == ticket and grant.rid == first.rid and not grant.cold


def test_waiters_are_served_in_arrival_order(clock):
    state = make(clock)
    held = lease_one(state, clock)
    tickets = [state.acquire(clock(), "m", 10 + n, {})[0] for n in range(3)]
    served = []
    lease = held.lease
    connection = CONN
    for expected_connection in (10, 11, 12):
        grant = one(state.released(clock(), lease, connection, "ok"), c.Grant)
        served.append(grant.ticket)
        lease, connection = grant.lease, expected_connection
    assert served == tickets


def test_two_waiters_start_two_replicas_up_to_max_replicas_and_no_more(clock):
    state = make(clock, Spec(max_replicas=2))
    starts = []
    for connection in (1, 2, 3):
        starts += of(state.acquire(clock(), "m", connection, {})[1], c.Start)
    assert len(starts) == 2 and {replica(state, s.rid).index for s in starts} == {0, 1}


def test_a_waiter_times_out_after_its_admission_timeout_naming_who_holds_the_replicas(clock):
    state = make(clock, Spec(admission_timeout_s=30))
    lease_one(state, clock)
    ticket, _ = state.acquire(clock(), "m", OTHER, {})
    clock.advance(29)
    assert of(state.tick(clock()), c.Refuse) == []
    clock.advance(2)
    refuse = one(state.tick(clock()), c.Refuse)
    assert refuse.ticket == ticket and isinstance(refuse.error, AdmissionTimeout)
    assert "m[0] leased" in str(refuse.error) and "max_replicas = 1" in str(refuse.error)


# -- a client that goes away ----------------------------------------------------------------------------
def test_an_abandoned_request_is_pinged_and_the_worker_is_ready_again_when_it_answers(clock):
    state = make(clock)
    grant = lease_one(state, clock)
    ping = one(state.connection_closed(clock(), CONN), c.Ping)
    assert ping.purpose == "abandon" and ping.timeout_s == 1.0
    assert replica(state, grant.rid).state is R.DRAINING  # never handed out before it is free
    assert of(state.acquire(clock(), "m", OTHER, {})[1], c.Grant) == []
    grant2 = one(state.pinged(clock(), grant.rid, "abandon", answered=True), c.Grant)
    assert grant2.rid == grant.rid


def test_an_abandoned_request_past_its_grace_stops_the_worker(clock):
    state = make(clock, Spec(abandon_grace_s=30))
    grant = lease_one(state, clock)
    state.released(clock(), grant.lease, CONN, "abandoned")
    clock.advance(1)
    actions = state.pinged(clock(), grant.rid, "abandon", answered=False)
    second = one(actions, c.Ping)
    assert 28 < second.timeout_s <= 29 and "abandon_grace_s = 30" in one(actions, c.Note).text
    clock.advance(29)
    stop = one(state.pinged(clock(), grant.rid, "abandon", answered=False), c.Stop)
    assert stop.cause is StopCause.ABANDONED and stop.kill


def test_an_abandoned_worker_that_died_is_recorded_as_died(clock):
    state = make(clock)
    grant = lease_one(state, clock)
    state.connection_closed(clock(), CONN)
    stop = one(state.pinged(clock(), grant.rid, "abandon", answered=False, rc=-9), c.Stop)
    assert stop.cause is StopCause.DIED and "SIGKILL" in stop.why


def test_a_ping_of_an_abandoned_request_that_never_reports_is_overdue_and_the_worker_stopped(clock):
    state = make(clock, Spec(abandon_grace_s=10))
    lease_one(state, clock)
    state.connection_closed(clock(), CONN)
    clock.advance(10 + 16)  # the grace, then the report margin
    stop = one(state.tick(clock()), c.Stop)
    assert stop.cause is StopCause.OVERDUE and stop.kill


def test_a_client_gone_while_waiting_calls_off_a_start_still_waiting_for_admission(clock):
    state = make(clock)
    ticket, actions = state.acquire(clock(), "m", CONN, {})
    start = one(actions, c.Start)
    state.ticket_gone(clock(), ticket)
    assert replica(state, start.rid).abort is not None
    assert of(state.start_failed(clock(), start.rid, WorkerStartError("called off", reason="start_cancelled")),
              c.Refuse) == []
    assert state.providers["m"].breaker.failures == 0  # not the provider's fault


def test_a_client_gone_while_its_worker_loads_leaves_the_start_running_for_the_next(clock):
    state = make(clock)
    ticket, actions = state.acquire(clock(), "m", CONN, {})
    start = one(actions, c.Start)
    state.spawned(clock(), start.rid, 99)
    state.ticket_gone(clock(), ticket)
    assert replica(state, start.rid).abort is None
    state.started(clock(), start.rid, 99)
    assert replica(state, start.rid).state is R.READY


# -- kept leases (Pool.predict) -------------------------------------------------------------------------------
def test_a_kept_lease_is_idle_between_calls_and_taken_back_after_the_idle_timeout(clock):
    state = make(clock, Spec(idle_timeout_s=10, ping_interval_s=1000))
    grant = lease_one(state, clock, keep=True)
    assert grant.kept and replica(state, grant.rid).state is R.LEASED
    clock.advance(8)
    state.used(clock(), grant.lease, CONN, 5)  # the client says it is in use: idle from now
    clock.advance(9)
    assert of(state.tick(clock()), c.Recall) == []
    assert replica(state, grant.rid).idle_s(clock()) == 9 and replica(state, grant.rid).served == 5
    clock.advance(2)
    recall = one(state.tick(clock()), c.Recall)
    assert recall.lease == grant.lease
    stop = one(state.recalled(clock(), grant.lease, idle_s=11), c.Stop)
    assert stop.cause is StopCause.IDLE and grant.lease not in state.leases


def test_a_client_waiting_at_max_replicas_takes_a_kept_lease_back_after_at_most_one_request(clock):
    state = make(clock, Spec(max_replicas=1))
    kept = lease_one(state, clock, keep=True)
    ticket, actions = state.acquire(clock(), "m", OTHER, {})
    assert of(actions, c.Recall) == []  # just granted: its holder gets its one request first
    recall = one(state.used(clock(), kept.lease, CONN, 1), c.Recall)
    assert recall.lease == kept.lease and of(actions, c.Start) == []
    assert of(state.tick(clock()), c.Recall) == []  # asked once, not again every tick
    grant = one(state.recalled(clock(), kept.lease), c.Grant)
    assert grant.ticket == ticket and grant.rid == kept.rid
    assert of(state.released(clock(), kept.lease, CONN, "ok"), c.Action.__args__) == []  # the old lease is gone


def test_a_waiting_client_starts_another_replica_rather_than_take_a_kept_lease_where_it_may(clock):
    state = make(clock, Spec(max_replicas=2))
    lease_one(state, clock, keep=True)
    _, actions = state.acquire(clock(), "m", OTHER, {})
    assert one(actions, c.Start) and of(actions, c.Recall) == []


def test_a_new_version_takes_a_kept_lease_back_then_stops_its_worker(clock):
    state = make(clock)
    kept = lease_one(state, clock, keep=True)
    assert one(state.register(clock(), "m", "m", "v2", "fp2", Spec()), c.Recall).lease == kept.lease
    assert one(state.recalled(clock(), kept.lease), c.Stop).cause is StopCause.DRAINED


def test_admission_evicts_a_kept_lease_once_it_is_back_never_in_the_middle_of_a_request(clock):
    state = PoolState(Timings(), clock())
    state.register(clock(), "g", "g", "v", "f", _gpu())
    _, actions = state.acquire(clock(), "g", CONN, {}, keep=True)
    start = one(actions, c.Start)
    state.admitted(clock(), start.rid, "0")
    kept = one(state.started(clock(), start.rid, 1, True), c.Grant)
    rid, held_warm, _ = state.eviction_candidate()
    assert (rid, held_warm) == (kept.rid, False)
    assert one(state.evict(clock(), rid, 4), c.Recall).lease == kept.lease
    assert state.eviction_candidate() is None  # being recalled: not chosen twice
    stop = one(state.recalled(clock(), kept.lease), c.Stop)  # the worker answered: no request in flight
    assert stop.cause is StopCause.EVICTED


def test_a_worker_that_cannot_be_asked_for_its_lease_back_never_grants_a_kept_one(clock):
    state = make(clock)
    grant = lease_one(state, clock, keep=True, can_recall=False)
    assert not grant.kept and replica(state, grant.rid).idle_s(clock() + 100) == 0.0


def test_a_subprocess_mode_worker_never_grants_a_kept_lease(clock):
    state = make(clock, Spec(mode="subprocess"))
    assert not lease_one(state, clock, keep=True).kept


def test_a_recall_that_never_reports_is_overdue_and_its_worker_killed(clock):
    state = make(clock, Spec(request_timeout_s=60))
    kept = lease_one(state, clock, keep=True)
    state.acquire(clock(), "m", OTHER, {})
    one(state.used(clock(), kept.lease, CONN, 1), c.Recall)
    clock.advance(60 + 16)
    stop = one(state.tick(clock()), c.Stop)
    assert stop.cause is StopCause.OVERDUE and stop.kill and "of its kept lease did not report back" in stop.why
    assert replica(state, kept.rid).state is R.STOPPING


# -- versions ------------------------------------------------------------------------------------------------
def test_an_edited_manifest_drains_the_old_version_and_serves_new_requests_from_a_new_worker(clock):
    state = make(clock)
    old = lease_one(state, clock)
    actions = state.register(clock(), "m", "m", "v2", "fp2", Spec(max_replicas=1))
    assert replica(state, old.rid).state is R.DRAINING and of(actions, c.Stop) == []
    new = lease_one(state, clock, connection=OTHER)  # the old one does not count against max_replicas
    assert new.rid != old.rid and replica(state, new.rid).version == "v2"
    stop = one(state.released(clock(), old.lease, CONN, "ok"), c.Stop)
    assert stop.cause is StopCause.DRAINED and not stop.kill


def test_a_lifecycle_only_edit_applies_in_place(clock):
    state = make(clock, Spec(idle_timeout_s=600))
    grant = lease_one(state, clock)
    state.released(clock(), grant.lease, CONN, "ok")
    state.register(clock(), "m", "m", "v1", "fp1", Spec(idle_timeout_s=5))
    clock.advance(6)
    assert one(state.tick(clock()), c.Stop).cause is StopCause.IDLE


# -- liveness ------------------------------------------------------------------------------------------------
def test_an_idle_worker_is_pinged_every_ping_interval_and_stopped_when_it_does_not_answer(clock):
    state = make(clock, Spec(ping_interval_s=30), liveness_timeout_s=10)
    grant = lease_one(state, clock)
    state.released(clock(), grant.lease, CONN, "ok")
    clock.advance(29)
    assert of(state.tick(clock()), c.Ping) == []
    clock.advance(1)
    ping = one(state.tick(clock()), c.Ping)
    assert ping.purpose == "liveness" and ping.timeout_s == 10
    assert replica(state, grant.rid).state is R.CHECKING
    stop = one(state.pinged(clock(), grant.rid, "liveness", answered=False), c.Stop)
    assert stop.cause is StopCause.UNRESPONSIVE and "within 10 s" in stop.why


def test_a_liveness_ping_the_pool_could_not_send_is_not_held_against_the_worker(clock):
    state = make(clock, Spec(ping_interval_s=30))
    grant = lease_one(state, clock)
    state.released(clock(), grant.lease, CONN, "ok")
    clock.advance(30)
    one(state.tick(clock()), c.Ping)
    actions = state.pinged(clock(), grant.rid, "liveness", answered=False, failure="OSError: [Errno 24] EMFILE")
    assert of(actions, c.Stop) == [] and replica(state, grant.rid).state is R.READY
    assert "not its fault" in one(actions, c.Note).text


def test_a_request_during_a_liveness_ping_waits_for_the_pinged_worker_instead_of_starting_another(clock):
    state = make(clock, Spec(ping_interval_s=30, max_replicas=4))
    grant = lease_one(state, clock)
    state.released(clock(), grant.lease, CONN, "ok")
    clock.advance(30)
    state.tick(clock())
    ticket, actions = state.acquire(clock(), "m", OTHER, {})
    assert actions == []  # no second replica for a health check
    assert one(state.pinged(clock(), grant.rid, "liveness", answered=True), c.Grant).ticket == ticket


def test_a_liveness_ping_that_never_reports_is_overdue(clock):
    state = make(clock, Spec(ping_interval_s=30), liveness_timeout_s=10)
    grant = lease_one(state, clock)
    state.released(clock(), grant.lease, CONN, "ok")
    clock.advance(30)
    state.tick(clock())
    clock.advance(10 + 15)
    stop = one(state.tick(clock()), c.Stop)
    assert stop.cause is StopCause.OVERDUE and "liveness ping did not report back" in stop.why


# -- ends of requests ------------------------------------------------------------------------------------
def test_a_request_past_its_timeout_kills_the_worker(clock):
    state = make(clock, Spec(request_timeout_s=1))
    grant = lease_one(state, clock)
    stop = one(state.released(clock(), grant.lease, CONN, "timeout"), c.Stop)
    assert stop.cause is StopCause.TIMEOUT and stop.kill and "request_timeout_s = 1 s" in stop.why


def test_a_worker_that_died_between_requests_is_forgotten_and_the_next_request_starts_another(clock):
    state = make(clock)
    grant = lease_one(state, clock)
    state.released(clock(), grant.lease, CONN, "ok")
    stop = one(state.exited(clock(), grant.rid, -9), c.Stop)
    assert stop.cause is StopCause.DIED and "exited while idle" in stop.why
    state.stopped(clock(), grant.rid)
    assert one(state.acquire(clock(), "m", CONN, {})[1], c.Start).rid != grant.rid


def test_a_release_by_another_connection_is_refused_and_changes_nothing(clock):
    state = make(clock)
    grant = lease_one(state, clock)
    with pytest.raises(Exception, match="not held by this connection"):
        state.released(clock(), grant.lease, OTHER, "ok")
    assert replica(state, grant.rid).state is R.LEASED


def test_a_subprocess_mode_worker_serves_one_lease_and_is_never_handed_out_again(clock):
    state = make(clock, Spec(mode="subprocess"))
    grant = lease_one(state, clock)
    state.acquire(clock(), "m", OTHER, {})
    actions = state.released(clock(), grant.lease, CONN, "ok")
    assert one(actions, c.Stop).cause is StopCause.ONE_LEASE and of(actions, c.Grant) == []
    assert one(actions, c.Start).rid != grant.rid  # a fresh worker for the next lease


# -- starts and the breaker -------------------------------------------------------------------------------
def test_a_refusal_at_start_opens_the_breaker_and_every_waiter_is_refused_at_once_with_its_reason(clock):
    state = make(clock, Spec(max_replicas=1), breaker_cooldown_s=300)
    first, actions = state.acquire(clock(), "m", 1, {})
    start = one(actions, c.Start)
    second, _ = state.acquire(clock(), "m", 2, {})
    refusal = WorkerStartError("m: exited 3: refused", reason="start_failed", exit_code=3)
    actions = state.start_failed(clock(), start.rid, refusal)
    refused = {r.ticket: r.error for r in of(actions, c.Refuse)}
    assert refused[first] is refusal and refusal.details["breaker_opened"]
    assert isinstance(refused[second], BreakerOpen) and refused[second].reason == "breaker_open"
    assert refused[second].details["original"]["exit_code"] == 3 and "resident-pool stop m" in str(refused[second])
    assert of(actions, c.Start) == []
    _third, actions = state.acquire(clock(), "m", 3, {})
    assert one(actions, c.Refuse).error.details["breaker"]["closes_in_s"] == 300
    clock.advance(301)
    assert of(state.acquire(clock(), "m", 4, {})[1], c.Start)


def test_three_failed_starts_in_a_row_open_the_breaker_and_a_manifest_edit_closes_it(clock):
    state = make(clock)
    for n in range(3):
        _, actions = state.acquire(clock(), "m", n, {})
        state.start_failed(clock(), one(actions, c.Start).rid, WorkerStartError("m: exited 1", exit_code=1))
    assert isinstance(one(state.acquire(clock(), "m", 9, {})[1], c.Refuse).error, BreakerOpen)
    state.register(clock(), "m", "m", "v2", "fp2", Spec())
    assert of(state.acquire(clock(), "m", 10, {})[1], c.Start)


def test_a_start_that_never_reports_is_overdue_and_its_process_killed(clock):
    state = make(clock, Spec(admission_timeout_s=10, start_timeout_s=20))
    _, actions = state.acquire(clock(), "m", CONN, {})
    start = one(actions, c.Start)
    state.spawned(clock(), start.rid, 77)
    clock.advance(10 + 20 + 16)
    stop = one(state.tick(clock()), c.Stop)
    assert stop.cause is StopCause.OVERDUE and stop.kill and replica(state, start.rid).state is R.STOPPING


# -- stopping ------------------------------------------------------------------------------------------------------
def test_a_stop_that_raises_is_retried_with_sigkill_and_never_left_stopping(clock):
    state = make(clock)
    grant = lease_one(state, clock)
    state.released(clock(), grant.lease, CONN, "ok")
    one(state.stop(clock(), "m", False, "stopped by `resident-pool stop`")[1], c.Stop)
    for attempt in range(STOP_ATTEMPTS):
        retry = one(state.stopped(clock(), grant.rid, failure="OSError: [Errno 24] Too many open files"), c.Stop)
        assert retry.kill, attempt
    gone = one(state.stopped(clock(), grant.rid, failure="OSError: [Errno 24] Too many open files"), c.Gone)
    assert "did not end" in gone.why and state.replicas == {}


def test_a_stop_that_never_reports_is_escalated_then_given_up(clock):
    state = make(clock, stop_overdue_s=60)
    grant = lease_one(state, clock)
    state.released(clock(), grant.lease, CONN, "ok")
    state.stop(clock(), "m", False, "stop")
    kills = 0
    for _ in range(STOP_ATTEMPTS + 1):
        clock.advance(61)
        actions = state.tick(clock())
        kills += len(of(actions, c.Stop))
    assert kills == STOP_ATTEMPTS and state.replicas == {}


def test_the_pool_stopping_lets_a_leased_request_finish_then_stops_its_worker(clock):
    state = make(clock, drain_grace_s=60)
    grant = lease_one(state, clock)
    _waiting, _ = state.acquire(clock(), "m", OTHER, {})
    actions = state.shutdown(clock(), "signal SIGTERM")
    assert isinstance(one(actions, c.Refuse).error, PoolStopping) and of(actions, c.Stop) == []
    assert isinstance(one(state.acquire(clock(), "m", 5, {})[1], c.Refuse).error, PoolStopping)
    stop = one(state.released(clock(), grant.lease, CONN, "ok"), c.Stop)
    assert stop.cause is StopCause.POOL_STOPPING


def test_a_lease_still_held_after_the_drain_grace_is_stopped_anyway(clock):
    state = make(clock, drain_grace_s=60)
    grant = lease_one(state, clock)
    state.stop(clock(), "m", False, "stopped by `resident-pool stop`")
    clock.advance(59)
    assert of(state.tick(clock()), c.Stop) == []
    clock.advance(2)
    stop = one(state.tick(clock()), c.Stop)
    assert "still busy after drain_grace_s = 60 s" in stop.why and replica(state, grant.rid).state is R.STOPPING


def test_stop_now_on_a_starting_worker_calls_its_start_off(clock):
    state = make(clock)
    _, actions = state.acquire(clock(), "m", CONN, {})
    start = one(actions, c.Start)
    state.spawned(clock(), start.rid, 55)
    assert of(state.stop(clock(), "m", True, "stop --now")[1], c.Stop) == []
    assert replica(state, start.rid).abort is not None
    actions = state.start_failed(clock(), start.rid, WorkerStartError("stopped while it started",
                                                                      reason="start_cancelled"))
    assert one(actions, c.Refuse).error.reason == "start_cancelled"


def test_the_pool_exits_after_quiet_exit_s_with_no_workers_and_no_clients(clock):
    state = make(clock, quiet_exit_s=600)
    clock.advance(599)
    assert of(state.tick(clock(), connections=0), c.Exit) == []
    clock.advance(2)
    assert of(state.tick(clock(), connections=1), c.Exit) == []  # a client connected: quiet starts again
    clock.advance(599)
    assert of(state.tick(clock(), connections=0), c.Exit) == []
    clock.advance(2)
    assert one(state.tick(clock(), connections=0), c.Exit).why == "quiet"


# -- kept-warm and hibernation (eviction and the GPU line: test_core_admission.py) -----------------------------------
def _admitted_ready(state: PoolState, clock: Clock, key: str, device: int = 0) -> int:
    """A replica of ``key`` started through the GPU line, placed on ``device``, leased once and released."""
    _ticket, actions = state.acquire(clock(), key, CONN, {})
    start = one(actions, c.Start)
    one(state.prepared(clock(), start.rid, state.providers[key].spec.budget_gb), c.Place)
    one(state.placed(clock(), start.rid, device), c.Spawn)
    grant = one(state.started(clock(), start.rid, 4242), c.Grant)
    state.released(clock(), grant.lease, CONN, "ok")
    return grant.rid


def _gpu(**kw) -> Spec:
    return Spec(budget_gb=4, ping_interval_s=10_000, **kw)


def test_a_kept_warm_worker_is_exempt_from_idle_retirement(clock):
    state = PoolState(Timings(), clock())
    state.register(clock(), "warm", "warm", "v", "f", Spec(budget_gb=4, min_replicas=1, idle_timeout_s=1,
                                                          ping_interval_s=10_000))
    warm = _admitted_ready(state, clock, "warm")
    clock.advance(100)
    assert of(state.tick(clock()), c.Stop) == []  # idle 100 s past its 1 s timeout, but kept warm
    assert replica(state, warm).state is R.READY


def test_kept_warm_providers_are_topped_up_but_not_while_requests_wait_for_memory(clock):
    state = PoolState(Timings(keep_warm_s=5), clock())
    state.register(clock(), "w", "w", "v", "f", Spec(min_replicas=2))
    state.register(clock(), "g", "g", "v", "f", _gpu())
    start = one(state.acquire(clock(), "g", CONN, {})[1], c.Start)
    one(state.prepared(clock(), start.rid, 4), c.Place)
    state.not_placed(clock(), start.rid, {0: 1.0})  # it waits for memory
    assert of(state.tick(clock()), c.Start) == []
    state.ticket_gone(clock(), next(iter(state.tickets)))
    clock.advance(5)
    starts = of(state.tick(clock()), c.Start)
    assert len(starts) == 2 and all(not s.wait and s.ticket is None for s in starts)
    clock.advance(5)
    assert of(state.tick(clock()), c.Start) == []  # the two starting count


def test_a_hibernated_worker_gives_its_budget_back_and_its_next_lease_restores_it(clock):
    state = PoolState(Timings(), clock())
    state.register(clock(), "h", "h", "v", "f", _gpu(evict="hibernate"))
    rid = _admitted_ready(state, clock, "h")
    one(state.lifecycle.evict(clock(), rid, 4), c.Hibernate)
    assert replica(state, rid).state is R.HIBERNATING
    one(state.hibernated(clock(), rid, True, "evicted"), c.ReleaseBudget)
    assert replica(state, rid).state is R.HIBERNATED and not replica(state, rid).admitted
    start = one(state.acquire(clock(), "h", CONN, {})[1], c.Start)
    assert start.rid == rid and start.restore
    assert one(state.prepared(clock(), rid, 4, 0), c.Place).device == 0  # its memory goes back where it was
    one(state.placed(clock(), rid, 0), c.Spawn)
    assert one(state.started(clock(), rid, 1), c.Grant).cold


# -- the core is pure, and alone changes the records ------------------------------------------------------------------
PACKAGE = Path(resident_pool.__file__).parent
ALLOWED_IMPORTS = {"__future__", "itertools", "dataclasses", "typing", "enum", "collections"}
# The decision core: its face, its two owners (replicas; the waiting line and leases), its records and actions.
CORE = ("core.py", "lifecycle.py", "drains.py", "leases.py", "admitting.py", "replica.py", "states.py", "breaker.py",
        "actions.py", "events.py")
# The one order every waiting line keeps, shared with the host admission service: pure as well.
SHARED = ("priority",)


def test_the_decision_core_imports_nothing_that_starts_a_thread_opens_a_socket_or_reads_the_clock():
    for name in CORE:
        tree = ast.parse((PACKAGE / "server" / name).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                assert {a.name.split(".")[0] for a in node.names} <= ALLOWED_IMPORTS, (name, ast.dump(node))
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                assert node.module.split(".")[0] in ALLOWED_IMPORTS, (name, node.module)
            elif isinstance(node, ast.ImportFrom):
                within = ("errors", "exits", *SHARED, *(m.removesuffix(".py") for m in CORE))
                assert node.module in within or (
                    node.module is None and {a.name for a in node.names} <= set(within)), (name, node.module)
    for name in SHARED:
        for node in ast.walk(ast.parse((PACKAGE / f"{name}.py").read_text())):
            if isinstance(node, ast.Import | ast.ImportFrom):
                module = node.module if isinstance(node, ast.ImportFrom) else node.names[0].name
                assert module.split(".")[0] in {"__future__", "collections", "typing"}, (name, module)


def _assigned(target: ast.AST) -> list[ast.Attribute]:
    """The attributes an assignment target writes: ``a.b =``, ``a.b[k] =``, ``a.b, c.d =`` (never a subscript's key)."""
    if isinstance(target, ast.Tuple | ast.List):
        return [found for element in target.elts for found in _assigned(element)]
    while isinstance(target, ast.Subscript):
        target = target.value
    return [target] if isinstance(target, ast.Attribute) else []


RECORD_FIELDS = {"state", "lease", "retire", "abort", "deadline", "drain_by", "for_ticket", "last_used",
                 "last_checked", "served", "stop", "leases", "tickets", "queue", "replicas", "stopping", "version",
                 "kept", "recalling", "checking", "idle_check", "evict_for", "can_recall", "noticed", "admitted",
                 "hibernated", "probes", "stop_attempts", "fresh", "last_error"}
# (`pid` and `device` are left out: a WorkerProcess has them too, set by the runtime that owns it.)


def test_only_the_decision_core_assigns_replica_and_lease_state():
    offenders = []
    for path in (PACKAGE / "server").glob("*.py"):  # replica records are reachable from the server alone
        if path.name in CORE:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, ast.AugAssign | ast.AnnAssign) else []
            for target in targets:
                for sub in _assigned(target):
                    if sub.attr in RECORD_FIELDS and not (isinstance(sub.value, ast.Name) and sub.value.id == "self"):
                        offenders.append(f"{path.name}:{node.lineno} .{sub.attr}")
    assert offenders == []


def test_a_kept_lease_between_calls_is_pinged_for_liveness_and_stopped_when_it_does_not_answer(clock):
    state = make(clock, Spec(ping_interval_s=30))
    kept = lease_one(state, clock, keep=True)
    clock.advance(30)
    ping = one(state.tick(clock()), c.Ping)
    assert ping.purpose == "liveness" and replica(state, kept.rid).state is R.LEASED
    assert of(state.tick(clock()), c.Ping) == []  # one at a time
    stop = one(state.pinged(clock(), kept.rid, "liveness", answered=False), c.Stop)
    assert stop.cause is StopCause.UNRESPONSIVE and stop.kill


# -- kept leases: the outside review's findings ------------------------------------------------------------
def _kept_in_use(state: PoolState, clock: Clock, key: str = "m") -> c.Grant:
    kept = lease_one(state, clock, key, keep=True)
    state.used(clock(), kept.lease, CONN, 1)
    return kept


def test_a_kept_lease_busy_with_a_long_request_is_not_retired_as_idle(clock):
    state = make(clock, Spec(idle_timeout_s=2, ping_interval_s=1000))
    kept = _kept_in_use(state, clock)
    clock.advance(3)  # the client said nothing for 3 s: it may be idle, or in one long request
    one(state.tick(clock()), c.Recall)
    actions = state.recalled(clock(), kept.lease, idle_s=0.1, served=2)  # the worker: it just finished one
    assert of(actions, c.Stop) == [] and replica(state, kept.rid).state is R.READY
    assert replica(state, kept.rid).served == 2  # the notice's 1, and the one more the worker counted


def test_a_kept_lease_idle_past_its_timeout_by_its_workers_word_is_retired(clock):
    state = make(clock, Spec(idle_timeout_s=2, ping_interval_s=1000))
    kept = _kept_in_use(state, clock)
    clock.advance(3)
    one(state.tick(clock()), c.Recall)
    assert one(state.recalled(clock(), kept.lease, idle_s=3.0, served=1), c.Stop).cause is StopCause.IDLE


def test_a_recall_the_pool_could_not_send_keeps_the_lease_and_is_tried_again(clock):
    state = make(clock)
    kept = _kept_in_use(state, clock)
    _, actions = state.acquire(clock(), "m", OTHER, {})
    one(actions, c.Recall)
    actions = state.recalled(clock(), kept.lease, failure="OSError: [Errno 24] Too many open files")
    assert of(actions, c.Stop) == [] and "not its fault" in one(actions, c.Note).text
    assert replica(state, kept.rid).state is R.LEASED and kept.lease in state.leases
    assert one(state.tick(clock()), c.Recall).lease == kept.lease  # the next look tries again


def test_a_recall_keeps_its_deadline_across_a_liveness_ping(clock):
    state = make(clock, Spec(ping_interval_s=30, request_timeout_s=60))
    kept = _kept_in_use(state, clock)
    clock.advance(30)
    one(state.tick(clock()), c.Ping)
    one(state.acquire(clock(), "m", OTHER, {})[1], c.Recall)
    state.pinged(clock(), kept.rid, "liveness", answered=True)
    assert replica(state, kept.rid).deadline is not None  # the recall's still stands
    clock.advance(60 + 16)
    assert one(state.tick(clock()), c.Stop).cause is StopCause.OVERDUE


def test_an_eviction_overtaken_by_a_release_is_forgotten(clock):
    state = PoolState(Timings(), clock())
    state.register(clock(), "g", "g", "v", "f", _gpu())
    _, actions = state.acquire(clock(), "g", CONN, {}, keep=True)
    start = one(actions, c.Start)
    state.admitted(clock(), start.rid, "0")
    kept = one(state.started(clock(), start.rid, 1, True), c.Grant)
    one(state.evict(clock(), kept.rid, 4), c.Recall)
    state.released(clock(), kept.lease, CONN, "ok")  # its client gave it back first
    assert replica(state, kept.rid).evict_for is None


def test_admission_skips_a_kept_lease_the_runtime_found_busy(clock):
    state = PoolState(Timings(), clock())
    state.register(clock(), "g", "g", "v", "f", _gpu())
    _, actions = state.acquire(clock(), "g", CONN, {}, keep=True)
    start = one(actions, c.Start)
    state.admitted(clock(), start.rid, "0")
    kept = one(state.started(clock(), start.rid, 1, True), c.Grant)
    assert state.eviction_candidate(frozenset({kept.rid})) is None


def test_a_lease_still_held_after_the_drain_grace_is_killed_not_asked(clock):
    state = make(clock, drain_grace_s=2)
    lease_one(state, clock)
    state.shutdown(clock(), "signal SIGTERM")
    clock.advance(3)
    assert one(state.tick(clock()), c.Stop).kill  # within drain_grace_s plus the kill grace


def test_a_kept_lease_ends_with_its_replica_and_the_pool_is_idle_again(clock):
    state = make(clock)
    kept = _kept_in_use(state, clock)
    one(state.stop(clock(), "m", True, "stop --now")[1], c.Stop)
    state.stopped(clock(), kept.rid)
    assert kept.lease not in state.leases and state.idle()


def test_stop_and_shutdown_take_a_kept_lease_back_first(clock):
    state = make(clock)
    kept = _kept_in_use(state, clock)
    assert one(state.stop(clock(), "m", False, "stopped by `resident-pool stop`")[1], c.Recall).lease == kept.lease
    stop = one(state.recalled(clock(), kept.lease, served=1), c.Stop)
    assert stop.cause is StopCause.STOPPED and not stop.kill
    other = make(clock)
    kept = _kept_in_use(other, clock)
    assert one(other.shutdown(clock(), "signal SIGTERM"), c.Recall).lease == kept.lease


def test_a_kept_lease_evicted_for_a_hibernating_provider_hibernates_once_back(clock):
    state = PoolState(Timings(), clock())
    state.register(clock(), "h", "h", "v", "f", _gpu(evict="hibernate"))
    _, actions = state.acquire(clock(), "h", CONN, {}, keep=True)
    start = one(actions, c.Start)
    state.admitted(clock(), start.rid, "0")
    kept = one(state.started(clock(), start.rid, 1, True), c.Grant)
    one(state.evict(clock(), kept.rid, 4), c.Recall)
    one(state.recalled(clock(), kept.lease, served=1), c.Hibernate)


def test_a_kept_lease_holder_that_disconnects_between_calls_frees_its_worker_after_a_ping(clock):
    state = make(clock)
    kept = _kept_in_use(state, clock)
    one(state.connection_closed(clock(), CONN), c.Ping)
    assert one(state.acquire(clock(), "m", OTHER, {})[1] + state.pinged(clock(), kept.rid, "abandon", True),
               c.Grant).rid == kept.rid


def test_a_used_notice_from_another_connection_changes_nothing(clock):
    state = make(clock, Spec(idle_timeout_s=10, ping_interval_s=1000))
    kept = lease_one(state, clock, keep=True)
    clock.advance(9)
    state.used(clock(), kept.lease, OTHER, 5)
    assert replica(state, kept.rid).served == 0 and replica(state, kept.rid).idle_s(clock()) == 9


def test_a_hibernated_worker_idle_past_its_timeout_is_killed(clock):
    state = PoolState(Timings(), clock())
    state.register(clock(), "h", "h", "v", "f", Spec(budget_gb=4, idle_timeout_s=60, ping_interval_s=10_000,
                                                      evict="hibernate"))
    rid = _admitted_ready(state, clock, "h")
    one(state.evict(clock(), rid, 4), c.Hibernate)
    state.hibernated(clock(), rid, True, "evicted")
    clock.advance(61)
    stop = one(state.tick(clock()), c.Stop)
    assert stop.cause is StopCause.IDLE and stop.kill  # its CUDA is locked: it can only be ended


def test_a_worker_over_its_budget_is_retired_once_its_lease_ends(clock):
    state = make(clock)
    grant = lease_one(state, clock)
    assert state.retire(clock(), grant.rid, StopCause.OVER_BUDGET, "over its budget") == []
    assert replica(state, grant.rid).state is R.DRAINING
    assert one(state.released(clock(), grant.lease, CONN, "ok"), c.Stop).cause is StopCause.OVER_BUDGET

