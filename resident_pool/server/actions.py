"""What the pool's decision core decides: the actions the runtime carries out, and the timings it decides by."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ResidentPoolError
from ..priority import CLASSES
from .states import StopCause

__all__ = [
    "Action",
    "Announce",
    "Exit",
    "Forget",
    "Gone",
    "Grant",
    "Hibernate",
    "Note",
    "Ping",
    "Place",
    "Policy",
    "Recall",
    "Refuse",
    "ReleaseBudget",
    "Spawn",
    "Start",
    "Stop",
    "Timings",
    "Withdraw",
]


@dataclass(frozen=True)
class Timings:
    """The timings that decide behaviour; a test shortens them by argument and says so in its name."""

    liveness_timeout_s: float = 10.0  # an idle worker that does not answer a ping this long is stopped
    abandon_probe_s: float = 1.0  # a worker between requests answers at once; one that does not is computing
    stop_overdue_s: float = 60.0  # a stop not reported in this long is tried again with SIGKILL
    hibernate_overdue_s: float = 120.0
    report_margin_s: float = 15.0  # added to a start's or a check's own limit before the core calls it overdue
    drain_grace_s: float = 60.0  # a stop lets leased requests finish this long
    quiet_exit_s: float = 600.0  # no workers and no clients this long: the pool exits (0: never)
    keep_warm_s: float = 5.0  # how often providers are topped up to min_replicas
    breaker_cooldown_s: float = 300.0
    # A kept lease whose holder was heard of this recently (its client tells the pool at most once a second while
    # it calls) counts as busy for eviction: evicting it would cost its holder a restart (docs/admission.md).
    kept_active_s: float = 2.0


@dataclass(frozen=True)
class Policy:
    """How waiting requests are ordered and seated: ageing, backfill, and the classes this pool may claim."""

    aging_s: float = 300.0  # a waiting request rises one class per this many seconds (0: never)
    backfill: bool = True  # a start that fits now may go ahead of a head that does not (and be recalled)
    classes: tuple[str, ...] = CLASSES  # the classes its requests may claim; a higher one is capped (the host
    # admission service says which, per user)
    poll_s: float = 0.25  # while starts wait for memory, the room is read again this often (memory freed outside)


# -- actions: what the runtime carries out ------------------------------------------------------
@dataclass(frozen=True)
class Start:
    """Prepare a start (or a restore): report ``prepared`` with the GPU memory it needs, or ``start_failed``."""

    rid: int
    ticket: int | None  # the waiting request it serves first, which hears about an admission wait
    restore: bool = False
    wait: bool = True  # False: admitted only where it fits now (a warm-up of the pool's own)


@dataclass(frozen=True)
class Place:
    """Try to place the replica's GPU budget now; report ``placed``, or ``not_placed`` with the room seen."""

    rid: int
    need_gb: float
    device: int | None  # only there (a hibernated worker's memory goes back where it was)
    priority: str
    waited_s: float
    backfill: bool = False  # placed ahead of the head of the line: its lease is backfilled
    once: bool = False  # a warm-up: placed only if it fits now with nobody waiting, never queued


@dataclass(frozen=True)
class Withdraw:
    """The replica's wait for memory ends unplaced; report ``start_failed`` with the error ``reason`` names:
    admission_timeout (waited admission_timeout_s), no_room (a warm-up), start_cancelled (called off)."""

    rid: int
    reason: str
    waited_s: float = 0.0


@dataclass(frozen=True)
class Spawn:
    """Spawn (or restore) the placed replica's process; report ``started`` or ``start_failed``."""

    rid: int


@dataclass(frozen=True)
class Announce:
    """An event for the events stream (``admission.backfilled``, ``admission.recalled``, ``request.aged``)."""

    event: str
    slug: str
    fields: tuple[tuple[str, object], ...] = ()


@dataclass(frozen=True)
class Stop:
    """End the replica's process: ask it to shut down, or (``kill``) SIGTERM then SIGKILL its group."""

    rid: int
    cause: StopCause
    why: str
    kill: bool = False


@dataclass(frozen=True)
class Ping:
    """Ping the replica; report ``pinged``. ``purpose``: "liveness", or "abandon" (is its request over?).

    ``lease``: the kept lease its gone client held: asked as a recall instead, which also answers how many
    requests the worker served on it (reported as ``served``) and refuses it from then on."""

    rid: int
    purpose: str
    timeout_s: float
    lease: int | None = None


@dataclass(frozen=True)
class Hibernate:
    """Checkpoint the replica's device memory to host memory; report ``hibernated``."""

    rid: int
    why: str


@dataclass(frozen=True)
class Grant:
    """Answer a waiting client: its lease."""

    ticket: int
    lease: int
    rid: int
    cold: bool
    kept: bool = False  # the client may keep it between calls (until the pool recalls it)


@dataclass(frozen=True)
class Recall:
    """Take back lease ``lease`` of the replica after at most the request in flight (the core's one rule for it:
    ``Lifecycle.recall``). ``worker``: ask its worker, which refuses the lease from then on and answers once any
    request in flight is over: report ``recalled``. ``client``: tell a backfilled session's client, which gives
    it back (a ``released``) before its next request; whichever comes first ends the lease."""

    rid: int
    lease: int
    why: str = ""
    client: bool = False
    worker: bool = True


@dataclass(frozen=True)
class Refuse:
    """Answer a waiting client: the error."""

    ticket: int
    error: ResidentPoolError


@dataclass(frozen=True)
class Note:
    """Write a line into the replica's transcript (and the pool's log)."""

    rid: int
    text: str


@dataclass(frozen=True)
class ReleaseBudget:
    """Give the replica's GPU budget back to the ledger; its process stays (hibernated)."""

    rid: int


@dataclass(frozen=True)
class Gone:
    """The replica has ended: give back its budget and close its books."""

    rid: int
    cause: StopCause | None  # None: its start failed
    why: str | None
    served: int = 0


@dataclass(frozen=True)
class Exit:
    """The pool stops itself (it has been quiet long enough)."""

    why: str


@dataclass(frozen=True)
class Forget:
    """A provider the core no longer knows (a check's variant, gone with its last replica): its manifest is
    forgotten too, so no watch of it reads it back in."""

    key: str


Action = (Start | Place | Withdraw | Spawn | Stop | Ping | Hibernate | Grant | Refuse | Recall | Note | ReleaseBudget
          | Gone | Announce | Exit | Forget)
