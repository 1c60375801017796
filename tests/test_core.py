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
from resident_pool.server import events as ev
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
    state.handle(clock(), ev.ManifestRead(key, key, "v1", "fp1", spec or Spec()))
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
    decision = state.handle(clock(), ev.ClientAsked(key, connection, {}, keep=keep))
    ticket, actions = decision.ticket, decision.actions
    grants = [a for a in of(actions, c.Grant) if a.ticket == ticket]
    if grants:
        return grants[0]
    start = one(actions, c.Start)
    actions = state.handle(clock(), ev.WorkerStarted(start.rid, 4242, can_recall)).actions
    return next(a for a in of(actions, c.Grant) if a.ticket == ticket)


def replica(state: PoolState, rid: int):
    return state.replicas[rid]


# -- leases and idle time --------------------------------------------------------------------------
def test_a_leased_worker_is_never_retired_however_long_its_session_runs(clock):
    state = make(clock, Spec(idle_timeout_s=2))
    grant = lease_one(state, clock)
    for _ in range(100):  # a day-long session, ticked every 15 minutes
        clock.advance(900)
        assert of(state.handle(clock(), ev.Tick()).actions, c.Stop) == []
    assert replica(state, grant.rid).state is R.LEASED


def test_idle_time_counts_only_while_ready_and_an_idle_worker_is_retired_after_its_idle_timeout(clock):
    state = make(clock, Spec(idle_timeout_s=2, ping_interval_s=100))
    grant = lease_one(state, clock)
    clock.advance(50)
    assert replica(state, grant.rid).idle_s(clock()) == 0.0
    state.handle(clock(), ev.LeaseReleased(grant.lease, CONN, "ok"))
    clock.advance(1.9)
    assert of(state.handle(clock(), ev.Tick()).actions, c.Stop) == []
    clock.advance(0.2)
    stop = one(state.handle(clock(), ev.Tick()).actions, c.Stop)
    assert stop.cause is StopCause.IDLE and "idle_timeout_s = 2" in stop.why and not stop.kill
    assert replica(state, grant.rid).state is R.STOPPING
    assert one(state.handle(clock(), ev.WorkerStopped(grant.rid)).actions, c.Gone).cause is StopCause.IDLE
    assert state.replicas == {}


def test_a_released_worker_goes_to_the_next_waiter_before_any_new_start(clock):
    state = make(clock)
    first = lease_one(state, clock)
    decision = state.handle(clock(), ev.ClientAsked("m", OTHER, {}))
    ticket, actions = decision.ticket, decision.actions
    assert actions == []  # max_replicas = 1: it waits, nothing starts
    actions = state.handle(clock(), ev.LeaseReleased(first.lease, CONN, "ok")).actions
    grant = one(actions, c.Grant)
    assert grant.ticket == ticket and grant.rid == first.rid and not grant.cold


def test_waiters_are_served_in_arrival_order(clock):
    state = make(clock)
    held = lease_one(state, clock)
    tickets = [state.handle(clock(), ev.ClientAsked("m", 10 + n, {})).ticket for n in range(3)]
    served = []
    lease = held.lease
    connection = CONN
    for expected_connection in (10, 11, 12):
        grant = one(state.handle(clock(), ev.LeaseReleased(lease, connection, "ok")).actions, c.Grant)
        served.append(grant.ticket)
        lease, connection = grant.lease, expected_connection
    assert served == tickets


def test_two_waiters_start_two_replicas_up_to_max_replicas_and_no_more(clock):
    state = make(clock, Spec(max_replicas=2))
    starts = []
    for connection in (1, 2, 3):
        starts += of(state.handle(clock(), ev.ClientAsked("m", connection, {})).actions, c.Start)
    assert len(starts) == 2 and {replica(state, s.rid).index for s in starts} == {0, 1}


def test_a_waiter_times_out_after_its_admission_timeout_naming_who_holds_the_replicas(clock):
    state = make(clock, Spec(admission_timeout_s=30))
    lease_one(state, clock)
    ticket = state.handle(clock(), ev.ClientAsked("m", OTHER, {})).ticket
    clock.advance(29)
    assert of(state.handle(clock(), ev.Tick()).actions, c.Refuse) == []
    clock.advance(2)
    refuse = one(state.handle(clock(), ev.Tick()).actions, c.Refuse)
    assert refuse.ticket == ticket and isinstance(refuse.error, AdmissionTimeout)
    assert "m[0] leased" in str(refuse.error) and "max_replicas = 1" in str(refuse.error)


# -- a client that goes away ----------------------------------------------------------------------------
def test_an_abandoned_request_is_pinged_and_the_worker_is_ready_again_when_it_answers(clock):
    state = make(clock)
    grant = lease_one(state, clock)
    ping = one(state.handle(clock(), ev.ConnectionClosed(CONN)).actions, c.Ping)
    assert ping.purpose == "abandon" and ping.timeout_s == 1.0
    assert replica(state, grant.rid).state is R.DRAINING  # never handed out before it is free
    assert of(state.handle(clock(), ev.ClientAsked("m", OTHER, {})).actions, c.Grant) == []
    grant2 = one(state.handle(clock(), ev.Pinged(grant.rid, "abandon", answered=True)).actions, c.Grant)
    assert grant2.rid == grant.rid


