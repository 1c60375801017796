"""The decision core's waiting line and leases: who waits for a replica, in which order, and who holds one.

It owns the tickets (requests waiting for a replica), each provider's queue of them, and
the leases; the replicas themselves move only through ``lifecycle.Lifecycle``.
"""

from __future__ import annotations

import itertools

from ..errors import ResidentPoolError
from .actions import Action, Grant, Refuse, Timings
from .lifecycle import Lifecycle
from .replica import Lease, Provider, Replica, Ticket
from .states import ReplicaState

__all__ = ["Leasing"]

R = ReplicaState
# A kept lease just granted is left this long for its one request (its client says when it used it).
FIRST_USE_S = 2.0


class Leasing:
    """Tickets in line per provider, and the leases that end their wait."""

    def __init__(self, providers: dict[str, Provider], lifecycle: Lifecycle, timings: Timings) -> None:
        self.providers = providers  # the core's registry; this class owns each provider's ``queue``
        self.lifecycle = lifecycle
        self.timings = timings
        self.tickets: dict[int, Ticket] = {}
        self.leases: dict[int, Lease] = {}
        self._ids = itertools.count(1)

    def new_ticket(self, now: float, provider: Provider, connection: int, holder: dict[str, str],
                   keep: bool = False) -> Ticket:
        return Ticket(next(self._ids), provider.key, connection, holder, now, now + provider.spec.admission_timeout_s,
                      keep)

    def wait(self, ticket: Ticket) -> None:
        """Put ``ticket`` in its provider's line (served in arrival order)."""
        self.tickets[ticket.id] = ticket
        self.providers[ticket.key].queue.append(ticket)

    def assign(self, now: float, provider: Provider) -> list[Action]:
        """Hand free replicas to waiting requests in order; start (or restore) more where they may."""
        actions: list[Action] = []
        while provider.queue:
            free = self._first(provider, R.READY)
            if free is None:
                break
            actions.append(self._lease(now, provider.queue.pop(0), free))
        for ticket in provider.queue[self._coming(provider):]:
            hibernated = self._first(provider, R.HIBERNATED)  # a restore costs a copy back, not a start
            if hibernated is not None:
                actions.append(self.lifecycle.restore(now, provider, hibernated, ticket.id))
            elif self.lifecycle.live(provider) < provider.spec.max_replicas:
                actions.append(self.lifecycle.start(now, provider, ticket.id))
            elif (kept := self._first_kept(now, provider)) is not None:
                actions += self.lifecycle.recall(now, kept)  # a kept lease is idle between calls: it yields
            else:
                break
        return actions

    def _first(self, provider: Provider, state: ReplicaState) -> Replica | None:
        """The lowest-numbered replica in ``state`` that serves new requests."""
        found = [r for r in provider.replicas.values() if r.state is state and self.lifecycle.serves_new_requests(r)]
        return min(found, key=lambda r: r.index) if found else None

    def _coming(self, provider: Provider) -> int:
        """Replicas that will serve soon: starting, answering a liveness ping, or a kept lease being recalled."""
        return sum(1 for r in provider.replicas.values()
                   if (r.state in (R.STARTING, R.CHECKING) or r.recalling) and r.abort is None
                   and self.lifecycle.serves_new_requests(r))

    def _first_kept(self, now: float, provider: Provider) -> Replica | None:
        """The kept lease used least recently, not already being recalled, that its holder has used (or has
        held a moment without): a lease just granted is not taken back before it served its one request."""
        def used(replica: Replica) -> bool:
            lease = self.leases.get(replica.lease) if replica.lease is not None else None
            return lease is not None and (lease.noticed > 0 or now - lease.since >= FIRST_USE_S)

        kept = [r for r in provider.replicas.values()
                if r.kept and not r.recalling and self.lifecycle.serves_new_requests(r) and used(r)]
        return min(kept, key=lambda r: (r.last_used, r.index)) if kept else None

    def _lease(self, now: float, ticket: Ticket, replica: Replica) -> Grant:
        self.tickets.pop(ticket.id, None)
        lease = Lease(next(self._ids), replica.rid, ticket.connection, ticket.holder, now)
        cold, lease.kept = self.lifecycle.lease(replica, lease.id, ticket.keep)
        self.leases[lease.id] = lease
        return Grant(ticket.id, lease.id, replica.rid, cold, lease.kept)

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
        return self.lifecycle.drains.abandon(now, replica, why)

    def used(self, now: float, lease_id: int, connection: int, served: int) -> None:
        """The client of a kept lease says it served ``served`` more requests (now and then, not every call)."""
        lease = self.leases.get(lease_id)
        if lease is None or lease.connection != connection or not lease.kept:
            return  # recalled meanwhile, or not its own: nothing to learn
        lease.noticed += served
        replica = self.lifecycle.replicas.get(lease.rid)
        if replica is not None and replica.lease == lease_id:
            self.lifecycle.touch(now, replica, served)

    def recalled(self, now: float, lease_id: int, idle_s: float, served: int | None,
                 failure: str | None = None) -> tuple[str | None, list[Action]]:
        """A kept lease is back from its worker (``served``: requests it served on it, by its own count): the
        lease ends, and its replica is free. ``failure``: the pool could not send the recall; the lease stays."""
        lease = self.leases.get(lease_id)
        replica = self.lifecycle.replicas.get(lease.rid) if lease is not None else None
        if replica is None or replica.lease != lease_id or not replica.recalling:
            return None, []
        if failure is not None:
            return replica.key, self.lifecycle.recall_failed(now, replica, failure)
        del self.leases[lease_id]
        unheard = max(0, served - lease.noticed) if served is not None else 0
        return replica.key, self.lifecycle.recalled(now, replica, idle_s, unheard)

    def drop_kept(self, rid: int) -> None:
        """The replica ended: a kept lease on it ends too (its client finds out on its next call and acquires
        again); a session's lease stays until its client releases it and hears how the worker ended."""
        for lease in [lease for lease in self.leases.values() if lease.rid == rid and lease.kept]:
            del self.leases[lease.id]

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
                kept = (lease.id, lease.noticed) if lease.kept else None
                actions += self.lifecycle.drains.abandon(now, replica, "its client went away", kept)
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
