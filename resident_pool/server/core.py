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

from collections.abc import Callable
from typing import TypeVar

from .. import priority as order
from ..errors import AdmissionTimeout, BreakerOpen, PoolStopping, ResidentPoolError, error_from_dict
from . import events as ev
from . import starting
from .actions import Action, Announce, Exit, Forget, Policy, Refuse, Spawn, Timings, Withdraw
from .admitting import Admitting
from .breaker import Breaker
from .leases import Leasing
from .lifecycle import Lifecycle
from .replica import Lease, Provider, Replica, Ticket
from .states import ReplicaState, StopCause
from .view import CoreView, LeaseView, ProviderView, ReplicaView, TicketView

__all__ = ["PoolState", "breaker_error", "provider_gone", "replica_timeout", "stopping_error"]


_E = TypeVar("_E", bound=ev.Event)
_Handler = Callable[[float, ev.Event], ev.Decision]


def _route(kind: type[_E], handler: Callable[[float, _E], ev.Decision]) -> tuple[type[_E], _Handler]:
    """``handler`` for events of ``kind``, as the one entry point calls it (with any event, its own by type)."""
    def run(now: float, event: ev.Event) -> ev.Decision:
        assert isinstance(event, kind)  # handle() looked it up by type(event)
        return handler(now, event)
    return kind, run


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
        self._handlers = self._dispatch()

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

    def _assign(self, now: float, key: str | None) -> list[Action]:
        """After an event: free replicas of ``key`` go to whoever waits, then the GPU line is decided again."""
        provider = self.providers.get(key) if key is not None else None
        actions = [] if provider is None or self.stopping else self.leasing.assign(now, provider,
                                                                                   self.admitting.claims)
        return actions + self.admitting.decide(now)

    def _key(self, rid: int) -> str | None:
        replica = self.lifecycle.replicas.get(rid)
        return replica.key if replica is not None else None

    # -- the one entry point ----------------------------------------------------------------------------
    def handle(self, now: float, event: ev.Event) -> ev.Decision:
        """Decide what ``event`` calls for at ``now``: the actions to carry out, and what its asker needs back."""
        return self._handlers[type(event)](now, event)

    def _dispatch(self) -> dict[type, _Handler]:
        return dict([
            _route(ev.ManifestRead, self._manifest_read), _route(ev.ClientAsked, self._client_asked),
            _route(ev.TicketGone, self._ticket_gone), _route(ev.LeaseReleased, self._lease_released),
            _route(ev.LeaseUsed, self._lease_used), _route(ev.LeaseRecalled, self._lease_recalled),
            _route(ev.ConnectionClosed, self._connection_closed), _route(ev.StartPrepared, self._start_prepared),
            _route(ev.BudgetPlaced, self._budget_placed), _route(ev.BudgetNotPlaced, self._budget_not_placed),
            _route(ev.MemoryFreed, self._memory_freed), _route(ev.HostRecall, self._host_recall),
            _route(ev.WorkerSpawned, self._worker_spawned), _route(ev.RestoreFailed, self._restore_failed),
            _route(ev.WorkerStarted, self._worker_started), _route(ev.StartFailed, self._start_failed),
            _route(ev.Pinged, self._pinged), _route(ev.WorkerExited, self._worker_exited),
            _route(ev.HibernationEnded, self._hibernation_ended), _route(ev.WorkerStopped, self._worker_stopped),
            _route(ev.RetireAsked, self._retire_asked), _route(ev.StopAsked, self._stop_asked),
            _route(ev.ShutdownAsked, self._shutdown_asked), _route(ev.WarmAsked, self._warm_asked),
            _route(ev.Tick, self._tick),
        ])

    # -- providers ------------------------------------------------------------------------------------
    def _manifest_read(self, now: float, event: ev.ManifestRead) -> ev.Decision:
        """A provider as its manifest is now; a new version drains the replicas of the old one."""
        provider = self.providers.get(event.key)
        if provider is None:
            self.providers[event.key] = Provider(event.key, event.slug, event.version, event.fingerprint, event.spec,
                                                 Breaker(self.timings.breaker_cooldown_s), event.variant)
            return ev.Decision()
        provider.spec, provider.fingerprint, provider.variant = event.spec, event.fingerprint, event.variant
        if event.version == provider.version:
            return ev.Decision()
        old, provider.version = provider.version, event.version
        actions: list[Action] = []
        for replica in list(provider.replicas.values()):
            if replica.version != event.version:
                actions += self.lifecycle.retire(now, replica, StopCause.DRAINED,
                                                 f"its manifest changed (version {event.version} replaces {old})")
        return ev.Decision(actions + self._assign(now, event.key))

    # -- waiting and leases ----------------------------------------------------------------------------
    def _client_asked(self, now: float, event: ev.ClientAsked) -> ev.Decision:
        """A ticket, answered by a Grant or a Refuse. A kept lease (``keep``: Pool.predict's) counts as idle once its
        holder stops calling, and is recalled when another client waits, admission needs the memory, or the worker
        retires."""
        provider = self.providers.get(event.key)
        if provider is None:  # a check's variant, gone with its last replica since its manifest was read
            return ev.Decision(error=provider_gone(event.key))
        ticket = self.leasing.new_ticket(now, provider, event.connection, event.holder, event.priority, event.keep)
        if self.stopping:
            return ev.Decision([Refuse(ticket.id, stopping_error())], ticket=ticket.id)
        if provider.breaker.is_open(provider.fingerprint, now):
            return ev.Decision([Refuse(ticket.id, breaker_error(provider, now))], ticket=ticket.id)
        self.leasing.wait(ticket)
        return ev.Decision(self._assign(now, event.key), ticket=ticket.id)

    def _ticket_gone(self, now: float, event: ev.TicketGone) -> ev.Decision:
        provider = self.leasing.ticket_gone(event.ticket)
        return ev.Decision(self._assign(now, provider.key) if provider is not None else [])

    def _lease_released(self, now: float, event: ev.LeaseReleased) -> ev.Decision:
        lease = self.leases.get(event.lease)
        key = self._key(lease.rid) if lease is not None else None
        replica = self.replicas.get(lease.rid) if lease is not None else None
        if event.outcome == "timeout" and replica is not None:  # measured as the client gave up: fresher than a tick's
            replica.in_flight_since = None if event.in_flight_s is None else now - event.in_flight_s
        actions = self.leasing.released(now, event.lease, event.connection, event.outcome, event.served, event.rc)
        return ev.Decision(actions + self._assign(now, key))

    def _lease_used(self, now: float, event: ev.LeaseUsed) -> ev.Decision:
        lease = self.leases.get(event.lease)
        self.leasing.used(now, event.lease, event.connection, event.served, event.queue_wait_s)
        return ev.Decision(self._assign(now, self._key(lease.rid)) if lease is not None else [])  # a waiter may take it

    def _lease_recalled(self, now: float, event: ev.LeaseRecalled) -> ev.Decision:
        key, actions = self.leasing.recalled(now, event.lease, event.idle_s, event.served, event.failure)
        if event.failure is not None:
            return ev.Decision(actions)  # tried again at the next tick: the pool's own trouble needs a moment
        return ev.Decision(actions + self._assign(now, key))

    def _connection_closed(self, now: float, event: ev.ConnectionClosed) -> ev.Decision:
        touched, actions = self.leasing.connection_closed(now, event.connection)
        return ev.Decision(actions + [a for key in sorted(touched) for a in self._assign(now, key)])

    # -- what the runtime saw of a replica ----------------------------------------------------------------
    def _start_prepared(self, now: float, event: ev.StartPrepared) -> ev.Decision:
        replica = self.replica(event.rid)
        if replica is None or replica.state is not ReplicaState.STARTING:
            return ev.Decision()
        if replica.abort is not None:
            return ev.Decision([Withdraw(event.rid, "start_cancelled")])
        if event.need_gb is None:
            starting.admitted(replica, None)
            return ev.Decision([Spawn(event.rid)])
        return ev.Decision(self.admitting.enter(now, replica, event.need_gb, event.device, event.wait))

    def _budget_placed(self, now: float, event: ev.BudgetPlaced) -> ev.Decision:
        rid = event.rid
        self.admitting.placed(now, rid)
        replica = self.replica(rid)
        if replica is None or replica.state is not ReplicaState.STARTING:
            return ev.Decision(self.admitting.decide(now))  # ended meanwhile: its Gone gives the budget back
        starting.admitted(replica, str(event.device), event.backfilled)
        actions: list[Action] = []
        if event.backfilled:
            head = self.admitting.in_order(now)[:1]
            actions.append(Announce("admission.backfilled", self.providers[replica.key].slug, (
                ("replica", replica.index), ("device", event.device), ("budget_gb", replica.budget_gb),
                ("ahead_of", self.providers[head[0].key].slug if head else None))))
        actions.append(Withdraw(rid, "start_cancelled") if replica.abort is not None else Spawn(rid))
        return ev.Decision(actions + self.admitting.decide(now))

    def _budget_not_placed(self, now: float, event: ev.BudgetNotPlaced) -> ev.Decision:
        return ev.Decision(self.admitting.not_placed(now, event.rid, event.rooms))

    def _memory_freed(self, now: float, event: ev.MemoryFreed) -> ev.Decision:
        return ev.Decision(self.admitting.freed(now))

    def _host_recall(self, now: float, event: ev.HostRecall) -> ev.Decision:
        return ev.Decision(self.admitting.recall(now, event.rid, event.why))

    def _worker_spawned(self, now: float, event: ev.WorkerSpawned) -> ev.Decision:
        starting.spawned(self.replica(event.rid), event.pid)
        return ev.Decision()

    def _restore_failed(self, now: float, event: ev.RestoreFailed) -> ev.Decision:
        replica = self.replica(event.rid)
        starting.restore_failed(replica, self.providers.get(replica.key) if replica else None, event.why)
        return ev.Decision()

    def _worker_started(self, now: float, event: ev.WorkerStarted) -> ev.Decision:
        key = self._key(event.rid)
        return ev.Decision(self.lifecycle.started(now, event.rid, event.pid, event.can_recall) + self._assign(now, key))

    def _start_failed(self, now: float, event: ev.StartFailed) -> ev.Decision:
        """The request the start was for hears why; an open breaker refuses the rest."""
        rid, key = event.rid, self._key(event.rid)
        self.admitting.leave(rid)
        self.admitting.giving_back(self.replica(rid))
        actions, error, ticket = self.lifecycle.start_failed(now, rid, event.error, self.stopping is not None)
        if key is None:
            return ev.Decision(actions)
        provider = self.providers[key]
        actions += self.leasing.refuse(provider, ticket, error) if error.reason != "client_gone" else []
        if provider.breaker.remaining_s(now) > 0:
            actions += self.leasing.refuse_all(provider, breaker_error(provider, now))
        opened = error if error.details.get("breaker_opened") else None  # the events stream says so, once
        if self._forgotten(provider):
            return ev.Decision([*actions, Forget(provider.key)], error=opened)
        return ev.Decision(actions + self._assign(now, key), error=opened)

    def _pinged(self, now: float, event: ev.Pinged) -> ev.Decision:
        key = self._key(event.rid)
        actions = self.lifecycle.pinged(now, event.rid, event.purpose, event.answered, event.rc, event.failure,
                                        event.served)
        return ev.Decision(actions + self._assign(now, key))

    def _worker_exited(self, now: float, event: ev.WorkerExited) -> ev.Decision:
        key = self._key(event.rid)
        return ev.Decision(self.lifecycle.exited(now, event.rid, event.rc) + self._assign(now, key))

    def _hibernation_ended(self, now: float, event: ev.HibernationEnded) -> ev.Decision:
        key = self._key(event.rid)
        self.admitting.giving_back(self.replica(event.rid) if event.ok else None)
        return ev.Decision(self.lifecycle.hibernated(now, event.rid, event.ok, event.why) + self._assign(now, key))

    def _worker_stopped(self, now: float, event: ev.WorkerStopped) -> ev.Decision:
        rid, key = event.rid, self._key(event.rid)
        self.admitting.giving_back(self.replica(rid))
        actions = self.lifecycle.stopped(now, rid, event.failure)
        if rid not in self.replicas:
            self.leasing.drop_kept(rid)
        provider = self.providers.get(key) if key is not None else None
        if provider is not None and self._forgotten(provider):
            return ev.Decision([*actions, Forget(provider.key)])
        return ev.Decision(actions + self._assign(now, key))

    def _forgotten(self, provider: Provider) -> bool:
        """A variant (a check's run) is gone with its last replica, started or not, once nobody waits for it."""
        if not provider.variant or provider.replicas or provider.queue:
            return False
        del self.providers[provider.key]
        return True

    # -- ending replicas on purpose ------------------------------------------------------------------------
    def _retire_asked(self, now: float, event: ev.RetireAsked) -> ev.Decision:
        replica = self.replica(event.rid)
        if replica is None or replica.retire is not None:
            return ev.Decision()
        actions = self.lifecycle.retire(now, replica, event.cause, event.why)
        return ev.Decision(actions + self._assign(now, replica.key))

    def _stop_asked(self, now: float, event: ev.StopAsked) -> ev.Decision:
        """Leased replicas drain first, up to drain_grace_s."""
        targets = [r for r in self.replicas.values() if event.key in (None, r.key)]
        if event.key is not None and event.key in self.providers:
            self.providers[event.key].breaker.reset()
        actions: list[Action] = []
        for replica in targets:
            actions += self.lifecycle.retire(now, replica, event.cause, event.why, at_once=event.at_once,
                                             drain_by=now + self.timings.drain_grace_s)
        return ev.Decision(actions, replicas=tuple(r.rid for r in targets))

    def _shutdown_asked(self, now: float, event: ev.ShutdownAsked) -> ev.Decision:
        if self.stopping:
            return ev.Decision()
        self.stopping = event.why
        actions = [a for p in self.providers.values() for a in self.leasing.refuse_all(p, stopping_error())]
        stop = ev.StopAsked(None, event.at_once, f"the pool is stopping ({event.why})", StopCause.POOL_STOPPING)
        return ev.Decision(actions + self._stop_asked(now, stop).actions)

    def _warm_asked(self, now: float, event: ev.WarmAsked) -> ev.Decision:
        provider = self.providers.get(event.key)
        if provider is None:
            return ev.Decision(error=provider_gone(event.key))
        spec = provider.spec
        if self.stopping:
            return ev.Decision(error=stopping_error())
        if spec.mode == "subprocess":
            return ev.Decision(error=ResidentPoolError(
                f'{provider.slug}: mode = "subprocess" starts a worker per request; it cannot be kept warm',
                slug=provider.slug, reason="bad_request"))
        if event.replicas > spec.max_replicas:
            return ev.Decision(error=ResidentPoolError(
                f"{provider.slug}: cannot keep {event.replicas} replicas warm: max_replicas = {spec.max_replicas} in "
                "its manifest; raise it or ask for fewer", slug=provider.slug, reason="bad_request"))
        if provider.breaker.is_open(provider.fingerprint, now):
            return ev.Decision(error=breaker_error(provider, now))
        return self._top_up(now, provider, event.replicas, event.wait)

    def _top_up(self, now: float, provider: Provider, replicas: int, wait: bool) -> ev.Decision:
        """Start replicas of ``provider`` until ``replicas`` of its current version serve."""
        starts = [self.lifecycle.start(now, provider, None, wait=wait)
                  for _ in range(replicas - self.lifecycle.serving_count(provider))]
        return ev.Decision(list(starts), replicas=tuple(s.rid for s in starts))

    # -- time passes ------------------------------------------------------------------------------------------
    def _tick(self, now: float, event: ev.Tick) -> ev.Decision:
        """Idle retirement, liveness pings, overdue reports, waits past their limit, ageing, the GPU line read
        again, quiet exit, kept warm."""
        actions: list[Action] = []
        if event.in_flight is not None:
            for replica in self.replicas.values():
                ran = event.in_flight.get(replica.rid)
                replica.in_flight_since = None if ran is None else now - ran
        for replica in list(self.replicas.values()):
            actions += self.lifecycle.tick(now, replica)
        for provider, ticket in self.leasing.expired(now):
            actions += self.leasing.refuse(provider, ticket.id, replica_timeout(provider, now - ticket.arrived))
        actions += self.leasing.aged(now)
        actions += self.admitting.tick(now)
        for key in [key for key, provider in self.providers.items() if provider.queue]:
            actions += self._assign(now, key)  # what could not be done for them earlier (a recall not sent)
        admission_waiting = bool(self.admitting.line)
        if event.connections or self.replicas:
            self.quiet_since = now
        elif 0 < self.timings.quiet_exit_s <= now - self.quiet_since and not self.stopping:
            actions.append(Exit("quiet"))
        if now - self.last_keep_warm >= self.timings.keep_warm_s and not self.stopping and not admission_waiting:
            self.last_keep_warm = now
            for provider in list(self.providers.values()):
                if provider.min_replicas > self.lifecycle.serving_count(provider) \
                        and provider.breaker.remaining_s(now) == 0:
                    actions += self._top_up(now, provider, provider.min_replicas, wait=False).actions
        return ev.Decision(actions)

    def view(self, now: float) -> CoreView:
        """The records as they are at ``now``, read-only, each word (idle, serving, ending) decided here."""
        leases = {lease.id: self._lease_view(now, lease) for lease in self.leases.values()}
        warm = self.lifecycle.kept_warm_rids()
        replicas = tuple(self._replica_view(now, r, leases, warm) for r in sorted(self.replicas.values(),
                                                                                  key=lambda r: (r.key, r.index)))
        serving = dict.fromkeys(self.providers, 0)
        running = dict.fromkeys(self.providers, 0)
        for r in replicas:
            serving[r.key] += r.serving
            running[r.key] += not r.ending
        providers = {key: ProviderView(
            key, p.slug, p.version, p.fingerprint, p.starts, p.last_error, p.breaker.snapshot(now), p.variant,
            tuple(TicketView(t.id, dict(t.holder), round(now - t.arrived, 3), t.priority, t.asked,
                             order.CLASSES[order.effective(t.priority, now - t.arrived, self.policy.aging_s)])
                  for t in order.in_order(p.queue, now, self.policy.aging_s, lambda t: t.priority,
                                          lambda t: t.arrived)),
            p.min_replicas, p.spec.max_replicas, serving[key], running[key]) for key, p in self.providers.items()}
        return CoreView(now, self.stopping, providers, replicas, tuple(self.admitting.line_view(now)),
                        {"aging_s": self.policy.aging_s, "backfill": self.policy.backfill,
                         "classes": list(self.policy.classes)}, leases)

    def _lease_view(self, now: float, lease: Lease) -> LeaseView:
        replica = self.replicas.get(lease.rid)
        hold = replica.holds.get(lease.id) if replica is not None else None
        recalling = hold is not None and hold.recall is not None
        return LeaseView(lease.id, lease.rid, lease.connection, dict(lease.holder), round(now - lease.since, 1),
                         lease.kept, recalling, lease.priority, lease.backfilled)

    def _replica_view(self, now: float, r: Replica, leases: dict[int, LeaseView], warm: set[int]) -> ReplicaView:
        held = tuple(leases[lease] for lease in sorted(r.holds) if lease in leases)
        busy = r.in_flight_since is not None and r.state in (ReplicaState.LEASED, ReplicaState.DRAINING)
        provider = self.providers[r.key]
        return ReplicaView(
            r.rid, r.key, provider.slug, r.index, r.state, r.version, r.version == provider.version, r.pid, r.device,
            r.budget_gb, r.served, round(r.idle_s(now), 1), r.idle, self.lifecycle.serving(r), r.ending,
            r.retire[1] if r.retire else None, r.abort[1] if r.abort else None, r.last_error,
            r.rid in warm, r.backfilled, r.kept, held[0] if held else None,
            round(now - r.in_flight_since, 1) if busy and r.in_flight_since is not None else None,
            held, provider.spec.max_callers, r.queue_wait_s)


# -- errors the core answers with ------------------------------------------------------------------------------
def stopping_error() -> PoolStopping:
    return PoolStopping("the pool is stopping; the client retries with the next pool")


def provider_gone(key: str) -> ResidentPoolError:
    """Asked for a provider the core no longer knows: its manifest is read again, and it is asked again."""
    return ResidentPoolError(f"{key}: this pool forgot it since its manifest was read (a check's run ended); "
                             "ask again", slug=key, reason="provider_gone")


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
