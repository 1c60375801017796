"""Replica states and the replica's allowed transitions; no internal imports."""

from __future__ import annotations

import enum

__all__ = ["REPLICA_EDGES", "ReplicaState"]


class ReplicaState(enum.StrEnum):
    """A replica in the host pool; the pool is the only thing that moves it."""

    STARTING = "starting"  # admission, spawn, first ping; already promised to the client that asked
    READY = "ready"  # answering, between requests, held by nobody
    LEASED = "leased"  # held by one client (or by the pool for a liveness ping)
    DRAINING = "draining"  # a request may still run (an abandoned one, or an old version's); never handed out
    STOPPING = "stopping"
    STOPPED = "stopped"
    FAILED = "failed"  # its start failed
    HIBERNATING = "hibernating"  # evicted: its device memory is being checkpointed to host memory
    HIBERNATED = "hibernated"  # holds no device memory; the process waits, and its next lease restores it


# The only moves a replica may make; anything else is a bug and raises.
REPLICA_EDGES: dict[ReplicaState, frozenset[ReplicaState]] = {
    # A start runs to its end (its own thread owns the process meanwhile); a stop asked for
    # during it is recorded and acted on once it is over.
    ReplicaState.STARTING: frozenset({ReplicaState.LEASED, ReplicaState.READY, ReplicaState.FAILED}),
    ReplicaState.READY: frozenset({ReplicaState.LEASED, ReplicaState.STOPPING, ReplicaState.HIBERNATING}),
    ReplicaState.LEASED: frozenset({ReplicaState.READY, ReplicaState.DRAINING, ReplicaState.STOPPING}),
    ReplicaState.DRAINING: frozenset({ReplicaState.READY, ReplicaState.STOPPING}),
    ReplicaState.STOPPING: frozenset({ReplicaState.STOPPED}),
    # A checkpoint that fails ends in a stop; a restore is a start (admission, then the restore).
    ReplicaState.HIBERNATING: frozenset({ReplicaState.HIBERNATED, ReplicaState.STOPPING}),
    ReplicaState.HIBERNATED: frozenset({ReplicaState.STARTING, ReplicaState.STOPPING}),
    ReplicaState.STOPPED: frozenset(),
    ReplicaState.FAILED: frozenset(),
}
