"""Review r22: the decision core's kept-lease rules, driven with a fake clock (each test fails at 94b768c).

Each test names the defect it shows; helpers are test_core's own.
"""

from __future__ import annotations

import dataclasses

import pytest
from test_core import (
    CONN,
    OTHER,
    Clock,
    _gpu,
    lease_one,
    make,
    of,
    one,
    replica,
)

from resident_pool.server import actions as c
from resident_pool.server.actions import Timings
from resident_pool.server.core import PoolState
from resident_pool.server.replica import Replica, Spec
from resident_pool.server.states import ReplicaState

R = ReplicaState
THIRD = 3


@pytest.fixture
def clock():
    return Clock()


def test_r22_a_recall_that_overlaps_a_liveness_ping_still_has_a_deadline(clock):
    """A kept lease between calls gets its liveness ping (``checking``); a client then waits and the core recalls
    the lease. The ping's answer clears ``replica.deadline`` -- the recall's deadline with it -- so a recall that
    never reports (the pool could not send it: EMFILE; the worker hung right after the ping) leaves the replica
    LEASED and ``recalling`` forever: no deadline, no liveness ping (``kept_idle`` is false while recalling),
    and the waiting client is refused only at admission_timeout_s, with the worker still held."""
    state = make(clock, Spec(max_replicas=1, ping_interval_s=30, idle_timeout_s=0, request_timeout_s=60))
    kept = lease_one(state, clock, keep=True)
    clock.advance(31)
    one(state.tick(clock()), c.Ping)  # liveness, between calls
    _ticket, actions = state.acquire(clock(), "m", OTHER, {}, True)
    one(actions, c.Recall)
    assert replica(state, kept.rid).deadline is not None  # the recall's: request_timeout_s + report margin
    state.pinged(clock(), kept.rid, "liveness", answered=True)  # the ping answers; the recall never does
    stops = []
    for _ in range(240):  # two hours, a tick every 30 s
        clock.advance(30)
        stops += of(state.tick(clock()), c.Stop)
    assert stops, (f"still {replica(state, kept.rid).state} with recalling={replica(state, kept.rid).recalling} "
                   f"and deadline={replica(state, kept.rid).deadline} two hours after a recall that never reported")


def test_r22_a_freshly_granted_kept_lease_is_not_recalled_before_its_holder_used_it(clock):
    """Three clients of a max_replicas = 1 provider through Pool.predict. When the kept lease comes back, the
    next waiter is granted a kept lease AND, in the same breath, that lease is recalled for the waiter behind
    it -- before its holder could send a single request. Its request is then refused (lease_recalled), it
    queues again, and the same happens to the next: a grant is wasted per hand-over, and after
    _RECALLED_RETRIES (5) refusals in a row Pool.predict raises lease_recalled to its caller."""
    state = make(clock, Spec(max_replicas=1))
    first = lease_one(state, clock, keep=True)
    second, _ = state.acquire(clock(), "m", OTHER, {}, True)
    state.acquire(clock(), "m", THIRD, {}, True)
    actions = state.recalled(clock(), first.lease)
    grant = one(actions, c.Grant)
    assert grant.ticket == second and grant.kept
    assert of(actions, c.Recall) == [], "the lease just granted is recalled before its holder sent a request"


def test_r22_an_eviction_that_was_overtaken_does_not_evict_the_replica_later_for_nothing(clock):
    """Admission asks to evict a kept lease (``evict_for`` is set and a recall goes out); before the recall
    answers, the holder's connection closes (abandon -> DRAINING -> ready again). ``unlease`` clears
    kept/recalling/checking but not ``evict_for``. Much later the replica holds another kept lease that is
    recalled for an ordinary waiter of the same provider: the stale ``evict_for`` makes ``recalled`` evict it,
    so the waiter it was recalled for gets a cold start instead of the warm worker."""
    state = PoolState(Timings(), clock())
    state.register(clock(), "g", "g", "v", "f", _gpu(max_replicas=1))
    _t, actions = state.acquire(clock(), "g", CONN, {}, True)
    start = one(actions, c.Start)
    state.admitted(clock(), start.rid, "0")
    kept = one(state.started(clock(), start.rid, 1, True), c.Grant)
    one(state.evict(clock(), kept.rid, 4), c.Recall)  # admission needs 4 GB
    state.connection_closed(clock(), CONN)  # the holder is killed meanwhile
    state.pinged(clock(), kept.rid, "abandon", answered=True)  # nothing was in flight: ready again
    assert replica(state, kept.rid).state is R.READY
    state.recalled(clock(), kept.lease)  # the recall's answer arrives late: ignored (the lease is gone)
    # Admission's need went away (its request was satisfied elsewhere, or timed out).
    clock.advance(600)
    again = lease_one(state, clock, "g", connection=OTHER, keep=True)  # warm: same replica, kept
    assert again.rid == kept.rid and again.kept
    waiting, actions = state.acquire(clock(), "g", THIRD, {})
    one(actions, c.Recall)
    actions = state.recalled(clock(), again.lease)
    assert of(actions, c.Stop) == [], f"a stale evict_for evicted the warm worker its waiter was recalled for: {actions}"
    assert one(actions, c.Grant).ticket == waiting


def test_r22_a_kept_lease_of_a_replica_stopped_now_does_not_stay_a_lease_forever(clock):
    """`resident-pool stop --now` (or a death between calls) ends a replica whose kept lease sits with a client
    that is between calls. The lease stays in the core's books until that client calls again or disconnects --
    for an idle notebook, forever -- so ``idle()`` stays false and a client of a newer version is told
    version_mismatch ("holds workers") by a pool that holds none."""
    state = make(clock)
    kept = lease_one(state, clock, keep=True)
    _targets, actions = state.stop(clock(), "m", True, "stop --now")
    one(actions, c.Stop)
    one(state.stopped(clock(), kept.rid), c.Gone)
    assert state.replicas == {}
    assert state.leases == {} and state.idle(), f"leases still booked for a replica that is gone: {state.leases}"


def test_r22_the_purity_check_covers_every_field_of_a_replica():
    """test_core's "only the decision core assigns replica and lease state" reads assignments to RECORD_FIELDS
    only: the kept lease's own fields (kept, recalling, checking, evict_for, can_recall) and others (pid, device,
    admitted, hibernated, probes, stop_attempts, fresh) are not in it, so code outside the core could set
    ``replica.recalling = False`` and the check would pass."""
    from test_core import RECORD_FIELDS

    fields = {f.name for f in dataclasses.fields(Replica)} - {"rid", "key", "index", "budget_gb", "since"}
    assert fields <= RECORD_FIELDS, f"not guarded: {sorted(fields - RECORD_FIELDS)}"
