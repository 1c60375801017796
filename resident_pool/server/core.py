"""The pool's decision core: every rule about providers, replicas, waiting requests and leases.

No threads, sockets, files or clock here. Each event is a method that takes ``now``,
changes the records and returns the actions the runtime must carry out (start, stop,
ping, hibernate, answer a waiting client, ...); the runtime reports how each action
ended as another event, and the core decides again. Nothing outside the core changes
a replica's state or a lease, so every rule can be tested with a fake clock.

``PoolState`` is the core's one face: it keeps the providers and the pool's own state
(stopping, quiet, kept warm) and routes each event to the part that owns what it
changes, replicas (``lifecycle``), the waiting line and leases (``leases``) or the
starts waiting for GPU memory (``admitting``); after any event, free replicas go to
whoever waits, and the GPU line is decided again.
"""

from __future__ import annotations

from typing import Any

from .. import priority as order
from ..errors import AdmissionTimeout, BreakerOpen, PoolStopping, ResidentPoolError, error_from_dict
from .actions import Action, Announce, Exit, Policy, Refuse, Spawn, Timings, Withdraw
from .admitting import Admitting
from .breaker import Breaker
from .leases import Leasing
from .lifecycle import Lifecycle, replica_rows
from .replica import Lease, Provider, Replica, Spec, Ticket
from .states import ReplicaState, StopCause

__all__ = ["PoolState", "breaker_error", "replica_timeout", "stopping_error"]


