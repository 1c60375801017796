"""What the shell may read of the decision core: one read-only view, made at once under the pool's lock.

Status, metrics, the observer and the runtime read the core through ``PoolState.view(now)``
only; what a word means (idle, serving, ending) is decided here, in the core, once. Plain
frozen records: nothing in them reaches back into the core's own.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .states import ReplicaState

__all__ = ["CoreView", "LeaseView", "LineEntry", "ProviderView", "ReplicaView", "TicketView"]


@dataclass(frozen=True)
class LeaseView:
    """One client's hold on a replica."""

    id: int
    rid: int
    connection: int
    holder: dict[str, str]
    age_s: float
    kept: bool  # Pool.predict's: held between calls, recalled when wanted
    recalling: bool  # being taken back, after at most the request in flight
    priority: str
    backfilled: bool

    def row(self) -> dict[str, object]:
        """As `status` shows it."""
        return {"id": self.id, "holder": dict(self.holder), "age_s": self.age_s, "kept": self.kept,
                "recalling": self.recalling, "priority": self.priority, "backfilled": self.backfilled}


@dataclass(frozen=True)
class ReplicaView:
    """One worker as the core sees it."""

    rid: int
    key: str
    slug: str
    index: int
    state: ReplicaState
    version: str
    current: bool  # of its provider's current version
    pid: int | None
    device: str | None
    budget_gb: float | None
    served: int
    idle_s: float
    idle: bool  # nobody holds it, or a kept lease holds it between calls: retired, evicted, recalled as a ready one
    serving: bool  # a new request may get it: current version, not retiring, not ending
    ending: bool  # stopping, stopped or failed
    retiring: str | None  # why it ends once free
    called_off: str | None  # why its start in progress is called off
    last_error: str | None
    kept_warm: bool
    backfilled: bool
    kept: bool  # held, and only by kept leases
    lease: LeaseView | None  # its first lease (a batching replica may carry more: ``leases``)
    in_flight_s: float | None  # how long its request has run, at the runtime's last look (leased or draining)
    leases: tuple[LeaseView, ...]  # every lease it carries, its callers
    max_callers: int
    queue_wait_s: float | None  # the wait in its worker's queue, as its last reply a client told of said

    @property
    def name(self) -> str:
        return f"{self.key}[{self.index}]"


@dataclass(frozen=True)
class TicketView:
    """A client waiting for a free replica."""

    ticket: int
    holder: dict[str, str]
    waited_s: float
    priority: str
    asked: str
    ranks_as: str


@dataclass(frozen=True)
class ProviderView:
    """One provider: its version, its breaker, who waits for a replica."""

    key: str
    slug: str
    version: str
    fingerprint: str
    starts: int
    last_error: str | None
    breaker: dict[str, object] | None
    variant: bool
    waiting: tuple[TicketView, ...]
    min_replicas: int
    max_replicas: int
    serving: int  # replicas a new request may get (what max_replicas counts)
    running: int  # replicas not ending (starting ones too)


@dataclass(frozen=True)
class LineEntry:
    """A start waiting for GPU memory, in the line's order."""

    position: int
    rid: int
    key: str
    slug: str
    replica: int | None
    priority: str
    ranks_as: str
    age_s: float
    waited_s: float
    needs_gb: float
    device: int | None
    ticket: int | None
    placing: bool  # its placement is being tried now


@dataclass(frozen=True)
class CoreView:
    """The core's records at ``now``."""

    now: float
    stopping: str | None  # why the pool is stopping; None while it serves
    providers: dict[str, ProviderView]
    replicas: tuple[ReplicaView, ...]  # by provider, then replica number
    gpu_line: tuple[LineEntry, ...]
    policy: dict[str, object]  # ageing, backfill, the classes this pool may claim
    leases: dict[int, LeaseView]  # every lease, a session's on a replica that has ended too (until released)

    @property
    def resting(self) -> bool:
        """Nothing leased and every replica ready (none starting, hibernated or on its way out): a pool of another
        version may step aside (``hello`` says ``idle``)."""
        return not self.leases and all(r.state is ReplicaState.READY for r in self.replicas)

    _by_rid: dict[int, ReplicaView] = field(init=False, repr=False, compare=False)  # ``replica``'s index

    def __post_init__(self) -> None:
        object.__setattr__(self, "_by_rid", {r.rid: r for r in self.replicas})

    def replica(self, rid: int) -> ReplicaView | None:
        return self._by_rid.get(rid)

    def lease(self, lease: int) -> LeaseView | None:
        return self.leases.get(lease)
