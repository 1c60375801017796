"""The decision core's replica rules: every move of a replica, from its start to its end, and nothing else.

It owns the replica records (their state, retirement, deadlines, measurements of use, and the
small records of what is under way on one: the leases holding it and recalls of them, an
eviction waiting for those, a liveness check, a drain); the waiting requests and leases belong
to ``leases.Leasing``, the GPU line to ``admitting.Admitting``, and each asks the others by
name. A start's bookkeeping (``starting``), a replica's holds (``holding``) and an abandoned
request's drain (``drains``) are functions of these records that end nothing: the ends they
call for are decided here. Like the rest of the core: no threads, sockets or clock; each
method takes ``now`` and returns the actions to carry out.
"""
from __future__ import annotations

import itertools

from ..errors import ResidentPoolError, error_from_dict
from ..exits import REFUSAL_CODES, describe_exit
from . import drains, holding
from .actions import Action, Gone, Hibernate, Note, Ping, Recall, ReleaseBudget, Start, Stop, Timings
from .replica import Check, Provider, Replica
from .states import ReplicaState, StopCause

__all__ = ["NOT_THE_PROVIDERS_FAULT", "STOP_ATTEMPTS", "Lifecycle"]

R = ReplicaState
# Start failures that say nothing about the provider (its client left, the card was full, the start was
# called off): they never count toward its breaker, or a busy card would fail every task of a campaign.
NOT_THE_PROVIDERS_FAULT = frozenset({"client_gone", "no_room", "admission_timeout", "start_cancelled",
                                     "pool_stopping", "pool_error", "admission_service_down"})
STOP_ATTEMPTS = 3  # a stop that fails is tried again, with SIGKILL, this many times in all
# What a replica waits for in each transitional state: its overdue note names it.
_PENDING = {R.STARTING: "its start", R.CHECKING: "its liveness ping", R.HIBERNATING: "its hibernation",
            R.STOPPING: "its stop", R.DRAINING: "the ping of its abandoned request",
            R.LEASED: "the recall (or liveness ping) of its kept lease"}
_RECALLING_BACKFILLED = "the recall of its backfilled lease"