class PoolState:
    """Providers and the pool's own state; every event about them, routed to the part that owns it."""

    def __init__(self, timings: Timings, now: float = 0.0, policy: Policy | None = None) -> None:
        self.timings = timings
        self.policy = policy or Policy()
        self.providers: dict[str, Provider] = {}
        self.lifecycle = Lifecycle(self.providers, timings)
        self.leasing = Leasing(self.providers, self.lifecycle, timings, self.policy)
        self.admitting = Admitting(self.providers, self.lifecycle, self.leasing, self.policy)
        self.stopping: str | None = None  # why the pool is stopping; None while it serves
        self.quiet_since = now
        self.last_keep_warm = now - timings.keep_warm_s

    # -- reading ------------------------------------------------------------------------------------
    @property
    def replicas(self) -> dict[int, Replica]:
        return self.lifecycle.replicas

    @property
    def leases(self) -> dict[int, Lease]:
        return self.leasing.leases

    @property
    def tickets(self) -> dict[int, Ticket]:
        return self.leasing.tickets

    def replica(self, rid: int) -> Replica | None:
        return self.lifecycle.replicas.get(rid)

    def serves_new_requests(self, replica: Replica) -> bool:
        return self.lifecycle.serves_new_requests(replica)

    def idle(self) -> bool:
        """Nothing leased and every replica ready: a pool of another version may step aside."""
        return not self.leases and all(r.state == "ready" for r in self.replicas.values())

    def _assign(self, now: float, key: str | None) -> list[Action]:
        """After an event: free replicas of ``key`` go to whoever waits, then the GPU line is decided again."""
        provider = self.providers.get(key) if key is not None else None
        actions = [] if provider is None or self.stopping else self.leasing.assign(now, provider,
                                                                                   self.admitting.claims)
        return actions + self.admitting.decide(now)

    def _key(self, rid: int) -> str | None:
        replica = self.lifecycle.replicas.get(rid)
        return replica.key if replica is not None else None

    # -- providers ------------------------------------------------------------------------------------
    def register(self, now: float, key: str, slug: str, version: str, fingerprint: str, spec: Spec,
                 variant: bool = False) -> list[Action]:
        """A provider as its manifest is now; a new version drains the replicas of the old one."""
        provider = self.providers.get(key)
        if provider is None:
            self.providers[key] = Provider(key, slug, version, fingerprint, spec,
                                           Breaker(self.timings.breaker_cooldown_s), variant)
            return []
        provider.spec, provider.fingerprint, provider.variant = spec, fingerprint, variant
        if version == provider.version:
            return []
        old, provider.version = provider.version, version
        actions: list[Action] = []
        for replica in list(provider.replicas.values()):
            if replica.version != version:
                actions += self.lifecycle.retire(now, replica, StopCause.DRAINED,
                                                 f"its manifest changed (version {version} replaces {old})")
        return actions + self._assign(now, key)

    # -- waiting and leases ----------------------------------------------------------------------------
    def acquire(self, now: float, key: str, connection: int, holder: dict[str, str],
                priority: str = order.DEFAULT, keep: bool = False) -> tuple[int, list[Action]]:
        """A client asks for a replica of ``key`` in class ``priority``: a ticket, answered by a Grant or a Refuse.

        ``keep`` (Pool.predict): the client keeps the lease between calls; it counts as idle while no request
        runs, and is recalled when another client waits, admission needs the memory, or the worker retires."""
        provider = self.providers[key]
        ticket = self.leasing.new_ticket(now, provider, connection, holder, priority, keep)
        if self.stopping:
            return ticket.id, [Refuse(ticket.id, stopping_error())]
        if provider.breaker.is_open(provider.fingerprint, now):
            return ticket.id, [Refuse(ticket.id, breaker_error(provider, now))]
        self.leasing.wait(ticket)
        return ticket.id, self._assign(now, key)

    def ticket_gone(self, now: float, ticket_id: int) -> list[Action]:
        provider = self.leasing.ticket_gone(ticket_id)
        return self._assign(now, provider.key) if provider is not None else []

    def released(self, now: float, lease_id: int, connection: int, outcome: str, served: int = 0,
                 rc: int | None = None) -> list[Action]:
        lease = self.leases.get(lease_id)
        key = self._key(lease.rid) if lease is not None else None
        return self.leasing.released(now, lease_id, connection, outcome, served, rc) + self._assign(now, key)

    def used(self, now: float, lease_id: int, connection: int, served: int) -> list[Action]:
        lease = self.leases.get(lease_id)
        self.leasing.used(now, lease_id, connection, served)
        return self._assign(now, self._key(lease.rid)) if lease is not None else []  # a waiter may take it now

    def recalled(self, now: float, lease_id: int, idle_s: float = 0.0, served: int | None = None,
                 failure: str | None = None) -> list[Action]:
        key, actions = self.leasing.recalled(now, lease_id, idle_s, served, failure)
        if failure is not None:
            return actions  # tried again at the next tick, not at once: the pool's own trouble needs a moment
        return actions + self._assign(now, key)

    def connection_closed(self, now: float, connection: int) -> list[Action]:
        touched, actions = self.leasing.connection_closed(now, connection)
        return actions + [a for key in sorted(touched) for a in self._assign(now, key)]

    # -- what the runtime saw of a replica ----------------------------------------------------------------
    def prepared(self, now: float, rid: int, need_gb: float | None, device: int | None = None,
                 wait: bool = True) -> list[Action]:
        """A start is ready to spawn, once its ``need_gb`` of GPU memory (None: none) is placed."""
        replica = self.replica(rid)
        if replica is None or replica.state is not ReplicaState.STARTING:
            return []
        if replica.abort is not None:
            return [Withdraw(rid, "start_cancelled")]
        if need_gb is None:
            self.lifecycle.admitted(now, rid, None)
            return [Spawn(rid)]
        return self.admitting.enter(now, replica, need_gb, device, wait)

    def placed(self, now: float, rid: int, device: int, backfilled: bool = False) -> list[Action]:
        """Its budget is in the ledger on ``device`` (ahead of the head of the line if ``backfilled``)."""
        self.admitting.placed(now, rid)
        replica = self.replica(rid)
        if replica is None or replica.state is not ReplicaState.STARTING:
            return self.admitting.decide(now)  # ended meanwhile: its Gone gives the budget back
        self.lifecycle.admitted(now, rid, str(device), backfilled)
        actions: list[Action] = []
        if backfilled:
            head = self.admitting.in_order(now)[:1]
            actions.append(Announce("admission.backfilled", self.providers[replica.key].slug, (
                ("replica", replica.index), ("device", device), ("budget_gb", replica.budget_gb),
                ("ahead_of", self.providers[head[0].key].slug if head else None))))
        actions.append(Withdraw(rid, "start_cancelled") if replica.abort is not None else Spawn(rid))
        return actions + self.admitting.decide(now)

    def not_placed(self, now: float, rid: int, rooms: dict[int, float]) -> list[Action]:
        """A placement found no room: ``rooms`` is the room per device it read."""
        return self.admitting.not_placed(now, rid, rooms)

    def memory_freed(self, now: float) -> list[Action]:
        """A budget went back to the ledger (or another pool's did, the host service says)."""
        return self.admitting.freed(now)

    def recall(self, now: float, rid: int, why: str) -> list[Action]:
        """The host admission service wants a backfilled worker's memory back for another pool's request."""
        return self.admitting.recall(now, rid, why)

    def admitted(self, now: float, rid: int, device: str | None) -> list[Action]:
        return self.lifecycle.admitted(now, rid, device)

    def spawned(self, now: float, rid: int, pid: int) -> list[Action]:
        return self.lifecycle.spawned(now, rid, pid)

    def restarted(self, now: float, rid: int, why: str) -> list[Action]:
        return self.lifecycle.restarted(now, rid, why)

    def started(self, now: float, rid: int, pid: int | None, can_recall: bool = False) -> list[Action]:
        key = self._key(rid)
        return self.lifecycle.started(now, rid, pid, can_recall) + self._assign(now, key)

    def start_failed(self, now: float, rid: int, error: ResidentPoolError) -> list[Action]:
        """The start ended without a worker: the request it was for hears why; an open breaker refuses the rest."""
        key = self._key(rid)
        self.admitting.leave(rid)
        self.admitting.giving_back(self.replica(rid))
        actions, error, ticket = self.lifecycle.start_failed(now, rid, error, self.stopping is not None)
        if key is None:
            return actions
        provider = self.providers[key]
        actions += self.leasing.refuse(provider, ticket, error) if error.reason != "client_gone" else []
        if provider.breaker.remaining_s(now) > 0:
            actions += self.leasing.refuse_all(provider, breaker_error(provider, now))
        return actions + self._assign(now, key)

    def pinged(self, now: float, rid: int, purpose: str, answered: bool, rc: int | None = None,
               failure: str | None = None, served: int | None = None) -> list[Action]:
        key = self._key(rid)
        return self.lifecycle.pinged(now, rid, purpose, answered, rc, failure, served) + self._assign(now, key)

    def exited(self, now: float, rid: int, rc: int) -> list[Action]:
        key = self._key(rid)
        return self.lifecycle.exited(now, rid, rc) + self._assign(now, key)

    def hibernated(self, now: float, rid: int, ok: bool, why: str) -> list[Action]:
        key = self._key(rid)
        self.admitting.giving_back(self.replica(rid) if ok else None)
        return self.lifecycle.hibernated(now, rid, ok, why) + self._assign(now, key)

    def stopped(self, now: float, rid: int, failure: str | None = None) -> list[Action]:
        key = self._key(rid)
        self.admitting.giving_back(self.replica(rid))
        actions = self.lifecycle.stopped(now, rid, failure)
        if rid not in self.replicas:
            self.leasing.drop_kept(rid)
        provider = self.providers.get(key) if key is not None else None
        if provider is not None and provider.variant and not provider.replicas and not provider.queue:
            del self.providers[key]  # a variant (a check's run) is gone with its last replica
            return actions
        return actions + self._assign(now, key)

    # -- ending replicas on purpose ------------------------------------------------------------------------
    def retire(self, now: float, rid: int, cause: StopCause, why: str) -> list[Action]:
        """End a replica once it is free (its measured memory is over budget, say)."""
        replica = self.replica(rid)
        if replica is None or replica.retire is not None:
            return []
        return self.lifecycle.retire(now, replica, cause, why) + self._assign(now, replica.key)

    def stop(self, now: float, key: str | None, at_once: bool, why: str,
             cause: StopCause = StopCause.STOPPED) -> tuple[list[int], list[Action]]:
        """Stop ``key``'s replicas (every provider's when None); leased ones drain first, up to drain_grace_s."""
        targets = [r for r in self.replicas.values() if key in (None, r.key)]
        if key is not None and key in self.providers:
            self.providers[key].breaker.reset()
        actions: list[Action] = []
        for replica in targets:
            actions += self.lifecycle.retire(now, replica, cause, why, at_once=at_once,
                                             drain_by=now + self.timings.drain_grace_s)
        return [r.rid for r in targets], actions

    def shutdown(self, now: float, why: str, at_once: bool = False) -> list[Action]:
        """Stop taking leases, refuse every waiting request, stop every replica (leased ones drain first)."""
        if self.stopping:
            return []
        self.stopping = why
        actions = [a for p in self.providers.values() for a in self.leasing.refuse_all(p, stopping_error())]
        return actions + self.stop(now, None, at_once, f"the pool is stopping ({why})", StopCause.POOL_STOPPING)[1]

    def eviction_candidate(self, skip: frozenset[int] = frozenset()) -> tuple[int, bool, dict[int, float]] | None:
        """The idle replica the GPU line would evict first (its order: ``Admitting.evictable``; ``skip``: replicas
        known busy): its id, whether it is kept warm, and the budgets every idle kept-warm replica holds, per
        device."""
        return self.admitting.candidate(skip)

    def evict(self, now: float, rid: int, needed_gb: float) -> list[Action]:
        """Make room for ``needed_gb``: the idle replica ``rid`` is evicted (a kept lease's once it is back)."""
        return self.lifecycle.evict(now, rid, needed_gb)

    def warm(self, now: float, key: str, replicas: int, wait: bool = True) -> tuple[list[int], list[Action]]:
        """Start replicas of ``key`` until ``replicas`` of its current version are live (held by nobody)."""
        provider = self.providers[key]
        if self.stopping:
            raise stopping_error()
        if provider.breaker.is_open(provider.fingerprint, now):
            raise breaker_error(provider, now)
        starts = [self.lifecycle.start(now, provider, None, wait=wait)
                  for _ in range(replicas - self.lifecycle.live(provider))]
        return [s.rid for s in starts], list(starts)

    # -- time passes ------------------------------------------------------------------------------------------
    def tick(self, now: float, connections: int = 0, in_flight: frozenset[int] | None = None) -> list[Action]:
        """Idle retirement, liveness pings, overdue reports, waits past their limit, ageing, the GPU line read
        again, quiet exit, kept warm. ``in_flight``: the kept-leased replicas the runtime found running a request
        (None: not read this time)."""
        actions: list[Action] = []
        if in_flight is not None:
            for replica in self.replicas.values():
                replica.in_flight = replica.rid in in_flight
        for replica in list(self.replicas.values()):
            actions += self.lifecycle.tick(now, replica)
        for provider, ticket in self.leasing.expired(now):
            actions += self.leasing.refuse(provider, ticket.id, replica_timeout(provider, now - ticket.arrived))
        actions += self.leasing.aged(now)
        actions += self.admitting.tick(now)
        for key in [key for key, provider in self.providers.items() if provider.queue]:
            actions += self._assign(now, key)  # what could not be done for them earlier (a recall not sent)
        admission_waiting = bool(self.admitting.line)
        if connections or self.replicas:
            self.quiet_since = now
        elif 0 < self.timings.quiet_exit_s <= now - self.quiet_since and not self.stopping:
            actions.append(Exit("quiet"))
        if now - self.last_keep_warm >= self.timings.keep_warm_s and not self.stopping and not admission_waiting:
            self.last_keep_warm = now
            for provider in list(self.providers.values()):
                if provider.spec.min_replicas > self.lifecycle.live(provider) \
                        and provider.breaker.remaining_s(now) == 0:
                    actions += self.warm(now, provider.key, provider.spec.min_replicas, wait=False)[1]
        return actions

    def snapshot(self, now: float) -> dict[str, Any]:
        """Plain data for status and metrics: the records as they are now."""
        return {
            "stopping": self.stopping,
            "providers": {key: {
                "slug": p.slug, "version": p.version, "fingerprint": p.fingerprint, "starts": p.starts,
                "last_error": p.last_error, "breaker": p.breaker.snapshot(now), "variant": p.variant,
                "waiting": [{"ticket": t.id, "holder": t.holder, "waited_s": round(now - t.arrived, 3),
                             "priority": t.priority, "asked": t.asked,
                             "ranks_as": order.CLASSES[order.effective(t.priority, now - t.arrived,
                                                                       self.policy.aging_s)]}
                            for t in self.leasing.in_order(now, p)],
                "min_replicas": p.spec.min_replicas, "max_replicas": p.spec.max_replicas,
            } for key, p in self.providers.items()},
            "replicas": replica_rows(self.lifecycle, now, self.leases),
            "gpu_line": self.admitting.rows(now),
            "policy": {"aging_s": self.policy.aging_s, "backfill": self.policy.backfill,
                       "classes": list(self.policy.classes)},
        }


