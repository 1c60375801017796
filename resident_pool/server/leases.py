"""The decision core's waiting line and leases: who waits for a replica, in which order, and who holds one.

It owns the tickets (requests waiting for a replica), each provider's queue of them, and
the leases; the replicas themselves move only through ``lifecycle.Lifecycle``. The order
is ``priority.in_order``'s (class, first come first served within one, ageing), the same
the GPU line (``admitting``) and the host admission service keep.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

from .. import priority as order
from ..errors import ResidentPoolError
from .actions import Action, Announce, Grant, Policy, Recall, Refuse, Timings
from .lifecycle import Lifecycle
from .replica import Lease, Provider, Replica, Ticket
from .states import ReplicaState

__all__ = ["Leasing"]

R = ReplicaState


class Leasing:
    """Tickets in line per provider, and the leases that end their wait."""

    def __init__(self, providers: dict[str, Provider], lifecycle: Lifecycle, timings: Timings,
                 policy: Policy | None = None) -> None:
        self.providers = providers  # the core's registry; this class owns each provider's ``queue``
        self.lifecycle = lifecycle
        self.timings = timings
        self.policy = policy or Policy()
        self.tickets: dict[int, Ticket] = {}
        self.leases: dict[int, Lease] = {}
        self._ids = itertools.count(1)

    def new_ticket(self, now: float, provider: Provider, connection: int, holder: dict[str, str],
                   priority: str = order.DEFAULT) -> Ticket:
        """A request in class ``priority``, capped to the classes this pool may claim (``Policy.classes``)."""
        granted = order.cap(priority, self.policy.classes)
        return Ticket(next(self._ids), provider.key, connection, holder, now, now + provider.spec.admission_timeout_s,
                      priority=granted, asked=priority, rank=order.rank(granted))

    def wait(self, ticket: Ticket) -> None:
        """Put ``ticket`` in its provider's line (``in_order`` says where)."""
        self.tickets[ticket.id] = ticket
        self.providers[ticket.key].queue.append(ticket)

    def in_order(self, now: float, provider: Provider) -> list[Ticket]:
        """``provider``'s waiting requests in the order they are served: class, then arrival, with ageing."""
        provider.queue[:] = order.in_order(provider.queue, now, self.policy.aging_s, lambda t: t.priority,
                                           lambda t: t.arrived)
        return provider.queue

    def aged(self, now: float) -> list[Action]:
        """Announce each waiting request that ageing raised a class since it was last looked at."""
        actions: list[Action] = []
        for ticket in self.tickets.values():
            now_rank = order.effective(ticket.priority, now - ticket.arrived, self.policy.aging_s)
            if now_rank < ticket.rank:
                ticket.rank = now_rank
                actions.append(Announce("request.aged", self.providers[ticket.key].slug, (
                    ("ticket", ticket.id), ("priority", ticket.priority), ("ranks_as", order.CLASSES[now_rank]),
                    ("waited_s", round(now - ticket.arrived, 3)))))
        return actions

    def assign(self, now: float, provider: Provider,
               claimed: Callable[[float, Replica, Ticket], bool] | None = None) -> list[Action]:
        """Hand free replicas to waiting requests in order; start (or restore) more where they may.

        ``claimed(now, replica, ticket)``: True when a request that ranks before ``ticket`` waits for the
        memory ``replica`` holds (the GPU line's head): the replica is not handed out, and is evicted for it.
        """
        actions: list[Action] = []
        self.in_order(now, provider)
        while provider.queue:
            free = self.lifecycle.first(provider, R.READY)
            if free is None or (claimed is not None and claimed(now, free, provider.queue[0])):
                break
            actions.append(self._lease(now, provider.queue.pop(0), free))
        for ticket in provider.queue[self.lifecycle.coming(provider):]:
            hibernated = self.lifecycle.first(provider, R.HIBERNATED)  # a restore costs a copy back, not a start
            if hibernated is not None:
                actions.append(self.lifecycle.restore(now, provider, hibernated, ticket.id))
            elif self.lifecycle.live(provider) < provider.spec.max_replicas:
                actions.append(self.lifecycle.start(now, provider, ticket.id))
            else:
                break
        return actions

    def _lease(self, now: float, ticket: Ticket, replica) -> Grant:
        self.tickets.pop(ticket.id, None)
        lease = Lease(next(self._ids), replica.rid, ticket.connection, ticket.holder, now, ticket.priority,
                      backfilled=replica.backfilled)
        self.leases[lease.id] = lease
        cold = self.lifecycle.lease(replica, lease.id)
        return Grant(ticket.id, lease.id, replica.rid, cold)

    def ticket_gone(self, ticket_id: int) -> Provider | None:
        """The client waiting on ``ticket_id`` went away: its place must not hold up the rest."""
        ticket = self.tickets.pop(ticket_id, None)
        if ticket is None:
            return None
        provider = self.providers[ticket.key]
        provider.queue.remove(ticket)
        covered = self.lifecycle.covering(provider)
        self.lifecycle.hand_over(provider, ticket_id, [t.id for t in provider.queue if t.id not in covered])
        return provider

    def refuse(self, provider: Provider, ticket_id: int | None, error: ResidentPoolError) -> list[Action]:
        ticket = self.tickets.pop(ticket_id, None) if ticket_id is not None else None
        if ticket is None:
            return []
        provider.queue.remove(ticket)
        return [Refuse(ticket.id, error)]

    def refuse_all(self, provider: Provider, error: ResidentPoolError) -> list[Action]:
        return [action for ticket in list(provider.queue) for action in self.refuse(provider, ticket.id, error)]

    def released(self, now: float, lease_id: int, connection: int, outcome: str, served: int,
                 rc: int | None) -> list[Action]:
        """A lease ends. ``outcome``: ok; abandoned (interrupted mid-request); timeout; exiting (the worker said
        so) or died, with the exit code ``rc``; broken (its connection broke but the worker lives)."""
        lease = self.leases.get(lease_id)
        if lease is None:
            return []
        if lease.connection != connection:
            raise ResidentPoolError(f"lease {lease_id} is not held by this connection; a client releases only its "
                                    "own leases", reason="bad_request")
        del self.leases[lease_id]
        replica = self.lifecycle.replicas.get(lease.rid)
        if replica is None or replica.lease != lease_id:
            return []  # it ended meanwhile (a stop --now, a death seen between requests)
        self.lifecycle.unlease(now, replica, served)
        if outcome == "ok":
            return self.lifecycle.free(now, replica)
        if outcome in ("timeout", "exiting", "died"):
            return self.lifecycle.ended_mid_lease(now, replica, outcome, rc)
        why = "its client gave up on a request in flight" if outcome == "abandoned" \
            else "its client's connection to it broke"
        return self.lifecycle.abandon(now, replica, why)

    def recall(self, now: float, lease_id: int, why: str) -> list[Action]:
        """Ask the client of a backfilled lease to give it back after its current request (once). A lease granted
        without the backfilled mark is never recalled, whoever asks (the host service included)."""
        lease = self.leases.get(lease_id)
        if lease is None or lease.recalled is not None or not lease.backfilled:
            return []
        lease.recalled = why
        replica = self.lifecycle.replicas[lease.rid]
        return [Recall(lease.id, lease.rid, why),
                Announce("admission.recalled", self.providers[replica.key].slug,
                         (("replica", replica.index), ("lease", lease.id), ("why", why)))]

    def connection_closed(self, now: float, connection: int) -> tuple[set[str], list[Action]]:
        """A client went away (a killed flow run): each wait it had is dropped, each lease abandoned."""
        touched, actions = set(), []
        for ticket in [t for t in self.tickets.values() if t.connection == connection]:
            if self.ticket_gone(ticket.id) is not None:
                touched.add(ticket.key)
        for lease in [lease for lease in self.leases.values() if lease.connection == connection]:
            del self.leases[lease.id]
            replica = self.lifecycle.replicas.get(lease.rid)
            if replica is not None and replica.lease == lease.id:
                self.lifecycle.unlease(now, replica, 0)
                actions += self.lifecycle.abandon(now, replica, "its client went away")
                touched.add(replica.key)
        return touched, actions

    def expired(self, now: float) -> list[tuple[Provider, Ticket]]:
        """Tickets past their wait for a free replica (none is starting for them)."""
        found = []
        for ticket in list(self.tickets.values()):
            provider = self.providers[ticket.key]
            if now >= ticket.deadline and ticket.id not in self.lifecycle.covering(provider):
                found.append((provider, ticket))
        return found
