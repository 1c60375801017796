"""The decision core's records: a provider, a replica, a lease, a waiting request; plain data, no processes."""

from __future__ import annotations

from dataclasses import dataclass, field

from .breaker import Breaker
from .states import REPLICA_EDGES, ReplicaState, StopCause

__all__ = ["Check", "Drain", "Eviction", "Hold", "Lease", "Provider", "Recall", "Replica", "ReplicaTransitionError",
           "Spec", "Ticket"]


class ReplicaTransitionError(RuntimeError):
    """A move the replica's state table does not allow: a bug in the pool, never silently done."""


@dataclass(frozen=True)
class Spec:
    """What the decision core needs of a provider's manifest: its lifecycle and its GPU budget."""

    mode: str = "resident"  # or "subprocess": a worker serves one lease
    max_replicas: int = 1
    min_replicas: int = 0
    idle_timeout_s: float = 600.0
    ping_interval_s: float = 30.0
    abandon_grace_s: float = 30.0
    admission_timeout_s: float = 3600.0
    start_timeout_s: float = 900.0
    request_timeout_s: float = 3600.0
    evict: str = "stop"  # or "hibernate"
    budget_gb: float | None = None  # None: no GPU budget ([gpu] policy = "none")
    max_callers: int = 1  # leases one replica carries at once ([batching]; 1: one request at a time, as before)
    max_queue_wait_s: float | None = None  # a replica whose worker reports a longer queue wait wants another one


@dataclass(eq=False)
class Ticket:
    """A client waiting for a replica of one provider."""

    id: int
    key: str
    connection: int
    holder: dict[str, str]
    arrived: float
    deadline: float  # it gives up waiting for a free replica then (admission_timeout_s)
    keep: bool = False  # Pool.predict's: the client keeps the lease between calls until the pool recalls it
    priority: str = "normal"  # the class it waits in (``asked``, capped to what this pool may claim)
    asked: str = "normal"  # the class its client asked for
    rank: int = 1  # the rank it last held (ageing raises it; each rise is announced once)


@dataclass(eq=False)
class Lease:
    """One client's hold on a replica; bound to the connection that asked for it."""

    id: int
    rid: int
    connection: int
    holder: dict[str, str]
    since: float
    kept: bool = False  # held between calls (Pool.predict): idle while no request runs, recalled when wanted
    noticed: int = 0  # requests its client said it served (kept leases tell the pool now and then)
    heard: float = float("-inf")  # when its client last told of calls (a kept lease's `used`)
    priority: str = "normal"
    backfilled: bool = False  # its worker's memory was placed ahead of a waiting request: it may be recalled


@dataclass(eq=False)
class Recall:
    """A lease being taken back, after at most its request in flight (asked of its worker, or its client)."""

    idle_check: bool = False  # for idleness: the replica retires if its worker says it was idle that long too


@dataclass(eq=False)
class Hold:
    """One lease a replica is held by (a batching replica carries up to ``max_callers`` of them)."""

    lease: int
    kept: bool = False  # Pool.predict's: idle between calls, recalled when another needs it
    recall: Recall | None = None


@dataclass(eq=False)
class Eviction:
    """Admission needs the replica's memory: it is evicted once its lease is back."""

    need_gb: float


@dataclass(eq=False)
class Check:
    """A liveness ping of a replica held by a kept lease between its calls."""

    since: float


@dataclass(eq=False)
class Drain:
    """A gone client's request, pinged until it is over (up to abandon_grace_s)."""

    kept_lease: int | None  # the gone client's kept lease: its worker is asked with a recall, which counts what it
    # served on it and refuses it from then on
    noticed_before: int  # of that lease: the requests already counted
    probes: int = 1