# -- errors the core answers with ------------------------------------------------------------------------------
def stopping_error() -> PoolStopping:
    return PoolStopping("the pool is stopping; the client retries with the next pool")


def breaker_error(provider: Provider, now: float) -> BreakerOpen:
    breaker = provider.breaker
    original = error_from_dict(breaker.error or {"type": "WorkerStartError", "error": "its start failed"})
    left = breaker.remaining_s(now)
    return BreakerOpen(
        f"{provider.slug}: not started: its last {breaker.failures} start(s) failed, and the breaker stays open "
        f"{left:.0f} s more (or until its manifest changes); `resident-pool stop {provider.slug}` resets it. "
        f"The start failed with: {original.message}",
        slug=provider.slug, exit_code=original.exit_code, transcript=original.transcript,
        transcript_tail=original.transcript_tail,
        headline=f"{provider.slug}: not started, breaker open {left:.0f} s more: {original.headline}",
        details={"breaker": {"failures": breaker.failures, "closes_in_s": round(left, 1)},
                 "original": original.to_dict()})


def replica_timeout(provider: Provider, waited: float) -> AdmissionTimeout:
    spec = provider.spec
    held = [f"{r.name} {r.state}" for r in provider.replicas.values()]
    return AdmissionTimeout(
        f"{provider.slug}: waited {waited:.0f} s (admission_timeout_s = {spec.admission_timeout_s:g}) for "
        f"a free replica; max_replicas = {spec.max_replicas}, held: {'; '.join(held) or 'none'}; raise "
        "max_replicas or admission_timeout_s, or stop a holder (`resident-pool stop "
        f"{provider.slug}`)", slug=provider.slug, details={"waited_s": round(waited, 1), "held": held})