def test_an_abandoned_request_past_its_grace_stops_the_worker(clock):
    state = make(clock, Spec(abandon_grace_s=30))
    grant = lease_one(state, clock)
    state.handle(clock(), ev.LeaseReleased(grant.lease, CONN, "abandoned"))
    clock.advance(1)
    actions = state.handle(clock(), ev.Pinged(grant.rid, "abandon", answered=False)).actions
    second = one(actions, c.Ping)
    assert 28 < second.timeout_s <= 29 and "abandon_grace_s = 30" in one(actions, c.Note).text
    clock.advance(29)
    stop = one(state.handle(clock(), ev.Pinged(grant.rid, "abandon", answered=False)).actions, c.Stop)
    assert stop.cause is StopCause.ABANDONED and stop.kill


def test_an_abandoned_worker_that_died_is_recorded_as_died(clock):
    state = make(clock)
    grant = lease_one(state, clock)
    state.handle(clock(), ev.ConnectionClosed(CONN))
    stop = one(state.handle(clock(), ev.Pinged(grant.rid, "abandon", answered=False, rc=-9)).actions, c.Stop)
    assert stop.cause is StopCause.DIED and "SIGKILL" in stop.why


def test_a_ping_of_an_abandoned_request_that_never_reports_is_overdue_and_the_worker_stopped(clock):
    state = make(clock, Spec(abandon_grace_s=10))
    lease_one(state, clock)
    state.handle(clock(), ev.ConnectionClosed(CONN))
    clock.advance(10 + 16)  # the grace, then the report margin
    stop = one(state.handle(clock(), ev.Tick()).actions, c.Stop)
    assert stop.cause is StopCause.OVERDUE and stop.kill


def test_a_client_gone_while_waiting_calls_off_a_start_still_waiting_for_admission(clock):
    state = make(clock)
    decision = state.handle(clock(), ev.ClientAsked("m", CONN, {}))
    ticket, actions = decision.ticket, decision.actions
    start = one(actions, c.Start)
    state.handle(clock(), ev.TicketGone(ticket))
    assert replica(state, start.rid).abort is not None
    assert of(state.handle(clock(), ev.StartFailed(start.rid, WorkerStartError("called off", reason="start_cancelled"))).actions,
              c.Refuse) == []
    assert state.providers["m"].breaker.failures == 0  # not the provider's fault


def test_a_client_gone_while_its_worker_loads_leaves_the_start_running_for_the_next(clock):
    state = make(clock)
    decision = state.handle(clock(), ev.ClientAsked("m", CONN, {}))
    ticket, actions = decision.ticket, decision.actions
    start = one(actions, c.Start)
    state.handle(clock(), ev.WorkerSpawned(start.rid, 99))
    state.handle(clock(), ev.TicketGone(ticket))
    assert replica(state, start.rid).abort is None
    state.handle(clock(), ev.WorkerStarted(start.rid, 99))
    assert replica(state, start.rid).state is R.READY


# -- kept leases (Pool.predict) -------------------------------------------------------------------------------
def test_a_kept_lease_is_idle_between_calls_and_taken_back_after_the_idle_timeout(clock):
    state = make(clock, Spec(idle_timeout_s=10, ping_interval_s=1000))
    grant = lease_one(state, clock, keep=True)
    assert grant.kept and replica(state, grant.rid).state is R.LEASED
    clock.advance(8)
    state.handle(clock(), ev.LeaseUsed(grant.lease, CONN, 5))  # the client says it is in use: idle from now
    clock.advance(9)
    assert of(state.handle(clock(), ev.Tick()).actions, c.Recall) == []
    assert replica(state, grant.rid).idle_s(clock()) == 9 and replica(state, grant.rid).served == 5
    clock.advance(2)
    recall = one(state.handle(clock(), ev.Tick()).actions, c.Recall)
    assert recall.lease == grant.lease
    stop = one(state.handle(clock(), ev.LeaseRecalled(grant.lease, idle_s=11)).actions, c.Stop)
    assert stop.cause is StopCause.IDLE and grant.lease not in state.leases


def test_a_client_waiting_at_max_replicas_takes_a_kept_lease_back_after_at_most_one_request(clock):
    state = make(clock, Spec(max_replicas=1))
    kept = lease_one(state, clock, keep=True)
    decision = state.handle(clock(), ev.ClientAsked("m", OTHER, {}))
    ticket, actions = decision.ticket, decision.actions
    assert of(actions, c.Recall) == []  # just granted: its holder gets its one request first
    recall = one(state.handle(clock(), ev.LeaseUsed(kept.lease, CONN, 1)).actions, c.Recall)
    assert recall.lease == kept.lease and of(actions, c.Start) == []
    assert of(state.handle(clock(), ev.Tick()).actions, c.Recall) == []  # asked once, not again every tick
    grant = one(state.handle(clock(), ev.LeaseRecalled(kept.lease)).actions, c.Grant)
    assert grant.ticket == ticket and grant.rid == kept.rid
    assert of(state.handle(clock(), ev.LeaseReleased(kept.lease, CONN, "ok")).actions, c.Action.__args__) == []  # the old lease is gone


