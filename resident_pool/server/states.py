"""Replica states, their allowed moves, and why a replica ends; no internal imports."""

from __future__ import annotations

import enum

__all__ = ["REPLICA_EDGES", "ReplicaState", "StopCause"]


class ReplicaState(enum.StrEnum):
    """A replica in the host pool; the pool's decision core is the only thing that moves it."""

    STARTING = "starting"  # admission, spawn (or restore), first ping
    READY = "ready"  # answering, between requests, held by nobody
    LEASED = "leased"  # held by one client
    CHECKING = "checking"  # the pool's own liveness ping, a moment long; handed to nobody meanwhile
    DRAINING = "draining"  # a request may still run (an abandoned one, or an old version's); never handed out
    STOPPING = "stopping"
    STOPPED = "stopped"
    FAILED = "failed"  # its start failed
    HIBERNATING = "hibernating"  # evicted: its device memory is being checkpointed to host memory
    HIBERNATED = "hibernated"  # holds no device memory; the process waits, and its next lease restores it


# The only moves a replica may make; anything else is a bug and raises.
REPLICA_EDGES: dict[ReplicaState, frozenset[ReplicaState]] = {
    # A start runs to its end (its own thread owns the process meanwhile); one called off after the
    # worker answered goes straight to a stop.
    ReplicaState.STARTING: frozenset({ReplicaState.READY, ReplicaState.FAILED, ReplicaState.STOPPING}),
    ReplicaState.READY: frozenset({ReplicaState.LEASED, ReplicaState.CHECKING, ReplicaState.STOPPING,
                                   ReplicaState.HIBERNATING}),
    ReplicaState.LEASED: frozenset({ReplicaState.READY, ReplicaState.DRAINING, ReplicaState.STOPPING}),
    ReplicaState.CHECKING: frozenset({ReplicaState.READY, ReplicaState.STOPPING}),
    ReplicaState.DRAINING: frozenset({ReplicaState.READY, ReplicaState.STOPPING}),
    ReplicaState.STOPPING: frozenset({ReplicaState.STOPPED}),
    # A checkpoint that fails ends in a stop; a restore is a start (admission, then the restore).
    ReplicaState.HIBERNATING: frozenset({ReplicaState.HIBERNATED, ReplicaState.STOPPING}),
    ReplicaState.HIBERNATED: frozenset({ReplicaState.STARTING, ReplicaState.STOPPING}),
    ReplicaState.STOPPED: frozenset(),
    ReplicaState.FAILED: frozenset(),
}


class StopCause(enum.StrEnum):
    """Why a replica ended, in a word automations can match (metrics labels, the events stream)."""

    IDLE = "idle"  # idle_timeout_s passed
    EVICTED = "evicted"  # admission needed its memory
    OVER_BUDGET = "over_budget"  # measured above vram_budget_gb with over_budget = "stop"
    DRAINED = "drained"  # its manifest changed: an old version
    POOL_STOPPING = "pool_stopping"
    STOPPED = "stopped"  # `resident-pool stop`
    UNRESPONSIVE = "unresponsive"  # did not answer a liveness ping
    TIMEOUT = "timeout"  # a request outran request_timeout_s
    ABANDONED = "abandoned"  # its abandoned request ran past abandon_grace_s
    DIED = "died"  # the process ended on its own
    EXITED = "exited"  # the worker said it is exiting (worker_exiting)
    ONE_LEASE = "one_lease"  # mode = "subprocess": a worker serves one lease
    OVERDUE = "overdue"  # a start, check, hibernation or stop did not report back in time
