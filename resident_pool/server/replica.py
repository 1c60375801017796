"""The pool's record of one worker: its state, its lease, its version; the pool alone changes it."""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from .states import REPLICA_EDGES, ReplicaState

__all__ = ["Lease", "Measured", "Replica", "ReplicaTransitionError"]

log = logging.getLogger("resident_pool.replica")
_lease_ids = itertools.count(1)


class ReplicaTransitionError(RuntimeError):
    """A move the replica's state table does not allow: a bug in the pool, never silently done."""


@dataclass(eq=False)
class Lease:
    """One client's hold on a replica; bound to the connection that asked for it."""

    connection: Any  # the client connection holding it; None for the pool's own liveness check
    replica: Any  # the Replica it holds
    holder: dict[str, str] = field(default_factory=dict)
    id: int = field(default_factory=lambda: next(_lease_ids))
    since: float = field(default_factory=time.monotonic)


@dataclass
class Measured:
    """What the pool measured of one worker, for status and metrics; the pool alone writes it."""

    gpu_used_gb: float | None = None  # its process group's GPU memory (NVML), None where unmeasured
    gpu_peak_gb: float | None = None
    over_budget: str | None = None  # the sentence, from the first reading above the budget
    stats_at: float = 0.0  # when the worker's own counts were last collected (monotonic)
    stats_served: int = -1  # ``served`` then: a release since makes a new collection due
    collecting: bool = False


class Replica:
    """One worker of one provider, as the pool sees it."""

    def __init__(self, slug: str, index: int, version: str, process: Any, vram_budget_gb: float | None,
                 manifest: Any = None, clock=time.monotonic) -> None:
        self.slug = slug
        self.index = index
        self.version = version
        self.process = process
        self.vram_budget_gb = vram_budget_gb
        self.manifest = manifest  # the manifest it was started from (admission reads its timeout)
        self.clock = clock
        self.state = ReplicaState.STARTING
        self.lease: Lease | None = None
        self.retire: str | None = None  # why it stops once free (a drain); None keeps it
        self.drain_deadline: float | None = None
        self.last_used = clock()
        self.last_checked = clock()
        self.served = 0
        self.last_error: str | None = None
        self.admitter: Any = None  # what admitted its budget, told when it is gone
        self.abort: str | None = None  # why a start in progress is called off (a stop --now, the pool stopping)
        self.hibernation: Any = None  # a hibernate.Hibernation while its memory is checkpointed
        self.stop_why: str | None = None  # why it moved to STOPPING (the lifecycle event says it)
        self.measured = Measured()

    # Admission and the ledger know a worker by slug and replica number.
    @property
    def replica(self) -> int:
        return self.index

    @property
    def pid(self) -> int | None:
        return self.process.pid

    @property
    def name(self) -> str:
        return f"{self.slug}[{self.index}]"

    def transition(self, new: ReplicaState, why: str = "") -> None:
        """Move to ``new`` if the state table allows it from here; raise otherwise."""
        if new not in REPLICA_EDGES[self.state]:
            raise ReplicaTransitionError(f"{self.name}: {self.state} -> {new} is not an allowed move ({why})")
        log.debug("%s: %s -> %s %s", self.name, self.state, new, why)
        if why and new in (ReplicaState.DRAINING, ReplicaState.STOPPING, ReplicaState.FAILED):
            self.process.note(f"{self.state} -> {new}: {why}")
        if new is ReplicaState.STOPPING:
            self.stop_why = why
        self.state = new

    @property
    def live(self) -> bool:
        """Started or starting, and not on its way out."""
        return self.state in (ReplicaState.STARTING, ReplicaState.READY, ReplicaState.LEASED,
                              ReplicaState.DRAINING, ReplicaState.HIBERNATING, ReplicaState.HIBERNATED)

    def idle_s(self) -> float:
        idle = self.state in (ReplicaState.READY, ReplicaState.HIBERNATED)
        return self.clock() - self.last_used if idle else 0.0