def test_a_waiting_client_starts_another_replica_rather_than_take_a_kept_lease_where_it_may(clock):
    state = make(clock, Spec(max_replicas=2))
    lease_one(state, clock, keep=True)
    actions = state.handle(clock(), ev.ClientAsked("m", OTHER, {})).actions
    assert one(actions, c.Start) and of(actions, c.Recall) == []


def test_a_new_version_takes_a_kept_lease_back_then_stops_its_worker(clock):
    state = make(clock)
    kept = lease_one(state, clock, keep=True)
    assert one(state.handle(clock(), ev.ManifestRead("m", "m", "v2", "fp2", Spec())).actions, c.Recall).lease == kept.lease
    assert one(state.handle(clock(), ev.LeaseRecalled(kept.lease)).actions, c.Stop).cause is StopCause.DRAINED


def test_admission_evicts_a_kept_lease_once_it_is_back_never_in_the_middle_of_a_request(clock):
    state = _gpu_pool(clock, "g")
    kept = _kept_on_gpu(state, clock, "g")
    assert one(_make_room(state, clock), c.Recall).lease == kept.lease
    assert of(state.handle(clock(), ev.Tick()).actions, c.Recall) == []  # being recalled: not chosen twice
    stop = one(state.handle(clock(), ev.LeaseRecalled(kept.lease)).actions, c.Stop)  # the worker answered: no request in flight
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
    state.handle(clock(), ev.ClientAsked("m", OTHER, {}))
    one(state.handle(clock(), ev.LeaseUsed(kept.lease, CONN, 1)).actions, c.Recall)
    clock.advance(60 + 16)
    stop = one(state.handle(clock(), ev.Tick()).actions, c.Stop)
    assert stop.cause is StopCause.OVERDUE and stop.kill and "of its kept lease did not report back" in stop.why
    assert replica(state, kept.rid).state is R.STOPPING


# -- versions ------------------------------------------------------------------------------------------------
def test_an_edited_manifest_drains_the_old_version_and_serves_new_requests_from_a_new_worker(clock):
    state = make(clock)
    old = lease_one(state, clock)
    actions = state.handle(clock(), ev.ManifestRead("m", "m", "v2", "fp2", Spec(max_replicas=1))).actions
    assert replica(state, old.rid).state is R.DRAINING and of(actions, c.Stop) == []
    new = lease_one(state, clock, connection=OTHER)  # the old one does not count against max_replicas
    assert new.rid != old.rid and replica(state, new.rid).version == "v2"
    stop = one(state.handle(clock(), ev.LeaseReleased(old.lease, CONN, "ok")).actions, c.Stop)
    assert stop.cause is StopCause.DRAINED and not stop.kill


def test_a_lifecycle_only_edit_applies_in_place(clock):
    state = make(clock, Spec(idle_timeout_s=600))
    grant = lease_one(state, clock)
    state.handle(clock(), ev.LeaseReleased(grant.lease, CONN, "ok"))
    state.handle(clock(), ev.ManifestRead("m", "m", "v1", "fp1", Spec(idle_timeout_s=5)))
    clock.advance(6)
    assert one(state.handle(clock(), ev.Tick()).actions, c.Stop).cause is StopCause.IDLE


# -- liveness ------------------------------------------------------------------------------------------------
def test_an_idle_worker_is_pinged_every_ping_interval_and_stopped_when_it_does_not_answer(clock):
    state = make(clock, Spec(ping_interval_s=30), liveness_timeout_s=10)
    grant = lease_one(state, clock)
    state.handle(clock(), ev.LeaseReleased(grant.lease, CONN, "ok"))
    clock.advance(29)
    assert of(state.handle(clock(), ev.Tick()).actions, c.Ping) == []
    clock.advance(1)
    ping = one(state.handle(clock(), ev.Tick()).actions, c.Ping)
    assert ping.purpose == "liveness" and ping.timeout_s == 10
    assert replica(state, grant.rid).state is R.CHECKING
    stop = one(state.handle(clock(), ev.Pinged(grant.rid, "liveness", answered=False)).actions, c.Stop)
    assert stop.cause is StopCause.UNRESPONSIVE and "within 10 s" in stop.why


def test_a_liveness_ping_the_pool_could_not_send_is_not_held_against_the_worker(clock):
    state = make(clock, Spec(ping_interval_s=30))
    grant = lease_one(state, clock)
    state.handle(clock(), ev.LeaseReleased(grant.lease, CONN, "ok"))
    clock.advance(30)
    one(state.handle(clock(), ev.Tick()).actions, c.Ping)
    actions = state.handle(clock(), ev.Pinged(grant.rid, "liveness", answered=False, failure="OSError: [Errno 24] EMFILE")).actions
    assert of(actions, c.Stop) == [] and replica(state, grant.rid).state is R.READY
    assert "not its fault" in one(actions, c.Note).text


