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
from . import holding, starting
from .actions import Action, Announce, Grant, Policy, Refuse, Timings
from .lifecycle import Lifecycle
from .replica import Lease, Provider, Replica, Ticket
from .states import ReplicaState

__all__ = ["Leasing"]

R = ReplicaState
# A kept lease just granted is left this long for its one request (its client says when it used it).
FIRST_USE_S = 2.0


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
                   priority: str = order.DEFAULT, keep: bool = False) -> Ticket:
        """A request in class ``priority``, capped to the classes this pool may claim (``Policy.classes``);
        ``keep``: Pool.predict's, kept between calls."""
        granted = order.cap(priority, self.policy.classes)
        return Ticket(next(self._ids), provider.key, connection, holder, now, now + provider.spec.admission_timeout_s,
                      keep, priority=granted, asked=priority, rank=order.rank(granted))

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
            free = self._with_room(provider)
            if free is None or (claimed is not None and claimed(now, free, provider.queue[0])):
                break
            actions.append(self._lease(now, provider.queue.pop(0), free))
        for ticket in provider.queue[self._coming(provider):]:
            hibernated = self._first(provider, R.HIBERNATED)  # a restore costs a copy back, not a start
            if hibernated is not None:
                actions.append(self.lifecycle.restore(now, provider, hibernated, ticket.id))
            elif self.lifecycle.serving_count(provider) < provider.spec.max_replicas:
                actions.append(self.lifecycle.start(now, provider, ticket.id))
            elif (kept := self._first_kept(now, provider)) is not None:  # idle between calls: its slot is taken back
                replica, lease = kept
                actions += self.lifecycle.recall(now, replica, "another client waits for it", lease=lease)
            else:
                break
        return actions + self._scale_out(now, provider)

    def _with_room(self, provider: Provider) -> Replica | None:
        """The replica a new caller gets: one with room for it (a ready one, or one shared below max_callers), the
        fewest callers first, then the lowest number."""
        found = [r for r in provider.replicas.values() if self.lifecycle.room(r) > 0]
        return min(found, key=lambda r: (len(r.holds), r.index)) if found else None

    def _scale_out(self, now: float, provider: Provider) -> list[Action]:
        """Another replica for a provider whose every worker reports a queue wait past ``max_queue_wait_s`` (its
        callers share full batches), where max_replicas allows and none is starting already."""
        bound = provider.spec.max_queue_wait_s
        serving = [r for r in provider.replicas.values() if self.lifecycle.serving(r)]
        if bound is None or not serving or len(serving) >= provider.spec.max_replicas \
                or any(r.state is R.STARTING for r in serving) \
                or not all(r.queue_wait_s is not None and r.queue_wait_s > bound for r in serving):
            return []
        return [self.lifecycle.start(now, provider, None)]

    def _first(self, provider: Provider, state: ReplicaState) -> Replica | None:
        """The lowest-numbered replica in ``state`` that serves new requests."""
        found = [r for r in provider.replicas.values() if r.state is state and self.lifecycle.serving(r)]
        return min(found, key=lambda r: r.index) if found else None

    def _coming(self, provider: Provider) -> int:
        """Replicas that will serve soon: starting, answering a liveness ping, or a lease being recalled (not one
        recalled for its memory: that one is evicted once it is back)."""
        return sum(1 for r in provider.replicas.values()
                   if (r.state in (R.STARTING, R.CHECKING) or (r.recalling and r.eviction is None))
                   and r.abort is None
                   and self.lifecycle.serving(r))

    def in_first_use(self, now: float, replica: Replica) -> bool:
        """One of its kept leases was just granted and its holder has not used it yet (nor held it a moment
        without): it is not taken back, for a waiting client or for admission, before it served its one request."""
        return any(self._first_use(now, self.leases.get(hold.lease)) for hold in replica.holds.values() if hold.kept)

    @staticmethod
    def _first_use(now: float, lease: Lease | None) -> bool:
        return lease is not None and lease.noticed == 0 and now - lease.since < FIRST_USE_S

    def held_rank(self, replica: Replica) -> int:
        """The highest class (lowest rank) among the leases holding ``replica``."""
        ranks = [order.rank(lease.priority) for hold in replica.holds.values()
                 if (lease := self.leases.get(hold.lease)) is not None]
        return min(ranks, default=len(order.CLASSES))

    def ticket(self, ticket_id: int | None) -> Ticket | None:
        """A waiting request, by its id (None: none, or no longer waiting)."""
        return self.tickets.get(ticket_id) if ticket_id is not None else None

    def calling(self, now: float, replica: Replica) -> bool:
        """A kept lease whose holder is still calling: a request ran on it at the runtime's last look, or its
        client was heard of (granted, or told of a call) within ``kept_active_s`` and does not wait for another
        replica now (a client's connection is one thread: waiting there, it calls nothing else)."""
        if not replica.kept:
            return False
        if replica.in_flight_since is not None:
            return True
        waiting = {ticket.connection for ticket in self.tickets.values()}
        return any(now - max(lease.since, lease.heard) < self.timings.kept_active_s and lease.connection not in waiting
                   for hold in replica.holds.values() if (lease := self.leases.get(hold.lease)) is not None)

    def _first_kept(self, now: float, provider: Provider) -> tuple[Replica, int] | None:
        """The kept lease used least recently (and its replica), not already being recalled nor in its first use."""
        kept = [(max(lease.since, lease.heard), r.index, lease.id, r) for r in provider.replicas.values()
                if self.lifecycle.serving(r) for hold in r.holds.values()
                if hold.kept and hold.recall is None and (lease := self.leases.get(hold.lease)) is not None
                and not self._first_use(now, lease)]
        if not kept:
            return None
        _, _, lease_id, replica = min(kept, key=lambda found: found[:3])
        return replica, lease_id

    def _lease(self, now: float, ticket: Ticket, replica: Replica) -> Grant:
        self.tickets.pop(ticket.id, None)
        lease = Lease(next(self._ids), replica.rid, ticket.connection, ticket.holder, now,
                      priority=ticket.priority, backfilled=replica.backfilled)
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
        covered = starting.covering(provider)
        starting.hand_over(provider, ticket_id, [t.id for t in provider.queue if t.id not in covered])
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
        hold = replica.holds.get(lease_id) if replica is not None else None
        if replica is None or hold is None:
            return []  # it ended meanwhile (a stop --now, a death seen between requests)
        if outcome == "ok" and hold.recall is not None:  # given back on a recall (by its client, before the worker's
            return self.lifecycle.recalled(now, replica, lease_id, 0.0, served)  # answer): made room for if asked
        holding.letting_go(now, replica, lease_id, served)
        if outcome == "ok":
            return self.lifecycle.free(now, replica)
        if outcome in ("timeout", "exiting", "died"):
            return self.lifecycle.ended_mid_lease(now, replica, outcome, rc)
        why = {"abandoned": "its client gave up on a request in flight",
               "bad_reply": "it sent its client a reply that could not be read"}.get(
            outcome, "its client's connection to it broke")
        return self.lifecycle.abandon(now, replica, why)

    def used(self, now: float, lease_id: int, connection: int, served: int, queue_wait_s: float | None = None) -> None:
        """The client of a kept lease says it served ``served`` more requests (now and then, not every call), and
        how long its last request waited in its worker's queue (a batching worker says so)."""
        lease = self.leases.get(lease_id)
        if lease is None or lease.connection != connection or not lease.kept:
            return  # recalled meanwhile, or not its own: nothing to learn
        lease.noticed += served
        lease.heard = now
        replica = self.lifecycle.replicas.get(lease.rid)
        if replica is not None and lease_id in replica.holds:
            holding.touch(now, replica, served)
            if queue_wait_s is not None:
                replica.queue_wait_s = queue_wait_s

    def recalled(self, now: float, lease_id: int, idle_s: float, served: int | None,
                 failure: str | None = None) -> tuple[str | None, list[Action]]:
        """A recalled lease is back from its worker (``served``: requests it served on it, by its own count): the
        lease ends, and its replica is free. ``failure``: the pool could not send the recall; the lease stays."""
        lease = self.leases.get(lease_id)
        replica = self.lifecycle.replicas.get(lease.rid) if lease is not None else None
        hold = replica.holds.get(lease_id) if replica is not None else None
        if lease is None or replica is None or hold is None or hold.recall is None:
            return None, []
        if failure is not None:
            return replica.key, holding.recall_failed(replica, lease_id, failure)
        del self.leases[lease_id]
        unheard = max(0, served - lease.noticed) if served is not None else 0
        return replica.key, self.lifecycle.recalled(now, replica, lease_id, idle_s, unheard)

    def drop_kept(self, rid: int) -> None:
        """The replica ended: a kept lease on it ends too (its client finds out on its next call and acquires
        again); a session's lease stays until its client releases it and hears how the worker ended."""
        for lease in [lease for lease in self.leases.values() if lease.rid == rid and lease.kept]:
            del self.leases[lease.id]

    def recall(self, now: float, lease_id: int, why: str, evict_for: float | None = None) -> list[Action]:
        """Take lease ``lease_id`` back for admission (the GPU line's head, or the host admission service):
        ``Lifecycle.recall``'s one rule says whether it may be and how; a backfilled one is announced."""
        lease = self.leases.get(lease_id)
        replica = self.lifecycle.replicas.get(lease.rid) if lease is not None else None
        if lease is None or replica is None or lease_id not in replica.holds:
            return []
        actions = self.lifecycle.recall(now, replica, why, evict_for, backfilled=lease.backfilled, lease=lease_id)
        if actions and lease.backfilled:
            actions.append(Announce("admission.recalled", self.providers[replica.key].slug,
                                    (("replica", replica.index), ("lease", lease.id), ("why", why))))
        return actions

    def connection_closed(self, now: float, connection: int) -> tuple[set[str], list[Action]]:
        """A client went away (a killed flow run): each wait it had is dropped, each lease abandoned."""
        touched, actions = set(), []
        for ticket in [t for t in self.tickets.values() if t.connection == connection]:
            if self.ticket_gone(ticket.id) is not None:
                touched.add(ticket.key)
        for lease in [lease for lease in self.leases.values() if lease.connection == connection]:
            del self.leases[lease.id]
            replica = self.lifecycle.replicas.get(lease.rid)
            if replica is not None and lease.id in replica.holds:
                holding.letting_go(now, replica, lease.id, 0)
                kept = (lease.id, lease.noticed) if lease.kept else None
                actions += self.lifecycle.abandon(now, replica, "its client went away", kept)
                touched.add(replica.key)
        return touched, actions

    def expired(self, now: float) -> list[tuple[Provider, Ticket]]:
        """Tickets past their wait for a free replica (none is starting for them)."""
        found = []
        for ticket in list(self.tickets.values()):
            provider = self.providers[ticket.key]
            if now >= ticket.deadline and ticket.id not in starting.covering(provider):
                found.append((provider, ticket))
        return found
