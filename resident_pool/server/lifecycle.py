"""The decision core's replica rules: every move of a replica, from its start to its end, and nothing else.

It owns the replica records (their state, retirement, deadlines, measurements of use); the
waiting requests and leases belong to ``leases.Leases``. Like the rest of the core: no
threads, sockets or clock; each method takes ``now`` and returns the actions to carry out.
"""

from __future__ import annotations

import itertools
from typing import Any

from ..errors import ResidentPoolError
from ..exits import REFUSAL_CODES, describe_exit
from .actions import Action, Gone, Hibernate, Note, Ping, ReleaseBudget, Start, Stop, Timings
from .replica import Provider, Replica
from .states import ReplicaState, StopCause

__all__ = ["NOT_THE_PROVIDERS_FAULT", "STOP_ATTEMPTS", "Lifecycle"]

R = ReplicaState
# Start failures that say nothing about the provider (its client left, the card was full, the start was
# called off): they never count toward its breaker, or a busy card would fail every task of a campaign.
NOT_THE_PROVIDERS_FAULT = frozenset({"client_gone", "no_room", "admission_timeout", "start_cancelled",
                                     "pool_stopping", "pool_error", "admission_service_down"})
STOP_ATTEMPTS = 3  # a stop that fails is tried again, with SIGKILL, this many times in all