def test_a_request_during_a_liveness_ping_waits_for_the_pinged_worker_instead_of_starting_another(clock):
    state = make(clock, Spec(ping_interval_s=30, max_replicas=4))
    grant = lease_one(state, clock)
    state.handle(clock(), ev.LeaseReleased(grant.lease, CONN, "ok"))
    clock.advance(30)
    state.handle(clock(), ev.Tick())
    decision = state.handle(clock(), ev.ClientAsked("m", OTHER, {}))
    ticket, actions = decision.ticket, decision.actions
    assert actions == []  # no second replica for a health check
    assert one(state.handle(clock(), ev.Pinged(grant.rid, "liveness", answered=True)).actions, c.Grant).ticket == ticket


def test_a_liveness_ping_that_never_reports_is_overdue(clock):
    state = make(clock, Spec(ping_interval_s=30), liveness_timeout_s=10)
    grant = lease_one(state, clock)
    state.handle(clock(), ev.LeaseReleased(grant.lease, CONN, "ok"))
    clock.advance(30)
    state.handle(clock(), ev.Tick())
    clock.advance(10 + 15)
    stop = one(state.handle(clock(), ev.Tick()).actions, c.Stop)
    assert stop.cause is StopCause.OVERDUE and "liveness ping did not report back" in stop.why


# -- ends of requests ------------------------------------------------------------------------------------
def test_a_request_past_its_timeout_kills_the_worker(clock):
    state = make(clock, Spec(request_timeout_s=1))
    grant = lease_one(state, clock)
    stop = one(state.handle(clock(), ev.LeaseReleased(grant.lease, CONN, "timeout")).actions, c.Stop)
    assert stop.cause is StopCause.TIMEOUT and stop.kill and "request_timeout_s = 1 s" in stop.why


def test_a_worker_that_died_between_requests_is_forgotten_and_the_next_request_starts_another(clock):
    state = make(clock)
    grant = lease_one(state, clock)
    state.handle(clock(), ev.LeaseReleased(grant.lease, CONN, "ok"))
    stop = one(state.handle(clock(), ev.WorkerExited(grant.rid, -9)).actions, c.Stop)
    assert stop.cause is StopCause.DIED and "exited while idle" in stop.why
    state.handle(clock(), ev.WorkerStopped(grant.rid))
    assert one(state.handle(clock(), ev.ClientAsked("m", CONN, {})).actions, c.Start).rid != grant.rid


def test_a_release_by_another_connection_is_refused_and_changes_nothing(clock):
    state = make(clock)
    grant = lease_one(state, clock)
    with pytest.raises(Exception, match="not held by this connection"):
        state.handle(clock(), ev.LeaseReleased(grant.lease, OTHER, "ok"))
    assert replica(state, grant.rid).state is R.LEASED


def test_a_subprocess_mode_worker_serves_one_lease_and_is_never_handed_out_again(clock):
    state = make(clock, Spec(mode="subprocess"))
    grant = lease_one(state, clock)
    state.handle(clock(), ev.ClientAsked("m", OTHER, {}))
    actions = state.handle(clock(), ev.LeaseReleased(grant.lease, CONN, "ok")).actions
    assert one(actions, c.Stop).cause is StopCause.ONE_LEASE and of(actions, c.Grant) == []
    assert one(actions, c.Start).rid != grant.rid  # a fresh worker for the next lease


# -- starts and the breaker -------------------------------------------------------------------------------
def test_a_refusal_at_start_opens_the_breaker_and_every_waiter_is_refused_at_once_with_its_reason(clock):
    state = make(clock, Spec(max_replicas=1), breaker_cooldown_s=300)
    decision = state.handle(clock(), ev.ClientAsked("m", 1, {}))
    first, actions = decision.ticket, decision.actions
    start = one(actions, c.Start)
    second = state.handle(clock(), ev.ClientAsked("m", 2, {})).ticket
    refusal = WorkerStartError("m: exited 3: refused", reason="start_failed", exit_code=3)
    actions = state.handle(clock(), ev.StartFailed(start.rid, refusal)).actions
    refused = {r.ticket: r.error for r in of(actions, c.Refuse)}
    assert refused[first].headline == refusal.headline and refused[first].details["breaker_opened"]
    assert isinstance(refused[second], BreakerOpen) and refused[second].reason == "breaker_open"
    assert refused[second].details["original"]["exit_code"] == 3 and "resident-pool stop m" in str(refused[second])
    assert of(actions, c.Start) == []
    actions = state.handle(clock(), ev.ClientAsked("m", 3, {})).actions
    assert one(actions, c.Refuse).error.details["breaker"]["closes_in_s"] == 300
    clock.advance(301)
    assert of(state.handle(clock(), ev.ClientAsked("m", 4, {})).actions, c.Start)


