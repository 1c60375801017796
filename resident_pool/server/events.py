"""What happens to the pool, as the decision core hears it: one frozen record per kind, and the core's answer.

The mirror of ``actions``: the runtime carries out actions and reports how each ended (and what
clients and the clock did) as one of these; ``PoolState.handle(now, event)`` is the core's one
entry point, and returns a ``Decision``. These are not the events stream of ``ops.events``
(what an operator's automation reads): they are the core's input, and an event log of them
(``corelog``) replays an incident into a fresh core.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import ResidentPoolError
from .actions import Action
from .replica import Spec
from .states import StopCause

__all__ = [
    "BudgetNotPlaced",
    "BudgetPlaced",
    "ClientAsked",
    "ConnectionClosed",
    "Decision",
    "Event",
    "HibernationEnded",
    "HostRecall",
    "LeaseRecalled",
    "LeaseReleased",
    "LeaseUsed",
    "ManifestRead",
    "MemoryFreed",
    "Pinged",
    "RestoreFailed",
    "RetireAsked",
    "ShutdownAsked",
    "StartFailed",
    "StartPrepared",
    "StopAsked",
    "Tick",
    "TicketGone",
    "WarmAsked",
    "WorkerExited",
    "WorkerSpawned",
    "WorkerStarted",
    "WorkerStopped",
]


@dataclass(frozen=True)
class Decision:
    """What the core decided: the actions to carry out, and what the asker needs back (a ticket, the replicas a
    stop or a warm-up names, the error a warm-up or a request is refused with before it waits, or the error a failed
    start opened its provider's breaker with)."""

    actions: list[Action] = field(default_factory=list)
    ticket: int | None = None
    replicas: tuple[int, ...] = ()
    error: ResidentPoolError | None = None


# -- providers ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ManifestRead:
    """A provider's manifest as it is now; a new version drains the replicas of the old one."""

    key: str
    slug: str
    version: str
    fingerprint: str
    spec: Spec
    variant: bool = False


# -- clients -----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ClientAsked:
    """A client asks for a replica of ``key`` in class ``priority`` (``keep``: Pool.predict's kept lease).

    Decided with a ticket, answered later by a Grant or a Refuse."""

    key: str
    connection: int
    holder: dict[str, str]
    priority: str = "normal"
    keep: bool = False


@dataclass(frozen=True)
class TicketGone:
    """The client waiting on ``ticket`` went away."""

    ticket: int


@dataclass(frozen=True)
class LeaseReleased:
    """A lease ends. ``outcome``: ok; abandoned (interrupted mid-request); timeout; exiting (the worker said so) or
    died, with the exit code ``rc``; broken (its connection broke, the worker lives); bad_reply. ``in_flight_s``
    (a timeout's): how long the worker's model call had run when the client gave up, None when none ran: a
    shared worker's caller may time out in its queue, and the last tick's figure may be another call's."""

    lease: int
    connection: int
    outcome: str
    served: int = 0
    rc: int | None = None
    in_flight_s: float | None = None


@dataclass(frozen=True)
class LeaseUsed:
    """The client of a kept lease served ``served`` more requests (told now and then, not every call), the last
    of which waited ``queue_wait_s`` in its batching worker's queue."""

    lease: int
    connection: int
    served: int
    queue_wait_s: float | None = None


@dataclass(frozen=True)
class LeaseRecalled:
    """A recalled lease is back from its worker (``idle_s``: how long the worker had been idle; ``served``: requests
    it served on the lease, by its own count); ``failure``: the pool could not send the recall."""

    lease: int
    idle_s: float = 0.0
    served: int | None = None
    failure: str | None = None


@dataclass(frozen=True)
class ConnectionClosed:
    """A client went away: each wait it had is dropped, each lease abandoned."""

    connection: int


# -- starts and GPU memory --------------------------------------------------------------------------------
@dataclass(frozen=True)
class StartPrepared:
    """A start is ready to spawn once its ``need_gb`` of GPU memory (None: none) is placed (``device``: only there;
    ``wait`` False: a warm-up, placed only if it fits now)."""

    rid: int
    need_gb: float | None
    device: int | None = None
    wait: bool = True


@dataclass(frozen=True)
class BudgetPlaced:
    """The replica's budget is in the ledger on ``device`` (ahead of the head of the line if ``backfilled``)."""

    rid: int
    device: int
    backfilled: bool = False


@dataclass(frozen=True)
class BudgetNotPlaced:
    """A placement found no room: ``rooms`` is the room per device it read."""

    rid: int
    rooms: dict[int, float]


@dataclass(frozen=True)
class MemoryFreed:
    """A budget went back to the ledger (or another pool's did, the host service says): read the room again."""


@dataclass(frozen=True)
class HostRecall:
    """The host admission service wants a backfilled worker's memory back for a request of another pool."""

    rid: int
    why: str


@dataclass(frozen=True)
class WorkerSpawned:
    rid: int
    pid: int


@dataclass(frozen=True)
class RestoreFailed:
    """A restore from hibernation failed (``why``): the replica is being started afresh instead."""

    rid: int
    why: str


@dataclass(frozen=True)
class WorkerStarted:
    """The replica answered its first ping (or its restore's); ``can_recall``: its worker answers ``recall``."""

    rid: int
    pid: int | None
    can_recall: bool = False


@dataclass(frozen=True)
class StartFailed:
    """The start ended without a worker: the request it was for hears ``error``."""

    rid: int
    error: ResidentPoolError


# -- running workers ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Pinged:
    """A ping of ``purpose`` (liveness, or abandon) ended: answered or not, the exit code if the worker died,
    ``failure`` if the pool could not send it, ``served`` (a gone client's kept lease) as the worker counted."""

    rid: int
    purpose: str
    answered: bool
    rc: int | None = None
    failure: str | None = None
    served: int | None = None


@dataclass(frozen=True)
class WorkerExited:
    """The runtime found the replica's process ended on its own."""

    rid: int
    rc: int


@dataclass(frozen=True)
class HibernationEnded:
    """A checkpoint of the replica's device memory ended (``ok``), or failed (``why``)."""

    rid: int
    ok: bool
    why: str


@dataclass(frozen=True)
class WorkerStopped:
    """A stop ended; ``failure`` says why it could not be done."""

    rid: int
    failure: str | None = None


# -- operators and the clock -------------------------------------------------------------------------------
@dataclass(frozen=True)
class RetireAsked:
    """End a replica once it is free (its measured memory is over budget, say)."""

    rid: int
    cause: StopCause
    why: str


@dataclass(frozen=True)
class StopAsked:
    """Stop ``key``'s replicas (every provider's when None); leased ones drain first unless ``at_once``. Decided
    with the replicas it stops."""

    key: str | None
    at_once: bool
    why: str
    cause: StopCause = StopCause.STOPPED


@dataclass(frozen=True)
class ShutdownAsked:
    """Stop taking leases, refuse every waiting request, stop every replica (leased ones drain first)."""

    why: str
    at_once: bool = False


@dataclass(frozen=True)
class WarmAsked:
    """Start replicas of ``key`` until ``replicas`` of its current version serve. Decided with the replicas it
    starts, or the error it is refused with (the pool stops, the breaker is open, the manifest does not allow)."""

    key: str
    replicas: int
    wait: bool = True


@dataclass(frozen=True)
class Tick:
    """Time passed: ``connections`` clients are connected; ``in_flight``: the leased replicas the runtime found
    running a request, each with how long it had run (None: not read this time)."""

    connections: int = 0
    in_flight: dict[int, float] | None = None


Event = (ManifestRead | ClientAsked | TicketGone | LeaseReleased | LeaseUsed | LeaseRecalled | ConnectionClosed
         | StartPrepared | BudgetPlaced | BudgetNotPlaced | MemoryFreed | HostRecall | WorkerSpawned | RestoreFailed
         | WorkerStarted | StartFailed | Pinged | WorkerExited | HibernationEnded | WorkerStopped | RetireAsked
         | StopAsked | ShutdownAsked | WarmAsked | Tick)