class Lifecycle:
    """Replicas: started, checked, drained, evicted, hibernated and ended, each by one rule."""

    def __init__(self, providers: dict[str, Provider], timings: Timings) -> None:
        self.providers = providers  # the core's registry; this class owns each provider's ``replicas``
        self.timings = timings
        self.replicas: dict[int, Replica] = {}
        self._ids = itertools.count(1)

    # -- questions asked in several places ----------------------------------------------------------
    def serves_new_requests(self, replica: Replica) -> bool:
        """Of its provider's current version and not on its way out: a new request may get it."""
        provider = self.providers[replica.key]
        return replica.version == provider.version and replica.retire is None and replica.live

    def kept_warm(self, replica: Replica) -> bool:
        """One of its provider's ``min_replicas`` (the lowest-numbered ones that serve new requests)."""
        keep = self.providers[replica.key].spec.min_replicas
        if not keep or not self.serves_new_requests(replica):
            return False
        warm = sorted(r.index for r in self.providers[replica.key].replicas.values() if self.serves_new_requests(r))
        return replica.index in warm[:keep]

    def first(self, provider: Provider, state: ReplicaState) -> Replica | None:
        """The lowest-numbered replica in ``state`` that serves new requests."""
        found = [r for r in provider.replicas.values() if r.state is state and self.serves_new_requests(r)]
        return min(found, key=lambda r: r.index) if found else None

    def live(self, provider: Provider) -> int:
        """Replicas that count against max_replicas: those that serve new requests."""
        return sum(1 for r in provider.replicas.values() if self.serves_new_requests(r))

    def coming(self, provider: Provider) -> int:
        """Replicas that will serve soon: starting, or answering a liveness ping."""
        return sum(1 for r in provider.replicas.values()
                   if r.state in (R.STARTING, R.CHECKING) and self.serves_new_requests(r) and r.abort is None)

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
        replica.transition(R.STARTING, "its lease restores it from hibernation")
        return self._starting(now, provider, replica, ticket, restore=True)

    def _starting(self, now: float, provider: Provider, replica: Replica, ticket: int | None,
                  restore: bool = False, wait: bool = True) -> Start:
        spec = provider.spec
        replica.for_ticket, replica.fresh = ticket, ticket is not None
        replica.deadline = now + spec.admission_timeout_s + spec.start_timeout_s + self.timings.report_margin_s
        return Start(replica.rid, ticket, restore=restore, wait=wait)

    def lease(self, replica: Replica, lease_id: int) -> bool:
        """A ready replica is leased; True when this is its first lease since a start (a cold one)."""
        replica.transition(R.LEASED, "leased")
        replica.lease, replica.deadline = lease_id, None
        cold, replica.fresh = replica.fresh, False
        return cold

    def unlease(self, now: float, replica: Replica, served: int) -> None:
        """Its lease ended, after ``served`` requests: idle time counts from now."""
        replica.lease, replica.served, replica.last_used = None, replica.served + served, now

    def admitted(self, now: float, rid: int, device: str | None, backfilled: bool = False) -> list[Action]:
        """Admission placed the replica's budget (on ``device``; None where it holds no GPU budget), ahead of a
        waiting request if ``backfilled``."""
        replica = self.replicas.get(rid)
        if replica is not None and replica.state is R.STARTING:
            replica.device, replica.admitted = device, replica.budget_gb is not None and device is not None
            replica.backfilled = backfilled and replica.admitted
        return []

    def settle_backfill(self) -> None:
        """Nobody waits for memory any more: no worker holds memory ahead of anyone."""
        for replica in self.replicas.values():
            replica.backfilled = False

    def spawned(self, now: float, rid: int, pid: int) -> list[Action]:
        replica = self.replicas.get(rid)
        if replica is not None and replica.state is R.STARTING:
            replica.pid = pid
        return []

    def started(self, now: float, rid: int, pid: int | None) -> list[Action]:
        """The replica answered its first ping (or its restore's): it serves, or ends if it was called off."""
        replica = self.replicas.get(rid)
        if replica is None or replica.state is not R.STARTING:
            return []
        self.providers[replica.key].breaker.succeeded()
        replica.pid, replica.hibernated, replica.for_ticket = pid or replica.pid, False, None
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
        kept["details"] = dict(kept["details"])  # a copy: the flag below belongs to this one error, not the kept one
        if error.reason not in NOT_THE_PROVIDERS_FAULT and provider.breaker.failed(
                provider.fingerprint, kept, error.exit_code in REFUSAL_CODES, now):
            error.details["breaker_opened"] = True  # the Prefect helpers and the events stream say so once
        return [Gone(rid, None, error.headline)], error, replica.for_ticket

    def restarted(self, now: float, rid: int, why: str) -> list[Action]:
        """A restore from hibernation failed (``why``) and the replica is being started afresh instead."""
        replica = self.replicas.get(rid)
        if replica is not None and replica.state is R.STARTING:
            provider = self.providers[replica.key]
            provider.starts += 1
            replica.hibernated, replica.pid = False, None
            replica.last_error = provider.last_error = why
        return []

    def hand_over(self, provider: Provider, gone_ticket: int, waiting: list[int]) -> None:
        """The request a start served went away: another waiting one takes it over; with none, a start still
        waiting for admission is called off (the card's memory is not taken for nobody), one already
        running finishes and serves whoever comes next."""
        for replica in provider.replicas.values():
            if replica.state is R.STARTING and replica.for_ticket == gone_ticket:
                replica.for_ticket = waiting.pop(0) if waiting else None
                if replica.for_ticket is None and replica.pid is None:
                    replica.abort = replica.abort or (StopCause.STOPPED, "the client waiting for it went away")

    def covering(self, provider: Provider) -> set[int]:
        """The tickets a start in progress serves."""
        return {r.for_ticket for r in provider.replicas.values() if r.state is R.STARTING and r.for_ticket}

    # -- ends of leases -------------------------------------------------------------------------------
    def free(self, now: float, replica: Replica) -> list[Action]:
        """A lease ended cleanly: ready again, or on its way out if it drains."""
        provider = self.providers[replica.key]
        if provider.spec.mode == "subprocess" and replica.retire is None:
            replica.retire = (StopCause.ONE_LEASE, 'mode = "subprocess": a worker serves one lease')
        if self.serves_new_requests(replica) and replica.state is R.LEASED:
            replica.transition(R.READY, "released")
            return []
        return self.end(now, replica, *(replica.retire or (StopCause.DRAINED, "its manifest changed")))

    def abandon(self, now: float, replica: Replica, why: str) -> list[Action]:
        """Its client is gone mid-lease: free it once its request (if any) is over; never hand it out before."""
        if replica.state not in (R.LEASED, R.DRAINING):
            return []
        if replica.state is R.LEASED:
            replica.transition(R.DRAINING, f"{why}; waiting for any request in flight")
        grace = self.providers[replica.key].spec.abandon_grace_s
        replica.deadline, replica.probes = now + grace, 1
        return [Ping(replica.rid, "abandon", min(self.timings.abandon_probe_s, grace) or 0.1)]

    def ended_mid_lease(self, now: float, replica: Replica, outcome: str, rc: int | None) -> list[Action]:
        """The lease's request ended the worker: it timed out, said it is exiting, or died."""
        provider = self.providers[replica.key]
        if outcome == "timeout":
            return self.end(now, replica, StopCause.TIMEOUT,
                            f"a request outran request_timeout_s = {provider.spec.request_timeout_s:g} s", kill=True)
        said = "said it is exiting" if outcome == "exiting" else "died mid-request"
        why = f"{replica.name} {said}: {describe_exit(rc)}"
        replica.last_error = provider.last_error = why
        return self.end(now, replica, StopCause.EXITED if outcome == "exiting" else StopCause.DIED, why, kill=True)

    # -- what the runtime saw -------------------------------------------------------------------------
    def pinged(self, now: float, rid: int, purpose: str, answered: bool, rc: int | None = None,
               failure: str | None = None) -> list[Action]:
        """A ping's outcome. ``failure``: the pool could not send it (out of descriptors): not the worker's fault."""
        replica = self.replicas.get(rid)
        if replica is None:
            return []
        if purpose == "liveness":
            return self._checked(now, replica, answered, rc, failure) if replica.state is R.CHECKING else []
        if replica.state is not R.DRAINING or replica.lease is not None:
            return []  # decided meanwhile
        provider = self.providers[replica.key]
        grace = provider.spec.abandon_grace_s
        if answered and self.serves_new_requests(replica):
            replica.transition(R.READY, "the abandoned request ended")
            replica.last_used, replica.deadline = now, None
            return []
        if answered or failure:
            if failure and now < (replica.deadline or now):
                return [Ping(rid, "abandon", max(0.1, (replica.deadline or now) - now))]
            return self.end(now, replica, *(replica.retire or (StopCause.DRAINED, "its manifest changed")))
        if rc is not None:
            return self._died(now, replica, rc, "died while its abandoned request ran")
        if replica.probes == 1 and replica.deadline is not None and now < replica.deadline:
            replica.probes += 1
            return [Note(rid, f"its client went away mid-request; the request may run up to abandon_grace_s = "
                              f"{grace:g} s more, and its answer is thrown away"),
                    Ping(rid, "abandon", max(0.1, replica.deadline - now))]
        why = f"its abandoned request still ran after abandon_grace_s = {grace:g} s"
        replica.last_error = provider.last_error = f"{replica.name}: {why}; stopped"
        return self.end(now, replica, StopCause.ABANDONED, why, kill=True)

    def _checked(self, now: float, replica: Replica, answered: bool, rc: int | None, failure: str | None
                 ) -> list[Action]:
        replica.last_checked, replica.deadline = now, None
        if answered or failure:
            note = [Note(replica.rid, f"the pool could not ping it ({failure}); not held against it")] if failure \
                else []
            if replica.retire:
                return note + self.end(now, replica, *replica.retire)
            replica.transition(R.READY, "answered its liveness ping" if answered else "ping not sent")
            return note
        if rc is not None:
            return self._died(now, replica, rc)
        why = f"{replica.name} did not answer a liveness ping within {self.timings.liveness_timeout_s:g} s; stopped"
        replica.last_error = self.providers[replica.key].last_error = why
        return self.end(now, replica, StopCause.UNRESPONSIVE, why, kill=True)

    def exited(self, now: float, rid: int, rc: int) -> list[Action]:
        """The runtime found the replica's process ended on its own (between requests, or under a lease)."""
        replica = self.replicas.get(rid)
        if replica is None or replica.state in (R.STARTING, R.STOPPING, R.STOPPED, R.FAILED):
            return []  # a start sees it itself; a stop is reported by its own action
        return self._died(now, replica, rc)

    def _died(self, now: float, replica: Replica, rc: int, how: str | None = None) -> list[Action]:
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
        replica.hibernated, replica.admitted, replica.deadline = True, False, None
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
        elif not replica.live:
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
            replica.transition(R.DRAINING, f"{why}; its lease finishes first")
        elif state is R.STARTING and at_once:
            return self.end(now, replica, cause, why, kill=True)
        # STARTING: ends once started; DRAINING, CHECKING, HIBERNATING: once that is over.
        return []

    # -- eviction --------------------------------------------------------------------------------------
    def evict(self, now: float, rid: int, needed_gb: float, why: str | None = None) -> list[Action]:
        """Make room for a worker needing ``needed_gb``: stop (or hibernate) the idle replica ``rid``."""
        replica = self.replicas.get(rid)
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
            return self.end(now, replica, replica.retire[0], late, kill=state is R.STARTING)
        if state is R.DRAINING and replica.deadline is not None and replica.lease is None \
                and now >= replica.deadline + self.timings.report_margin_s:
            return self._overdue(now, replica)
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
        what = {R.STARTING: "its start", R.CHECKING: "its liveness ping", R.HIBERNATING: "its hibernation",
                R.STOPPING: "its stop", R.DRAINING: "the ping of its abandoned request"}.get(replica.state, "it")
        why = f"{replica.name}: {what} did not report back in time"
        replica.last_error = self.providers[replica.key].last_error = why
        if replica.state is R.STOPPING:
            return self.stopped(now, replica.rid, failure=f"{what} did not report back in time")
        return [Note(replica.rid, why), *self.end(now, replica, StopCause.OVERDUE, why, kill=True, force=True)]

    def rows(self, now: float, leases: dict[int, Any]) -> list[dict[str, Any]]:
        """Plain data per replica, for status and metrics."""
        return [{
            "rid": r.rid, "key": r.key, "slug": self.providers[r.key].slug, "replica": r.index,
            "state": r.state.value, "version": r.version, "current": r.version == self.providers[r.key].version,
            "pid": r.pid, "device": r.device, "budget_gb": r.budget_gb, "served": r.served,
            "idle_s": round(r.idle_s(now), 1), "retiring": r.retire[1] if r.retire else None,
            "last_error": r.last_error, "kept_warm": self.kept_warm(r), "backfilled": r.backfilled,
            "lease": None if r.lease is None or r.lease not in leases else {
                "id": r.lease, "holder": leases[r.lease].holder, "age_s": round(now - leases[r.lease].since, 1),
                "priority": leases[r.lease].priority, "recalled": leases[r.lease].recalled},
        } for r in sorted(self.replicas.values(), key=lambda r: (r.key, r.index))]