def test_three_failed_starts_in_a_row_open_the_breaker_and_a_manifest_edit_closes_it(clock):
    state = make(clock)
    for n in range(3):
        actions = state.handle(clock(), ev.ClientAsked("m", n, {})).actions
        state.handle(clock(), ev.StartFailed(one(actions, c.Start).rid, WorkerStartError("m: exited 1", exit_code=1)))
    assert isinstance(one(state.handle(clock(), ev.ClientAsked("m", 9, {})).actions, c.Refuse).error, BreakerOpen)
    state.handle(clock(), ev.ManifestRead("m", "m", "v2", "fp2", Spec()))
    assert of(state.handle(clock(), ev.ClientAsked("m", 10, {})).actions, c.Start)


def test_a_start_that_never_reports_is_overdue_and_its_process_killed(clock):
    state = make(clock, Spec(admission_timeout_s=10, start_timeout_s=20))
    actions = state.handle(clock(), ev.ClientAsked("m", CONN, {})).actions
    start = one(actions, c.Start)
    state.handle(clock(), ev.WorkerSpawned(start.rid, 77))
    clock.advance(10 + 20 + 16)
    stop = one(state.handle(clock(), ev.Tick()).actions, c.Stop)
    assert stop.cause is StopCause.OVERDUE and stop.kill and replica(state, start.rid).state is R.STOPPING


# -- stopping ------------------------------------------------------------------------------------------------------
def test_a_stop_that_raises_is_retried_with_sigkill_and_never_left_stopping(clock):
    state = make(clock)
    grant = lease_one(state, clock)
    state.handle(clock(), ev.LeaseReleased(grant.lease, CONN, "ok"))
    one(state.handle(clock(), ev.StopAsked("m", False, "stopped by `resident-pool stop`")).actions, c.Stop)
    for attempt in range(STOP_ATTEMPTS):
        retry = one(state.handle(clock(), ev.WorkerStopped(grant.rid, failure="OSError: [Errno 24] Too many open files")).actions, c.Stop)
        assert retry.kill, attempt
    gone = one(state.handle(clock(), ev.WorkerStopped(grant.rid, failure="OSError: [Errno 24] Too many open files")).actions, c.Gone)
    assert "did not end" in gone.why and state.replicas == {}


def test_a_stop_that_never_reports_is_escalated_then_given_up(clock):
    state = make(clock, stop_overdue_s=60)
    grant = lease_one(state, clock)
    state.handle(clock(), ev.LeaseReleased(grant.lease, CONN, "ok"))
    state.handle(clock(), ev.StopAsked("m", False, "stop"))
    kills = 0
    for _ in range(STOP_ATTEMPTS + 1):
        clock.advance(61)
        actions = state.handle(clock(), ev.Tick()).actions
        kills += len(of(actions, c.Stop))
    assert kills == STOP_ATTEMPTS and state.replicas == {}


def test_the_pool_stopping_lets_a_leased_request_finish_then_stops_its_worker(clock):
    state = make(clock, drain_grace_s=60)
    grant = lease_one(state, clock)
    state.handle(clock(), ev.ClientAsked("m", OTHER, {}))
    actions = state.handle(clock(), ev.ShutdownAsked("signal SIGTERM")).actions
    assert isinstance(one(actions, c.Refuse).error, PoolStopping) and of(actions, c.Stop) == []
    assert isinstance(one(state.handle(clock(), ev.ClientAsked("m", 5, {})).actions, c.Refuse).error, PoolStopping)
    stop = one(state.handle(clock(), ev.LeaseReleased(grant.lease, CONN, "ok")).actions, c.Stop)
    assert stop.cause is StopCause.POOL_STOPPING


def test_a_lease_still_held_after_the_drain_grace_is_stopped_anyway(clock):
    state = make(clock, drain_grace_s=60)
    grant = lease_one(state, clock)
    state.handle(clock(), ev.StopAsked("m", False, "stopped by `resident-pool stop`"))
    clock.advance(59)
    assert of(state.handle(clock(), ev.Tick()).actions, c.Stop) == []
    clock.advance(2)
    stop = one(state.handle(clock(), ev.Tick()).actions, c.Stop)
    assert "still busy after drain_grace_s = 60 s" in stop.why and replica(state, grant.rid).state is R.STOPPING


def test_stop_now_on_a_starting_worker_calls_its_start_off(clock):
    state = make(clock)
    actions = state.handle(clock(), ev.ClientAsked("m", CONN, {})).actions
    start = one(actions, c.Start)
    state.handle(clock(), ev.WorkerSpawned(start.rid, 55))
    assert of(state.handle(clock(), ev.StopAsked("m", True, "stop --now")).actions, c.Stop) == []
    assert replica(state, start.rid).abort is not None
    actions = state.handle(clock(), ev.StartFailed(start.rid, WorkerStartError("stopped while it started",
                                                                      reason="start_cancelled"))).actions
    assert one(actions, c.Refuse).error.reason == "start_cancelled"


def test_the_pool_exits_after_quiet_exit_s_with_no_workers_and_no_clients(clock):
    state = make(clock, quiet_exit_s=600)
    clock.advance(599)
    assert of(state.handle(clock(), ev.Tick(connections=0)).actions, c.Exit) == []
    clock.advance(2)
    assert of(state.handle(clock(), ev.Tick(connections=1)).actions, c.Exit) == []  # a client connected: quiet starts again
    clock.advance(599)
    assert of(state.handle(clock(), ev.Tick(connections=0)).actions, c.Exit) == []
    clock.advance(2)
    assert one(state.handle(clock(), ev.Tick(connections=0)).actions, c.Exit).why == "quiet"


