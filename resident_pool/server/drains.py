"""The decision core's rule for an abandoned request: its client went away mid-lease, so the worker is pinged until
the request is over (then it serves again), up to abandon_grace_s (then it is stopped).

Functions of one replica's records, with no part of the core behind them: ``lifecycle.Lifecycle`` owns the replica,
calls these, and carries out the end they may call for (``Drained.end``, ``Drained.died``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .actions import Action, Note, Ping
from .replica import Drain, Replica
from .states import ReplicaState, StopCause

__all__ = ["Drained", "abandon", "pinged"]

R = ReplicaState


@dataclass(frozen=True)
class Drained:
    """What a drain's ping calls for: its actions, and whether the replica ends (cause, why, kill) or died."""

    actions: list[Action] = field(default_factory=list)
    end: tuple[StopCause, str, bool] | None = None
    died: int | None = None  # its process ended with this code


def abandon(now: float, replica: Replica, why: str, grace_s: float, probe_s: float,
            kept: tuple[int, int] | None = None) -> list[Action]:
    """Its client is gone mid-lease: free it once its request (if any) is over; never hand it out before.

    ``kept``: the (lease, requests its client told of) of a kept lease: its worker is asked with a recall, which
    counts what the client did not tell."""
    if replica.state not in (R.LEASED, R.DRAINING):
        return []
    if replica.state is R.LEASED:
        replica.transition(R.DRAINING, f"{why}; waiting for any request in flight")
    replica.deadline = now + grace_s
    replica.drain = Drain(kept[0], kept[1]) if kept is not None else Drain(None, 0)
    probe = min(probe_s, grace_s) or 0.1
    return [Ping(replica.rid, "abandon", probe, replica.drain.kept_lease)]


def pinged(now: float, replica: Replica, answered: bool, rc: int | None, failure: str | None, served: int | None,
           serving: bool, grace_s: float) -> Drained:
    """An abandoned request's ping: over (it serves again), dead, still running (wait to the grace), or overdue.

    ``serving``: a new request may get the replica (its version is current and it is not retiring)."""
    drain = replica.drain
    if replica.state is not R.DRAINING or replica.holds or drain is None:
        return Drained()  # decided meanwhile
    if served is not None:  # a kept lease's recall: what its gone client had not told
        replica.served += max(0, served - drain.noticed_before)
        drain.noticed_before = served
    if answered and serving:
        replica.transition(R.READY, "the abandoned request ended")
        replica.last_used, replica.deadline, replica.drain = now, None, None
        return Drained()
    if answered or failure:
        if failure and now < (replica.deadline or now):
            return Drained([Ping(replica.rid, "abandon", max(0.1, (replica.deadline or now) - now), drain.kept_lease)])
        cause, why = replica.retire or (StopCause.DRAINED, "its manifest changed")
        return Drained(end=(cause, why, False))
    if rc is not None:
        return Drained(died=rc)
    if drain.probes == 1 and replica.deadline is not None and now < replica.deadline:
        drain.probes += 1
        return Drained([Note(replica.rid, f"its client went away mid-request; the request may run up to "
                                          f"abandon_grace_s = {grace_s:g} s more, and its answer is thrown away"),
                        Ping(replica.rid, "abandon", max(0.1, replica.deadline - now), drain.kept_lease)])
    return Drained(end=(StopCause.ABANDONED, f"its abandoned request still ran after abandon_grace_s = {grace_s:g} s",
                        True))