@dataclass(eq=False)
class Replica:
    """One worker of one provider, as the decision core sees it."""

    rid: int  # unique for the pool's life: a report about a replica that is gone is never applied to another
    key: str
    index: int
    version: str
    budget_gb: float | None
    since: float
    state: ReplicaState = ReplicaState.STARTING
    holds: dict[int, Hold] = field(default_factory=dict)  # by lease
    retire: tuple[StopCause, str] | None = None  # why it ends once free; None keeps it
    abort: tuple[StopCause, str] | None = None  # why a start in progress is called off
    deadline: float | None = None  # when the transitional state it is in is overdue
    drain_by: float | None = None  # a stop's drain grace: past it, a leased replica is stopped anyway
    for_ticket: int | None = None  # the waiting request its start serves (it hears the admission wait)
    fresh: bool = False  # started (or restored) for a request: its first lease is a cold one
    last_used: float = 0.0
    last_checked: float = 0.0
    served: int = 0
    eviction: Eviction | None = None
    check: Check | None = None
    drain: Drain | None = None
    queue_wait_s: float | None = None  # the wait in its worker's queue, as its last reply a client told of said
    idle_seen_s: float | None = None  # of the leases recalled for idleness, the shortest idle its worker reported
    can_recall: bool = False  # its worker answers ``recall`` (every worker on our worker_base does)
    in_flight_since: float | None = None  # when the request running at the runtime's last look began (its board)
    stop_attempts: int = 0
    pid: int | None = None
    device: str | None = None
    admitted: bool = False  # holds a GPU budget in the ledger
    backfilled: bool = False  # its budget was placed ahead of a request that waits for memory still
    last_error: str | None = None
    stop: tuple[StopCause, str] | None = None  # why it moved to STOPPING

    @property
    def name(self) -> str:
        return f"{self.key}[{self.index}]"

    def transition(self, new: ReplicaState, why: str = "") -> None:
        """Move to ``new`` if the state table allows it from here; raise otherwise."""
        if new not in REPLICA_EDGES[self.state]:
            raise ReplicaTransitionError(f"{self.name}: {self.state} -> {new} is not an allowed move ({why})")
        self.state = new

    @property
    def ending(self) -> bool:
        """On its way out or gone: stopping, stopped, or its start failed."""
        return self.state in (ReplicaState.STOPPING, ReplicaState.STOPPED, ReplicaState.FAILED)

    @property
    def kept(self) -> bool:
        """Held, and only by kept leases (Pool.predict's): idle between their calls."""
        return bool(self.holds) and all(hold.kept for hold in self.holds.values())

    @property
    def recalling(self) -> bool:
        """One of its leases is being taken back."""
        return any(hold.recall is not None for hold in self.holds.values())

    def kept_idle(self) -> bool:
        """Held by kept leases between their calls, none being taken back, and not being checked."""
        return self.state is ReplicaState.LEASED and self.kept and not self.recalling and self.check is None

    @property
    def idle(self) -> bool:
        """No request runs on it, nor will before the pool hands it out: nobody holds it (ready, hibernated), or
        kept leases hold it between their calls (none being taken back, none running a request at the runtime's last
        look). The one place the word is decided: idle time, retirement, eviction and every reader go by it."""
        return self.state in (ReplicaState.READY, ReplicaState.HIBERNATED) or (
            self.state is ReplicaState.LEASED and self.kept and not self.recalling and self.in_flight_since is None)

    def idle_s(self, now: float) -> float:
        """How long it has been ``idle``: 0 while it is not."""
        return now - self.last_used if self.idle else 0.0


@dataclass(eq=False)
class Provider:
    """One provider as the core knows it: its version, its replicas, who waits for one."""

    key: str  # its slug, or ``slug~variant`` for a build of it another way (a check's stock run)
    slug: str
    version: str
    fingerprint: str
    spec: Spec
    breaker: Breaker
    variant: bool = False
    replicas: dict[int, Replica] = field(default_factory=dict)  # by replica number
    queue: list[Ticket] = field(default_factory=list)  # in the order they are served
    starts: int = 0
    last_error: str | None = None

    @property
    def min_replicas(self) -> int:
        """The replicas kept warm: its manifest's ``min_replicas``; none for a variant (a check's run ends with it)."""
        return 0 if self.variant else self.spec.min_replicas