# -- kept-warm and hibernation (eviction and the GPU line: test_core_admission.py) -----------------------------------
def _admitted_ready(state: PoolState, clock: Clock, key: str, device: int = 0) -> int:
    """A replica of ``key`` started through the GPU line, placed on ``device``, leased once and released."""
    actions = state.handle(clock(), ev.ClientAsked(key, CONN, {})).actions
    start = one(actions, c.Start)
    one(state.handle(clock(), ev.StartPrepared(start.rid, state.providers[key].spec.budget_gb)).actions, c.Place)
    one(state.handle(clock(), ev.BudgetPlaced(start.rid, device)).actions, c.Spawn)
    grant = one(state.handle(clock(), ev.WorkerStarted(start.rid, 4242)).actions, c.Grant)
    state.handle(clock(), ev.LeaseReleased(grant.lease, CONN, "ok"))
    return grant.rid


def _gpu(**kw) -> Spec:
    return Spec(budget_gb=4, ping_interval_s=10_000, **kw)


def _gpu_pool(clock: Clock, key: str, spec: Spec | None = None) -> PoolState:
    """``key`` (4 GB, or ``spec``) beside ``head``, a 4 GB provider whose start ``_make_room`` asks for."""
    state = PoolState(Timings(), clock())
    state.handle(clock(), ev.ManifestRead(key, key, "v", "f", spec or _gpu()))
    state.handle(clock(), ev.ManifestRead("head", "head", "v", "f", _gpu()))
    return state


def _kept_on_gpu(state: PoolState, clock: Clock, key: str) -> c.Grant:
    """``key`` started through the GPU line on device 0 and leased as Pool.predict keeps it; then its holder stops
    calling (idle between calls)."""
    start = one(state.handle(clock(), ev.ClientAsked(key, CONN, {}, keep=True)).actions, c.Start)
    one(state.handle(clock(), ev.StartPrepared(start.rid, 4)).actions, c.Place)
    one(state.handle(clock(), ev.BudgetPlaced(start.rid, 0)).actions, c.Spawn)
    kept = one(state.handle(clock(), ev.WorkerStarted(start.rid, 1, True)).actions, c.Grant)
    clock.advance(Timings().kept_active_s)
    return kept


def _make_room(state: PoolState, clock: Clock) -> list[c.Action]:
    """A start of ``head`` (4 GB) finds the card full: what the GPU line does to make room for it."""
    start = one(state.handle(clock(), ev.ClientAsked("head", OTHER, {})).actions, c.Start)
    place = one(state.handle(clock(), ev.StartPrepared(start.rid, 4)).actions, c.Place)
    return state.handle(clock(), ev.BudgetNotPlaced(place.rid, {0: 0.0})).actions


def test_a_kept_warm_worker_is_exempt_from_idle_retirement(clock):
    state = PoolState(Timings(), clock())
    state.handle(clock(), ev.ManifestRead("warm", "warm", "v", "f", Spec(budget_gb=4, min_replicas=1, idle_timeout_s=1,
                                                          ping_interval_s=10_000)))
    warm = _admitted_ready(state, clock, "warm")
    clock.advance(100)
    assert of(state.handle(clock(), ev.Tick()).actions, c.Stop) == []  # idle 100 s past its 1 s timeout, but kept warm
    assert replica(state, warm).state is R.READY


def test_kept_warm_providers_are_topped_up_but_not_while_requests_wait_for_memory(clock):
    state = PoolState(Timings(keep_warm_s=5), clock())
    state.handle(clock(), ev.ManifestRead("w", "w", "v", "f", Spec(min_replicas=2)))
    state.handle(clock(), ev.ManifestRead("g", "g", "v", "f", _gpu()))
    start = one(state.handle(clock(), ev.ClientAsked("g", CONN, {})).actions, c.Start)
    one(state.handle(clock(), ev.StartPrepared(start.rid, 4)).actions, c.Place)
    state.handle(clock(), ev.BudgetNotPlaced(start.rid, {0: 1.0}))  # it waits for memory
    assert of(state.handle(clock(), ev.Tick()).actions, c.Start) == []
    state.handle(clock(), ev.TicketGone(next(iter(state.tickets))))
    clock.advance(5)
    starts = of(state.handle(clock(), ev.Tick()).actions, c.Start)
    assert len(starts) == 2 and all(not s.wait and s.ticket is None for s in starts)
    clock.advance(5)
    assert of(state.handle(clock(), ev.Tick()).actions, c.Start) == []  # the two starting count


