"""What the pool's decision core decides: the actions the runtime carries out, and the timings it decides by."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ResidentPoolError
from .states import StopCause

__all__ = ["Action", "Exit", "Gone", "Grant", "Hibernate", "Note", "Ping", "Recall", "Refuse", "ReleaseBudget",
           "Start", "Stop", "Timings"]


@dataclass(frozen=True)
class Timings:
    """The timings that decide behaviour; a test shortens them by argument and says so in its name."""

    liveness_timeout_s: float = 10.0  # an idle worker that does not answer a ping this long is stopped
    abandon_probe_s: float = 1.0  # a worker between requests answers at once; one that does not is computing
    kill_grace_s: float = 5.0  # SIGTERM to SIGKILL
    stop_overdue_s: float = 60.0  # a stop not reported in this long is tried again with SIGKILL
    hibernate_overdue_s: float = 120.0
    report_margin_s: float = 15.0  # added to a start's or a check's own limit before the core calls it overdue
    drain_grace_s: float = 60.0  # a stop lets leased requests finish this long
    quiet_exit_s: float = 600.0  # no workers and no clients this long: the pool exits (0: never)
    keep_warm_s: float = 5.0  # how often providers are topped up to min_replicas
    breaker_cooldown_s: float = 300.0


# -- actions: what the runtime carries out ------------------------------------------------------
@dataclass(frozen=True)
class Start:
    """Admit and start (or restore) the replica; report ``started`` or ``start_failed``."""

    rid: int
    ticket: int | None  # the waiting request it serves first, which hears about an admission wait
    restore: bool = False
    wait: bool = True  # False: admitted only where it fits now (a warm-up of the pool's own)


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
    """Take back the kept lease ``lease`` from the worker (its answer comes after any request in flight);
    report ``recalled``."""

    rid: int
    lease: int


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


Action = Start | Stop | Ping | Hibernate | Recall | Grant | Refuse | Note | ReleaseBudget | Gone | Exit