class Lifecycle:
    """Replicas: started, checked, drained, evicted, hibernated and ended, each by one rule."""

    def __init__(self, providers: dict[str, Provider], timings: Timings) -> None:
        self.providers = providers  # the core's registry; this class owns each provider's ``replicas``
        self.timings = timings
        self.replicas: dict[int, Replica] = {}
        self._ids = itertools.count(1)

    # -- questions asked in several places ----------------------------------------------------------
    def serving(self, replica: Replica) -> bool:
        """A new request may get it: of its provider's current version, not retiring, not ending."""
        provider = self.providers[replica.key]
        return replica.version == provider.version and replica.retire is None and not replica.ending

    def kept_warm(self, replica: Replica) -> bool:
        """One of its provider's ``min_replicas`` (the lowest-numbered ones that serve new requests)."""
        provider = self.providers[replica.key]
        keep = provider.min_replicas
        if not keep or not self.serving(replica):
            return False
        below = sum(1 for r in provider.replicas.values() if r.index < replica.index and self.serving(r))
        return below < keep

    def kept_warm_rids(self) -> set[int]:
        """Every replica ``kept_warm`` says is one, found in one pass per provider (not one per replica)."""
        found: set[int] = set()
        for provider in self.providers.values():
            if provider.min_replicas:
                serving = sorted((r.index, r.rid) for r in provider.replicas.values() if self.serving(r))
                found.update(rid for _, rid in serving[:provider.min_replicas])
        return found

    def serving_count(self, provider: Provider) -> int:
        """Replicas that count against max_replicas: those serving (a new request may get them)."""
        return sum(1 for r in provider.replicas.values() if self.serving(r))

    # -- starts ----------------------------------------------------------------------------------------
    def start(self, now: float, provider: Provider, ticket: int | None, wait: bool = True) -> Start:
        """A new replica (the lowest free number), starting for ``ticket`` (None: a warm-up)."""
        index = next(i for i in itertools.count() if i not in provider.replicas)
        replica = Replica(next(self._ids), provider.key, index, provider.version, provider.spec.budget_gb, now,
                          last_used=now, last_checked=now)
        provider.replicas[index] = replica
        self.replicas[replica.rid] = replica
        provider.starts += 1
        return self._starting(now, provider, replica, ticket, wait=wait)

    def restore(self, now: float, provider: Provider, replica: Replica, ticket: int) -> Start:
        replica.transition(R.STARTING, "its lease restores it from hibernation")  # a start: admission, then restore
        return self._starting(now, provider, replica, ticket, restore=True)

    def _starting(self, now: float, provider: Provider, replica: Replica, ticket: int | None,
                  restore: bool = False, wait: bool = True) -> Start:
        spec = provider.spec
        replica.for_ticket, replica.fresh = ticket, ticket is not None
        replica.deadline = now + spec.admission_timeout_s + spec.start_timeout_s + self.timings.report_margin_s
        return Start(replica.rid, ticket, restore=restore, wait=wait)

    def lease(self, replica: Replica, lease_id: int, keep: bool = False) -> tuple[bool, bool]:
        """A replica with room for a caller is leased: whether this is its first lease since a start (a cold one),
        and whether the client may keep it between calls (its worker can be asked to give it back, and it serves
        more than one lease)."""
        kept = keep and replica.can_recall and self.providers[replica.key].spec.mode != "subprocess"
        return holding.take(replica, lease_id, kept), kept

    def room(self, replica: Replica) -> int:
        """How many more callers it takes now (``holding.room``)."""
        return holding.room(replica, self.providers[replica.key].spec.max_callers, self.serving(replica))

    def recall(self, now: float, replica: Replica, why: str = "", evict_for: float | None = None,
               backfilled: bool = False, idle_check: bool = False, lease: int | None = None) -> list[Action]:
        """The one rule for taking a lease back, after at most its request in flight, whoever asks (a waiting
        client, admission, a drain, idleness, the host service): only a kept or a ``backfilled`` one ever is, asked
        of its worker (an idle session's memory comes back at once), a backfilled session's client told too (the
        only way where its worker cannot answer ``recall``). ``lease``: that one (another client waits for its
        slot); else every one it may take (its memory, its retirement or its idleness is the replica's).
        ``evict_for``: GB admission needs; ``idle_check``: taken back for idleness, the replica retires if its
        worker says it was idle that long too."""
        taken = holding.taking_back(replica, lease, backfilled, idle_check, evict_for)
        if not taken:
            return []
        if replica.can_recall:  # its worker answers within a request's time: past that, it is overdue
            spec = self.providers[replica.key].spec
            replica.deadline = now + spec.request_timeout_s + self.timings.report_margin_s
        return [Recall(replica.rid, hold.lease, why, client=not hold.kept, worker=replica.can_recall)
                for hold in taken]

    def recalled(self, now: float, replica: Replica, lease: int, idle_s: float, served: int) -> list[Action]:
        """A recalled lease came back (``served``: requests the pool had not heard of). Once the replica holds none,
        it is free, or ends, or makes room for admission. The worker's own word on how long it has been idle counts
        here, not the client's notices: a request that ran long was no idle time, and does not retire it."""
        hold = replica.holds.get(lease)
        if hold is not None and hold.recall is not None and hold.recall.idle_check:
            replica.idle_seen_s = min(idle_s, replica.idle_seen_s if replica.idle_seen_s is not None else idle_s)
        eviction = replica.eviction
        holding.letting_go(now, replica, lease, served)
        if replica.holds:
            if not replica.recalling:
                replica.deadline = None
            return []  # the others' items run on: a recall of one lease never disturbs another's
        idle_seen, replica.idle_seen_s = replica.idle_seen_s, None
        replica.last_used, replica.deadline = now - max(0.0, idle_s), None
        spec = self.providers[replica.key].spec
        if idle_seen is not None and 0 < spec.idle_timeout_s <= idle_seen and not self.kept_warm(replica):
            return self.end(now, replica, StopCause.IDLE, f"idle for {idle_seen:.1f} s (idle_timeout_s = "
                                                          f"{spec.idle_timeout_s:g})")
        actions = self.free(now, replica)  # it was busy, not idle that long: it stays
        if eviction is not None and replica.state is R.READY:
            actions += self.evict(now, replica.rid, eviction.need_gb)
        return actions

    def started(self, now: float, rid: int, pid: int | None, can_recall: bool = False) -> list[Action]:
        """The replica answered its first ping (or its restore's): it serves, or ends if it was called off.

        ``can_recall``: its worker said it answers ``recall`` (a kept lease can be taken back from it)."""
        replica = self.replicas.get(rid)
        if replica is None or replica.state is not R.STARTING:
            return []
        replica.can_recall = can_recall
        self.providers[replica.key].breaker.succeeded()
        replica.pid, replica.for_ticket = pid or replica.pid, None
        replica.last_used = replica.last_checked = now
        ending = replica.abort or replica.retire
        if ending:
            return self.end(now, replica, *ending, force=True)
        replica.transition(R.READY, "started")
        return []

    def start_failed(self, now: float, rid: int, error: ResidentPoolError, stopping: bool
                     ) -> tuple[list[Action], ResidentPoolError, int | None]:
        """The start ended without a worker: the error its request hears, and that request's ticket.

        Enough failures open the provider's breaker; a start called off says so, not what it died of.
        """
        replica = self.replicas.get(rid)
        if replica is None or replica.state is not R.STARTING:
            return [], error, None
        provider = self.providers[replica.key]
        if replica.abort and stopping:
            error = ResidentPoolError("the pool is stopping; the client retries with the next pool",
                                      reason="pool_stopping")
        elif replica.abort:
            error = ResidentPoolError(f"{provider.slug}: the start was called off: {replica.abort[1]}",
                                      slug=provider.slug, reason="start_cancelled", transcript=error.transcript)
        replica.transition(R.FAILED, error.headline)
        replica.last_error = provider.last_error = error.headline
        self._drop(provider, replica)
        kept = error.to_dict()
        if error.reason not in NOT_THE_PROVIDERS_FAULT and provider.breaker.failed(
                provider.fingerprint, kept, error.exit_code in REFUSAL_CODES, now):
            # The Prefect helpers and the events stream say so once. A copy: the event's error is what the runtime
            # reported, and is logged and replayed as it came.
            error = error_from_dict({**error.to_dict(), "details": {**error.details, "breaker_opened": True}})
        return [Gone(rid, None, error.headline)], error, replica.for_ticket

    # -- ends of leases -------------------------------------------------------------------------------
    def free(self, now: float, replica: Replica) -> list[Action]:
        """A lease ended cleanly: with none left, ready again, or on its way out if it drains."""
        provider = self.providers[replica.key]
        if provider.spec.mode == "subprocess" and replica.retire is None:
            replica.retire = (StopCause.ONE_LEASE, 'mode = "subprocess": a worker serves one lease')
        if replica.holds:
            return []  # its other callers hold it still
        if self.serving(replica) and replica.state is R.LEASED:
            replica.transition(R.READY, "released")
            return []
        return self.end(now, replica, *(replica.retire or (StopCause.DRAINED, "its manifest changed")))

    def ended_mid_lease(self, now: float, replica: Replica, outcome: str, rc: int | None) -> list[Action]:
        """The lease's request ended the worker: it timed out, said it is exiting, or died."""
        provider = self.providers[replica.key]
        spec = provider.spec
        if outcome == "timeout" and spec.max_callers > 1 and (
                replica.in_flight_since is None or now - replica.in_flight_since < spec.request_timeout_s):
            return self.free(now, replica)  # it waited in a shared queue that long; no model call outran its limit
        if outcome == "timeout":
            return self.end(now, replica, StopCause.TIMEOUT,
                            f"a request outran request_timeout_s = {provider.spec.request_timeout_s:g} s", kill=True)
        said = "said it is exiting" if outcome == "exiting" else "died mid-request"
        why = f"{replica.name} {said}: {describe_exit(rc)}"
        replica.last_error = provider.last_error = why
        return self.end(now, replica, StopCause.EXITED if outcome == "exiting" else StopCause.DIED, why, kill=True)

    # -- what the runtime saw -------------------------------------------------------------------------
    def pinged(self, now: float, rid: int, purpose: str, answered: bool, rc: int | None = None,
               failure: str | None = None, served: int | None = None) -> list[Action]:
        """A ping's outcome. ``failure``: the pool could not send it (out of descriptors): not the worker's fault."""
        replica = self.replicas.get(rid)
        if replica is None:
            return []
        if purpose == "liveness":
            if replica.state is R.CHECKING or (replica.state is R.LEASED and replica.check is not None):
                return self._checked(now, replica, answered, rc, failure)
            return []
        spec = self.providers[replica.key].spec
        drained = drains.pinged(now, replica, answered, rc, failure, served, self.serving(replica),
                                spec.abandon_grace_s)
        if drained.died is not None:
            return drained.actions + self.died(now, replica, drained.died, "died while its abandoned request ran")
        if drained.end is not None:
            cause, why, kill = drained.end
            if cause is StopCause.ABANDONED:
                replica.last_error = self.providers[replica.key].last_error = f"{replica.name}: {why}; stopped"
            return drained.actions + self.end(now, replica, cause, why, kill=kill)
        return drained.actions

    def abandon(self, now: float, replica: Replica, why: str, kept: tuple[int, int] | None = None) -> list[Action]:
        """Its client is gone mid-lease: freed once its request (if any) is over, never handed out before
        (``drains``); ``kept``: a kept lease's (lease, requests its client told of). A replica shared by several
        callers only loses that caller: its item runs on in the worker's batch, and its answer goes nowhere."""
        spec = self.providers[replica.key].spec
        if spec.max_callers > 1:
            return self.free(now, replica)
        grace = spec.abandon_grace_s
        return drains.abandon(now, replica, why, grace, self.timings.abandon_probe_s, kept)

    def _checked(self, now: float, replica: Replica, answered: bool, rc: int | None, failure: str | None
                 ) -> list[Action]:
        replica.last_checked, replica.check = now, None
        if not replica.recalling:  # a recall out at the same time keeps its own deadline
            replica.deadline = None
        if answered or failure:
            note: list[Action] = [Note(replica.rid, f"the pool could not ping it ({failure}); not its fault")] \
                if failure else []
            if replica.state is R.LEASED:
                return note + (self.retire(now, replica, *replica.retire) if replica.retire else [])
            if replica.retire:
                return note + self.end(now, replica, *replica.retire)
            replica.transition(R.READY, "answered its liveness ping" if answered else "ping not sent")
            return note
        if rc is not None:
            return self.died(now, replica, rc)
        why = f"{replica.name} did not answer a liveness ping within {self.timings.liveness_timeout_s:g} s; stopped"
        replica.last_error = self.providers[replica.key].last_error = why
        return self.end(now, replica, StopCause.UNRESPONSIVE, why, kill=True)

    def exited(self, now: float, rid: int, rc: int) -> list[Action]:
        """The runtime found the replica's process ended on its own (between requests, or under a lease)."""
        replica = self.replicas.get(rid)
        if replica is None or replica.state in (R.STARTING, R.STOPPING, R.STOPPED, R.FAILED):
            return []  # a start sees it itself; a stop is reported by its own action
        return self.died(now, replica, rc)

    def died(self, now: float, replica: Replica, rc: int, how: str | None = None) -> list[Action]:
        if how is None:
            how = "exited while idle" if replica.state in (R.READY, R.CHECKING) else f"died while {replica.state}"
        why = f"{replica.name} {how}: {describe_exit(rc)}"
        replica.last_error = self.providers[replica.key].last_error = why
        return self.end(now, replica, StopCause.DIED, why, kill=True)

    def hibernated(self, now: float, rid: int, ok: bool, why: str) -> list[Action]:
        """A checkpoint ended: its budget goes back and it waits, or (it failed) it is stopped instead."""
        replica = self.replicas.get(rid)
        if replica is None or replica.state is not R.HIBERNATING:
            return []
        if not ok:
            return [Note(rid, why), *self.end(now, replica, StopCause.EVICTED, why)]
        replica.transition(R.HIBERNATED, why)
        replica.admitted, replica.deadline = False, None
        if replica.retire:
            return [ReleaseBudget(rid), *self.end(now, replica, *replica.retire, kill=True)]
        return [ReleaseBudget(rid)]

    def stopped(self, now: float, rid: int, failure: str | None = None) -> list[Action]:
        """A stop ended; ``failure`` says why it could not be done (tried again with SIGKILL, then given up)."""
        replica = self.replicas.get(rid)
        if replica is None or replica.state is not R.STOPPING:
            return []
        cause, why = replica.stop or (StopCause.STOPPED, "stopped")
        if failure is not None and replica.stop_attempts < STOP_ATTEMPTS:
            replica.stop_attempts += 1
            replica.deadline = now + self.timings.stop_overdue_s
            return [Note(rid, f"its stop failed ({failure}); killing its group (attempt {replica.stop_attempts})"),
                    Stop(rid, cause, why, kill=True)]
        provider = self.providers[replica.key]
        if failure is not None:
            why = f"{why}; it did not end ({failure})"
            replica.last_error = provider.last_error = why
        replica.transition(R.STOPPED, why)
        self._drop(provider, replica)
        return [Gone(rid, cause, why, replica.served)]

    def _drop(self, provider: Provider, replica: Replica) -> None:
        self.replicas.pop(replica.rid, None)
        if provider.replicas.get(replica.index) is replica:
            del provider.replicas[replica.index]

    # -- ending replicas: one verb --------------------------------------------------------------------
    def end(self, now: float, replica: Replica, cause: StopCause, why: str, kill: bool = False,
            force: bool = False) -> list[Action]:
        """End ``replica`` now: STOPPING, and its process stopped.

        A start in progress is called off instead: its own thread stops what it started and reports a
        failed start. ``force`` (a start overdue, or one that answered after its call-off) stops it here.
        """
        if replica.state is R.STARTING:
            replica.abort = replica.abort or (cause, why)
            if not force:
                return []
        elif replica.ending:
            return []
        replica.transition(R.STOPPING, why)
        replica.stop, replica.deadline = (cause, why), now + self.timings.stop_overdue_s
        return [Note(replica.rid, f"stopping: {why}"), Stop(replica.rid, cause, why, kill=kill)]

    def retire(self, now: float, replica: Replica, cause: StopCause, why: str, at_once: bool = False,
               drain_by: float | None = None) -> list[Action]:
        """End ``replica`` once it is free (``at_once``: now, whatever it is doing; ``drain_by``: once that
        time has passed, even if it is still leased)."""
        replica.retire = replica.retire or (cause, why)
        if drain_by is not None:
            replica.drain_by = drain_by
        state = replica.state
        if state is R.HIBERNATED:  # its CUDA is locked: it can only be ended, not asked
            return self.end(now, replica, cause, why, kill=True)
        if state is R.READY or (at_once and state in (R.LEASED, R.DRAINING, R.CHECKING)):
            return self.end(now, replica, cause, why, kill=at_once)
        if state is R.LEASED:
            actions = self.recall(now, replica, why)  # kept leases: taken back after at most one request each
            if not replica.kept:  # a session's lease finishes first
                replica.transition(R.DRAINING, f"{why}; its lease finishes first")
            return actions
        elif state is R.STARTING and at_once:
            return self.end(now, replica, cause, why, kill=True)
        # STARTING: ends once started; DRAINING, CHECKING, HIBERNATING: once that is over.
        return []

    # -- eviction --------------------------------------------------------------------------------------
    def evict(self, now: float, rid: int, needed_gb: float, why: str | None = None) -> list[Action]:
        """Make room for a worker needing ``needed_gb``: stop (or hibernate) the idle replica ``rid`` (a kept
        lease's is idle between calls: the lease is recalled first, and it is evicted once that is back)."""
        replica = self.replicas.get(rid)
        if replica is not None and replica.kept and not replica.recalling:
            return self.recall(now, replica, why or f"admission needs {needed_gb:g} GB", evict_for=needed_gb)
        if replica is None or replica.state is not R.READY:
            return []  # leased or stopped meanwhile: admission looks again
        why = why or f"evicted (idle) to make room for a worker needing {needed_gb:g} GB"
        if self.providers[replica.key].spec.evict == "hibernate":
            replica.transition(R.HIBERNATING, why)
            replica.deadline = now + self.timings.hibernate_overdue_s
            return [Hibernate(rid, why)]
        return self.end(now, replica, StopCause.EVICTED, why)

    # -- time passes ---------------------------------------------------------------------------------
    def tick(self, now: float, replica: Replica) -> list[Action]:
        """Overdue reports, drain graces past, idle retirement and liveness pings for one replica."""
        spec, state = self.providers[replica.key].spec, replica.state
        if replica.deadline is not None and now >= replica.deadline and state is not R.DRAINING:
            return self._overdue(now, replica)
        if replica.drain_by is not None and now >= replica.drain_by and replica.retire is not None \
                and state in (R.LEASED, R.DRAINING, R.STARTING):
            late = f"{replica.retire[1]}: still busy after drain_grace_s = {self.timings.drain_grace_s:g} s"
            replica.drain_by = None
            return self.end(now, replica, replica.retire[0], late, kill=True)  # the grace is over: no more asking
        if state is R.DRAINING and replica.deadline is not None and not replica.holds \
                and now >= replica.deadline + self.timings.report_margin_s:
            return self._overdue(now, replica)
        if replica.kept_idle():
            if 0 < spec.idle_timeout_s <= now - replica.last_used and not self.kept_warm(replica):
                # Its client has not said it used it for that long: taken back, and it retires if its worker
                # says it was idle that long too (a single long request is no idle time).
                return self.recall(now, replica, "its client has not used it for idle_timeout_s", idle_check=True)
            if now - replica.last_checked >= spec.ping_interval_s:  # alive between calls too: it answers
                replica.check = Check(now)
                replica.deadline = now + self.timings.liveness_timeout_s + self.timings.report_margin_s
                return [Ping(replica.rid, "liveness", self.timings.liveness_timeout_s)]
        idle = replica.idle_s(now)
        if state is R.HIBERNATED and 0 < spec.idle_timeout_s <= idle:
            return self.end(now, replica, StopCause.IDLE, f"hibernated and idle for {idle:.1f} s (idle_timeout_s = "
                                                          f"{spec.idle_timeout_s:g})", kill=True)
        if state is not R.READY:
            return []
        if (spec.mode == "subprocess" or 0 < spec.idle_timeout_s <= idle) and not self.kept_warm(replica):
            return self.end(now, replica, StopCause.IDLE,
                            f"idle for {idle:.1f} s (idle_timeout_s = {spec.idle_timeout_s:g})")
        if now - replica.last_checked >= spec.ping_interval_s:
            replica.transition(R.CHECKING, "liveness ping")
            replica.deadline = now + self.timings.liveness_timeout_s + self.timings.report_margin_s
            return [Ping(replica.rid, "liveness", self.timings.liveness_timeout_s)]
        return []

    def _overdue(self, now: float, replica: Replica) -> list[Action]:
        """A transitional state outlived its deadline: the action behind it is escalated, never left half done."""
        backfilled = any(hold.recall is not None and not hold.kept for hold in replica.holds.values())
        what = _RECALLING_BACKFILLED if backfilled else _PENDING.get(replica.state, "it")
        why = f"{replica.name}: {what} did not report back in time"
        replica.last_error = self.providers[replica.key].last_error = why
        if replica.state is R.STOPPING:
            return self.stopped(now, replica.rid, failure=f"{what} did not report back in time")
        return [Note(replica.rid, why), *self.end(now, replica, StopCause.OVERDUE, why, kill=True, force=True)]