def test_a_hibernated_worker_gives_its_budget_back_and_its_next_lease_restores_it(clock):
    state = _gpu_pool(clock, "h", _gpu(evict="hibernate"))
    rid = _admitted_ready(state, clock, "h")
    one(state.handle(clock(), ev.HostRecall(rid, "another pool's request needs it")).actions, c.Hibernate)
    assert replica(state, rid).state is R.HIBERNATING
    one(state.handle(clock(), ev.HibernationEnded(rid, True, "evicted")).actions, c.ReleaseBudget)
    assert replica(state, rid).state is R.HIBERNATED and not replica(state, rid).admitted
    start = one(state.handle(clock(), ev.ClientAsked("h", CONN, {})).actions, c.Start)
    assert start.rid == rid and start.restore
    assert one(state.handle(clock(), ev.StartPrepared(rid, 4, 0)).actions, c.Place).device == 0  # its memory goes back where it was
    one(state.handle(clock(), ev.BudgetPlaced(rid, 0)).actions, c.Spawn)
    assert one(state.handle(clock(), ev.WorkerStarted(rid, 1)).actions, c.Grant).cold


# -- the core is pure, and alone changes the records ------------------------------------------------------------------
PACKAGE = Path(resident_pool.__file__).parent
ALLOWED_IMPORTS = {"__future__", "itertools", "dataclasses", "typing", "enum", "collections"}
# The decision core: its face, its two owners (replicas; the waiting line and leases), its records and actions.
CORE = ("core.py", "lifecycle.py", "drains.py", "leases.py", "admitting.py", "replica.py", "states.py", "breaker.py",
        "actions.py", "events.py", "view.py", "starting.py", "holding.py")
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


RECORD_FIELDS = {"state", "holds", "retire", "abort", "deadline", "drain_by", "for_ticket", "last_used",
                 "last_checked", "served", "stop", "leases", "tickets", "queue", "replicas", "stopping", "version",
                 "kept", "recall", "check", "eviction", "drain", "can_recall", "noticed", "heard", "admitted",
                 "in_flight_since", "probes", "stop_attempts", "fresh", "last_error", "noticed_before",
                 "queue_wait_s", "idle_seen_s"}
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
    ping = one(state.handle(clock(), ev.Tick()).actions, c.Ping)
    assert ping.purpose == "liveness" and replica(state, kept.rid).state is R.LEASED
    assert of(state.handle(clock(), ev.Tick()).actions, c.Ping) == []  # one at a time
    stop = one(state.handle(clock(), ev.Pinged(kept.rid, "liveness", answered=False)).actions, c.Stop)
    assert stop.cause is StopCause.UNRESPONSIVE and stop.kill


# -- kept leases: the outside review's findings ------------------------------------------------------------
def _kept_in_use(state: PoolState, clock: Clock, key: str = "m") -> c.Grant:
    kept = lease_one(state, clock, key, keep=True)
    state.handle(clock(), ev.LeaseUsed(kept.lease, CONN, 1))
    return kept


def test_a_kept_lease_busy_with_a_long_request_is_not_retired_as_idle(clock):
    state = make(clock, Spec(idle_timeout_s=2, ping_interval_s=1000))
    kept = _kept_in_use(state, clock)
    clock.advance(3)  # the client said nothing for 3 s: it may be idle, or in one long request
    one(state.handle(clock(), ev.Tick()).actions, c.Recall)
    actions = state.handle(clock(), ev.LeaseRecalled(kept.lease, idle_s=0.1, served=2)).actions  # the worker: it just finished one
    assert of(actions, c.Stop) == [] and replica(state, kept.rid).state is R.READY
    assert replica(state, kept.rid).served == 2  # the notice's 1, and the one more the worker counted


def test_a_kept_lease_idle_past_its_timeout_by_its_workers_word_is_retired(clock):
    state = make(clock, Spec(idle_timeout_s=2, ping_interval_s=1000))
    kept = _kept_in_use(state, clock)
    clock.advance(3)
    one(state.handle(clock(), ev.Tick()).actions, c.Recall)
    assert one(state.handle(clock(), ev.LeaseRecalled(kept.lease, idle_s=3.0, served=1)).actions, c.Stop).cause is StopCause.IDLE


def test_a_recall_the_pool_could_not_send_keeps_the_lease_and_is_tried_again(clock):
    state = make(clock)
    kept = _kept_in_use(state, clock)
    actions = state.handle(clock(), ev.ClientAsked("m", OTHER, {})).actions
    one(actions, c.Recall)
    actions = state.handle(clock(), ev.LeaseRecalled(kept.lease, failure="OSError: [Errno 24] Too many open files")).actions
    assert of(actions, c.Stop) == [] and "not its fault" in one(actions, c.Note).text
    assert replica(state, kept.rid).state is R.LEASED and kept.lease in state.leases
    assert one(state.handle(clock(), ev.Tick()).actions, c.Recall).lease == kept.lease  # the next look tries again


def test_a_recall_keeps_its_deadline_across_a_liveness_ping(clock):
    state = make(clock, Spec(ping_interval_s=30, request_timeout_s=60))
    kept = _kept_in_use(state, clock)
    clock.advance(30)
    one(state.handle(clock(), ev.Tick()).actions, c.Ping)
    one(state.handle(clock(), ev.ClientAsked("m", OTHER, {})).actions, c.Recall)
    state.handle(clock(), ev.Pinged(kept.rid, "liveness", answered=True))
    assert replica(state, kept.rid).deadline is not None  # the recall's still stands
    clock.advance(60 + 16)
    assert one(state.handle(clock(), ev.Tick()).actions, c.Stop).cause is StopCause.OVERDUE


