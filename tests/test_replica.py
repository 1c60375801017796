"""The replica state table: every allowed move, and every other move refused."""

from __future__ import annotations

import itertools

import pytest

from resident_pool.server.replica import Replica, ReplicaTransitionError
from resident_pool.server.states import REPLICA_EDGES, ReplicaState


def replica_in(state: ReplicaState) -> Replica:
    return Replica(1, "demo", 0, "v1", None, 100.0, state=state)  # placed there: the test is of the move out


ALLOWED = [(a, b) for a, targets in REPLICA_EDGES.items() for b in sorted(targets)]
REFUSED = [(a, b) for a, b in itertools.product(ReplicaState, ReplicaState) if b not in REPLICA_EDGES[a]]


def test_the_table_names_every_state_and_leaves_stopped_and_failed_final():
    assert set(REPLICA_EDGES) == set(ReplicaState)
    assert REPLICA_EDGES[ReplicaState.STOPPED] == REPLICA_EDGES[ReplicaState.FAILED] == frozenset()


@pytest.mark.parametrize(("old", "new"), ALLOWED)
def test_an_allowed_move_happens(old, new):
    replica = replica_in(old)
    replica.transition(new, "because")
    assert replica.state is new


@pytest.mark.parametrize(("old", "new"), REFUSED)
def test_any_other_move_raises_and_changes_nothing(old, new):
    replica = replica_in(old)
    with pytest.raises(ReplicaTransitionError, match=f"{old} -> {new}"):
        replica.transition(new, "because")
    assert replica.state is old


def test_idle_time_counts_only_while_ready_or_hibernated():
    replica = replica_in(ReplicaState.LEASED)
    assert replica.idle_s(160.0) == 0.0  # leased for a minute is busy, not idle
    replica.transition(ReplicaState.READY)
    replica.last_used = 160.0
    assert replica.idle_s(190.0) == 30.0
    replica.transition(ReplicaState.CHECKING)
    assert replica.idle_s(190.0) == 0.0
