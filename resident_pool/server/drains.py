"""The decision core's rule for an abandoned request: its client went away mid-lease, so the worker is pinged until
the request is over (then it serves again), up to abandon_grace_s (then it is stopped).

Part of the replica lifecycle (``lifecycle.Lifecycle`` owns the records and ends replicas); this is the one
protocol it hands off whole.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .actions import Action, Note, Ping
from .replica import Replica
from .states import ReplicaState, StopCause

if TYPE_CHECKING:
    from .lifecycle import Lifecycle

__all__ = ["Drains"]

R = ReplicaState


class Drains:
    """Abandoned requests: drained, never handed out before they are over."""

    def __init__(self, lifecycle: Lifecycle) -> None:
        self.lifecycle = lifecycle

    def abandon(self, now: float, replica: Replica, why: str, kept: tuple[int, int] | None = None
                ) -> list[Action]:
        """Its client is gone mid-lease: free it once its request (if any) is over; never hand it out before.

        ``kept``: the (lease, requests its client told of) of a kept lease: its worker is asked with a recall, which
        counts what the client did not tell."""
        if replica.state not in (R.LEASED, R.DRAINING):
            return []
        if replica.state is R.LEASED:
            replica.transition(R.DRAINING, f"{why}; waiting for any request in flight")
        grace = self.lifecycle.providers[replica.key].spec.abandon_grace_s
        replica.deadline, replica.probes = now + grace, 1
        replica.gone_lease, replica.noticed_before = kept if kept is not None else (None, 0)
        probe = min(self.lifecycle.timings.abandon_probe_s, grace) or 0.1
        return [Ping(replica.rid, "abandon", probe, replica.gone_lease)]

    def pinged(self, now: float, replica: Replica, answered: bool, rc: int | None, failure: str | None,
               served: int | None) -> list[Action]:
        """An abandoned request's ping: over (it serves again), dead, still running (wait to the grace), or overdue."""
        lifecycle, rid = self.lifecycle, replica.rid
        if replica.state is not R.DRAINING or replica.lease is not None:
            return []  # decided meanwhile
        if served is not None:  # a kept lease's recall: what its gone client had not told
            replica.served += max(0, served - replica.noticed_before)
            replica.noticed_before = served
        provider = lifecycle.providers[replica.key]
        grace = provider.spec.abandon_grace_s
        if answered and lifecycle.serves_new_requests(replica):
            replica.transition(R.READY, "the abandoned request ended")
            replica.last_used, replica.deadline = now, None
            return []
        if answered or failure:
            if failure and now < (replica.deadline or now):
                return [Ping(rid, "abandon", max(0.1, (replica.deadline or now) - now), replica.gone_lease)]
            return lifecycle.end(now, replica, *(replica.retire or (StopCause.DRAINED, "its manifest changed")))
        if rc is not None:
            return lifecycle.died(now, replica, rc, "died while its abandoned request ran")
        if replica.probes == 1 and replica.deadline is not None and now < replica.deadline:
            replica.probes += 1
            return [Note(rid, f"its client went away mid-request; the request may run up to abandon_grace_s = "
                              f"{grace:g} s more, and its answer is thrown away"),
                    Ping(rid, "abandon", max(0.1, replica.deadline - now), replica.gone_lease)]
        why = f"its abandoned request still ran after abandon_grace_s = {grace:g} s"
        replica.last_error = provider.last_error = f"{replica.name}: {why}; stopped"
        return lifecycle.end(now, replica, StopCause.ABANDONED, why, kill=True)