def test_an_eviction_overtaken_by_a_release_is_forgotten(clock):
    state = _gpu_pool(clock, "g")
    kept = _kept_on_gpu(state, clock, "g")
    one(_make_room(state, clock), c.Recall)
    state.handle(clock(), ev.LeaseReleased(kept.lease, CONN, "ok"))  # its client gave it back first
    assert replica(state, kept.rid).eviction is None


def test_admission_skips_a_kept_lease_the_runtime_found_busy(clock):
    state = _gpu_pool(clock, "g")
    kept = _kept_on_gpu(state, clock, "g")
    state.handle(clock(), ev.Tick(in_flight={kept.rid: 0.5}))  # a request runs on it: its holder is calling
    assert of(_make_room(state, clock), c.Recall) == []


def test_a_lease_still_held_after_the_drain_grace_is_killed_not_asked(clock):
    state = make(clock, drain_grace_s=2)
    lease_one(state, clock)
    state.handle(clock(), ev.ShutdownAsked("signal SIGTERM"))
    clock.advance(3)
    assert one(state.handle(clock(), ev.Tick()).actions, c.Stop).kill  # within drain_grace_s plus the kill grace


def test_a_kept_lease_ends_with_its_replica_and_the_pool_is_idle_again(clock):
    state = make(clock)
    kept = _kept_in_use(state, clock)
    one(state.handle(clock(), ev.StopAsked("m", True, "stop --now")).actions, c.Stop)
    state.handle(clock(), ev.WorkerStopped(kept.rid))
    assert kept.lease not in state.leases and state.view(clock()).resting


def test_stop_and_shutdown_take_a_kept_lease_back_first(clock):
    state = make(clock)
    kept = _kept_in_use(state, clock)
    assert one(state.handle(clock(), ev.StopAsked("m", False, "stopped by `resident-pool stop`")).actions, c.Recall).lease == kept.lease
    stop = one(state.handle(clock(), ev.LeaseRecalled(kept.lease, served=1)).actions, c.Stop)
    assert stop.cause is StopCause.STOPPED and not stop.kill
    other = make(clock)
    kept = _kept_in_use(other, clock)
    assert one(other.handle(clock(), ev.ShutdownAsked("signal SIGTERM")).actions, c.Recall).lease == kept.lease


def test_a_kept_lease_evicted_for_a_hibernating_provider_hibernates_once_back(clock):
    state = _gpu_pool(clock, "h", _gpu(evict="hibernate"))
    kept = _kept_on_gpu(state, clock, "h")
    one(_make_room(state, clock), c.Recall)
    one(state.handle(clock(), ev.LeaseRecalled(kept.lease, served=1)).actions, c.Hibernate)


def test_a_kept_lease_holder_that_disconnects_between_calls_frees_its_worker_after_a_ping(clock):
    state = make(clock)
    kept = _kept_in_use(state, clock)
    one(state.handle(clock(), ev.ConnectionClosed(CONN)).actions, c.Ping)
    assert one(state.handle(clock(), ev.ClientAsked("m", OTHER, {})).actions + state.handle(clock(), ev.Pinged(kept.rid, "abandon", True)).actions,
               c.Grant).rid == kept.rid


def test_a_used_notice_from_another_connection_changes_nothing(clock):
    state = make(clock, Spec(idle_timeout_s=10, ping_interval_s=1000))
    kept = lease_one(state, clock, keep=True)
    clock.advance(9)
    state.handle(clock(), ev.LeaseUsed(kept.lease, OTHER, 5))
    assert replica(state, kept.rid).served == 0 and replica(state, kept.rid).idle_s(clock()) == 9


def test_a_hibernated_worker_idle_past_its_timeout_is_killed(clock):
    state = _gpu_pool(clock, "h", Spec(budget_gb=4, idle_timeout_s=60, ping_interval_s=10_000, evict="hibernate"))
    rid = _admitted_ready(state, clock, "h")
    one(_make_room(state, clock), c.Hibernate)
    state.handle(clock(), ev.HibernationEnded(rid, True, "evicted"))
    clock.advance(61)
    stop = one(state.handle(clock(), ev.Tick()).actions, c.Stop)
    assert stop.cause is StopCause.IDLE and stop.kill  # its CUDA is locked: it can only be ended


def test_a_worker_over_its_budget_is_retired_once_its_lease_ends(clock):
    state = make(clock)
    grant = lease_one(state, clock)
    assert state.handle(clock(), ev.RetireAsked(grant.rid, StopCause.OVER_BUDGET, "over its budget")).actions == []
    assert replica(state, grant.rid).state is R.DRAINING
    assert one(state.handle(clock(), ev.LeaseReleased(grant.lease, CONN, "ok")).actions, c.Stop).cause is StopCause.OVER_BUDGET

