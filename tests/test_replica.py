"""The replica state table: every allowed move, and every other move refused."""

from __future__ import annotations

import itertools

import pytest

from resident_pool.server.replica import Lease, Replica, ReplicaTransitionError
from resident_pool.server.states import REPLICA_EDGES, ReplicaState


class FakeProcess:
    pid = 4242

    def __init__(self):
        self.notes = []

    def note(self, message):
        self.notes.append(message)


def replica_in(state: ReplicaState) -> Replica:
    replica = Replica("demo", 0, "v1", FakeProcess(), None, clock=lambda: 100.0)
    replica.state = state  # placed there directly: the test is of the move out of it
    return replica


ALLOWED = [(a, b) for a, targets in REPLICA_EDGES.items() for b in sorted(targets)]
REFUSED = [(a, b) for a, b in itertools.product(ReplicaState, ReplicaState) if b not in REPLICA_EDGES[a]]


def test_the_table_names_every_state_and_leaves_stopped_and_failed_final():
    assert set(REPLICA_EDGES) == set(ReplicaState)
    assert REPLICA_EDGES[ReplicaState.STOPPED] == frozenset() == REPLICA_EDGES[ReplicaState.FAILED]
    assert len(ALLOWED) == 16 and len(ALLOWED) + len(REFUSED) == len(ReplicaState) ** 2


@pytest.mark.parametrize(("old", "new"), ALLOWED, ids=[f"{a}->{b}" for a, b in ALLOWED])
def test_an_allowed_move_happens(old, new):
    replica = replica_in(old)
    replica.transition(new, "because")
    assert replica.state is new


@pytest.mark.parametrize(("old", "new"), REFUSED, ids=[f"{a}->{b}" for a, b in REFUSED])
def test_any_other_move_raises_and_changes_nothing(old, new):
    replica = replica_in(old)
    with pytest.raises(ReplicaTransitionError, match=f"{old} -> {new} is not an allowed move"):
        replica.transition(new, "because")
    assert replica.state is old


def test_a_move_out_of_service_is_noted_in_the_transcript_with_its_reason():
    replica = replica_in(ReplicaState.LEASED)
    replica.transition(ReplicaState.DRAINING, "its client went away")
    assert replica.process.notes == ["leased -> draining: its client went away"]


def test_idle_time_counts_only_while_ready():
    now = [100.0]
    replica = Replica("demo", 0, "v1", FakeProcess(), None, clock=lambda: now[0])
    replica.state = ReplicaState.LEASED
    now[0] = 160.0
    assert replica.idle_s() == 0.0  # leased for a minute is busy, not idle
    replica.transition(ReplicaState.READY)
    replica.last_used = now[0]
    now[0] = 190.0
    assert replica.idle_s() == 30.0


def test_admission_and_the_ledger_know_it_by_slug_replica_and_pid():
    replica = Replica("demo", 3, "v1", FakeProcess(), 6.0)
    lease = Lease(object(), replica)
    assert (replica.slug, replica.replica, replica.pid, replica.vram_budget_gb) == ("demo", 3, 4242, 6.0)
    assert lease.replica is replica and lease.id != Lease(None, replica).id
