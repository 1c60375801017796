"""The runtime: the only code that touches worker processes, admission, zygotes and the hibernator.

It carries out the decision core's actions (on threads where they block) and reports how
each ended back to the core as an event, under the one lock. It decides nothing: where a
choice is to be made, it asks the core. The start path (prepare, place, spawn) is
``starts.Starter``, which it holds.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from ..admission import Admission
from ..errors import ResidentPoolError
from ..host.paths import Paths
from ..messages import LeaseGrant, Release
from ..ops.metrics import StatsBook
from ..providers.hibernate import CheckpointError, Hibernator
from ..providers.worker_process import DEATH_WAIT_S
from ..providers.zygote import Zygotes
from ..settings import Settings
from . import actions as c
from . import events as ev
from .core import PoolState
from .corelog import CoreLog
from .handles import Waiter, Worker
from .observing import Observer
from .registry import Registry
from .starts import Starter
from .states import ReplicaState, StopCause
from .view import CoreView

__all__ = ["Runtime"]

log = logging.getLogger("resident_pool.pool")


_A = TypeVar("_A", bound=c.Start | c.Place | c.Withdraw | c.Spawn | c.Stop | c.Ping | c.Hibernate | c.Recall)
_KEPT_START_ERRORS = 64  # the last failed starts, for warm-ups that wait on them
_KEPT_DEATHS = 256  # the last leases ended with their dead worker, for releases that come after


class _Deaths:
    """Who holds each lease, and the deaths of leased workers their clients have not yet heard of: a death is told
    once, to the connection the lease was granted to (a release may come after the lease ended in the core)."""

    def __init__(self) -> None:
        self.owners: dict[int, int] = {}  # lease: its connection, while the runtime holds its worker
        self.untold: dict[int, tuple[int, dict[str, Any], str, int]] = {}  # lease: (owner, death, slug, replica)

    def ended(self, lease: int, worker: Any, connection: int | None = None) -> None:
        """``lease`` ended (its client released it, or the core ended it); a death of its worker is kept for its
        owner (``connection``, where it is the one who releases it now: then it is told at once)."""
        owner = self.owners.pop(lease, None)
        rc = worker.process.returncode
        if rc is not None and owner is not None and owner != connection:
            died = worker.process.died_error(rc, stopping=worker.stopped_on_purpose).to_dict()
            self.untold[lease] = (owner, died, worker.loaded.slug, worker.index)
            while len(self.untold) > _KEPT_DEATHS:
                del self.untold[next(iter(self.untold))]

    def told(self, lease: int, connection: int) -> tuple[dict[str, Any], str, int] | None:
        """The death of ``lease``'s worker, with its slug and replica, once, and only to its owner: another
        connection naming the lease neither hears it nor takes it from its owner."""
        untold = self.untold.get(lease)
        if untold is None or untold[0] != connection:
            return None
        del self.untold[lease]
        return untold[1:]


def _gone(told: tuple[dict[str, Any], str, int] | None, dying: Worker | None, quiet: bool,
          book: StatsBook) -> dict[str, Any] | None:
    """The answer to a release of a lease the pool ended first: the death its owner had not heard of (``told``), or
    that of ``dying`` (a broken exchange with a worker that is ending) if it ends now; counted once as a failed
    request, as a release that comes before the pool's look counts it (``Runtime.release``)."""
    if dying is not None and (rc := dying.process.wait_dead()) is not None:
        told = (dying.process.died_error(rc, stopping=dying.stopped_on_purpose).to_dict(), dying.loaded.slug,
                dying.index)
    if told is not None and not quiet:
        book.failed(told[1], told[2], str(told[0].get("reason")))
    return None if quiet else {"ok": True, "gone": True, **({"error": told[0]} if told else {})}


class Runtime:
    """Carries out the core's actions and reports their outcomes; holds the one lock."""

    def __init__(self, core: PoolState, registry: Registry, admission: Admission, zygotes: Zygotes,
                 hibernator: Hibernator, paths: Paths, observer: Observer, config: Settings,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``paths`` and ``config``: the pool's folders and settings, handed to each worker start and stop."""
        self.core = core
        self.timings = core.timings  # what its own waits add to a worker's limits (report_margin_s)
        self.registry = registry
        self.admission = admission
        self.zygotes = zygotes
        self.hibernator = hibernator
        self.paths = paths
        self.config = config
        self.observer = observer
        self.kill_grace_s = config.kill_grace_s
        self.clock = clock
        self.lock = threading.RLock()
        self.changed = threading.Condition(self.lock)  # notified after every event: warm and stop wait on it
        self.workers: dict[int, Worker] = {}
        self.by_lease: dict[int, Worker] = {}  # the worker each lease holds, kept past the replica's end
        # Each lease's owner, and the deaths the pool saw before the lease's client released it, so that release
        # still says how its worker died.
        self.deaths = _Deaths()
        self.waiters: dict[int, Waiter] = {}
        self.tell_lease: dict[int, tuple[int, Callable[[dict[str, Any]], None]]] = {}  # lease: (connection, tell)
        self.start_errors: dict[int, ResidentPoolError] = {}  # for warm-ups waiting on their starts
        self.nonce = secrets.token_hex(8)  # lease tokens of this pool never name another pool's lease
        self.on_exit: Callable[[str], None] = lambda why: None
        self._view: CoreView | None = None  # the core's view since its last decision (``_look``)
        self.core_log: CoreLog | None = None  # RESIDENT_POOL_CORE_LOG: each event and its decision, for replay
        self.starter = Starter(self, registry, admission, zygotes, hibernator, observer, paths, config,
                               self.timings)

    # -- events in, actions out -----------------------------------------------------------------
    def report(self, event: ev.Event, inline: bool = False,
               noted: Callable[[ev.Decision], None] | None = None) -> ev.Decision:
        """Tell the core what happened, under the lock, then carry out what it decided.

        ``noted`` runs once the core has decided, before any waiting client hears the answer: what a client reads
        next (the events stream) already says what happened, and a client's waiter is in place for its ticket.
        """
        with self.lock:
            now = self.clock()
            decision = self.core.handle(now, event)
            self._view = None  # the records changed: the next read builds the view again, once
            if self.core_log is not None:
                self.core_log.write(now, event, decision)
            if noted is not None:
                noted(decision)
            later = self.settle(decision.actions)
            self.changed.notify_all()
        self.carry_out(later, inline=inline)
        return decision

    def view(self) -> CoreView:
        """The core's records, read-only, as of its last decision."""
        with self.lock:
            return self._look()

    def snapshot(self) -> tuple[CoreView, dict[int, Worker]]:
        """The core's view and the workers the runtime holds, taken together."""
        with self.lock:
            return self._look(), dict(self.workers)

    def _look(self) -> CoreView:
        """The core's view, built at most once per decision (the lock is held): a session's path reads it several
        times, and each build walks every replica. Its ages are as of that build: a tick old at most."""
        if self._view is None:
            self._view = self.core.view(self.clock())
        return self._view

    def settle(self, actions: list[c.Action]) -> list[c.Action]:
        """Answer waiting clients at once (the lock is held); return what must run outside it."""
        later: list[c.Action] = []
        for action in actions:
            if isinstance(action, (c.Grant, c.Refuse)):
                waiter = self.waiters.get(action.ticket)
                if isinstance(action, c.Grant):
                    worker = self.workers[action.rid]
                    self.by_lease[action.lease] = worker
                    if waiter is not None and waiter.tell is not None and waiter.connection is not None:
                        self.tell_lease[action.lease] = (waiter.connection, waiter.tell)
                if waiter is not None:
                    waiter.answer = action
                    waiter.event.set()
            elif isinstance(action, c.Forget):
                self.registry.forget(action.key)  # under the lock: ordered with the manifest reads the core hears
            else:
                later.append(action)
        return later

    def carry_out(self, actions: list[c.Action], inline: bool = False) -> None:
        for action in actions:
            if isinstance(action, c.Note):
                worker = self.workers.get(action.rid)
                if worker is not None:
                    worker.process.note(action.text)
            elif isinstance(action, c.ReleaseBudget):
                self._release_budget(action.rid)
            elif isinstance(action, c.Gone):
                self._gone(action)
            elif isinstance(action, c.Exit):
                self.on_exit(action.why)
            elif isinstance(action, c.Announce):
                fields = dict(action.fields)
                replica = fields.pop("replica", None)  # the record's own field, not its payload's
                self.observer.events.emit(action.event, action.slug, replica if isinstance(replica, int) else None,
                                          **fields)
            elif isinstance(action, c.Recall) and not action.worker:
                self._tell_recall(action)  # a worker that cannot answer ``recall``: its client is the only way
            elif isinstance(action, c.Recall):
                if action.client:
                    self._tell_recall(action)  # the fast path: its session gives it back before its next request
                if inline:
                    self._recall(action, inline=True)  # what comes of its answer (an eviction) runs here too
                else:
                    self._run(self._recall, action, inline)
            elif isinstance(action, c.Start | c.Place | c.Withdraw | c.Spawn):
                self._run(self.starter.carry_out, action, inline)
            elif isinstance(action, c.Stop):
                self._run(self._stop, action, inline)
            elif isinstance(action, c.Ping):
                self._run(self._ping, action, inline)
            elif isinstance(action, c.Hibernate):
                self._run(self._hibernate, action, inline)
            else:  # Grant and Refuse are settled under the lock
                raise TypeError(f"the runtime has no way to carry out {action!r}")

    def _run(self, run: Callable[[_A], None], action: _A, inline: bool) -> None:
        """``run(action)`` here (``inline``), else on a thread of its own."""
        if inline:
            return run(action)
        try:
            threading.Thread(target=run, args=(action,), daemon=True,
                             name=f"{type(action).__name__.lower()}-{action.rid}").start()
        except RuntimeError as exc:  # no thread to be had: a failure of the pool's own, never the worker's
            log.warning("cannot start a thread for %s (%s)", action, exc)
            if isinstance(action, c.Ping):
                self.report(ev.Pinged(action.rid, action.purpose, False, None, f"no thread: {exc}"))
            elif isinstance(action, c.Place):
                self.report(ev.BudgetNotPlaced(action.rid, {}))  # tried again at the next reading
            elif isinstance(action, (c.Start, c.Spawn)):
                self.report(ev.StartFailed(action.rid, ResidentPoolError(
                    f"the pool could not start a thread for a worker start ({exc})", reason="pool_error")))
            else:
                run(action)  # a stop or a hibernation runs here rather than leave a replica half done

    # -- starting ---------------------------------------------------------------------------------
    def adopt(self, worker: Worker) -> None:
        """A start made ``worker``'s process: it is the runtime's from now on."""
        with self.lock:
            self.workers[worker.rid] = worker

    def keep_error(self, rid: int, error: ResidentPoolError) -> None:
        """A failed start's error, for a warm-up waiting on it (the last few only)."""
        with self.lock:
            self.start_errors[rid] = error
            while len(self.start_errors) > _KEPT_START_ERRORS:
                del self.start_errors[next(iter(self.start_errors))]

    # -- stopping, pinging, hibernating ------------------------------------------------------------
    def _stop(self, action: c.Stop) -> None:
        worker = self.workers.get(action.rid)
        failure = None
        if worker is not None and action.cause is StopCause.EVICTED:
            self.observer.on_evicted(worker.loaded.slug)
        try:
            if worker is not None and worker.process.proc is not None:
                # A client whose request breaks now hears "stopped", not "died": unless it had died already.
                worker.stopped_on_purpose = worker.process.poll() is None
                if not action.kill:
                    self.observer.collect_stats(worker, timeout=1.0)  # its counts since the last collection
                rc = worker.process.kill(grace_s=self.kill_grace_s) if action.kill else worker.process.stop()
                if rc is None and worker.process.returncode is None:
                    failure = "it still ran after SIGKILL (uninterruptible sleep in a driver?)"
        except Exception as exc:  # EMFILE, ENOMEM: reported, decided again (a retry with SIGKILL)
            log.exception("stopping %s failed", worker.process.slug if worker else action.rid)
            failure = f"{type(exc).__name__}: {exc}"
        self.report(ev.WorkerStopped(action.rid, failure))

    def _ping(self, action: c.Ping) -> None:
        worker = self.workers.get(action.rid)
        if worker is None:
            return
        busy = action.purpose == "liveness" and worker.process.in_flight_s() is not None
        answer: dict[str, Any] | None
        try:  # a request in flight (a kept lease's) answers for the worker: it is alive and computing
            if busy:
                answer = {"busy": True}
            elif action.lease is not None:  # a gone client's kept lease: taken back, and what it served counted
                answer = worker.process.recall(self.token(action.lease), action.timeout_s)
            else:
                answer = worker.process.ping(timeout=action.timeout_s, raise_own=True)
        except OSError as exc:
            self.report(ev.Pinged(action.rid, action.purpose, False, None, f"{type(exc).__name__}: {exc}"))
            return
        if answer is None and action.purpose == "liveness" and worker.process.in_flight_s() is not None:
            answer = {"busy": True}  # a request began after the look and held the ping up: alive
        rc = None
        if answer is None:
            # Its socket closes a moment before it can be reaped: wait that moment, or a death reads as a hang.
            rc = worker.process.wait_dead(DEATH_WAIT_S)
        elif action.purpose == "liveness":
            self.observer.collect_stats(worker)  # still checking: the worker is idle
        served = answer.get("served") if answer is not None and action.lease is not None else None
        counted = served if isinstance(served, int) and not isinstance(served, bool) else None
        self.report(ev.Pinged(action.rid, action.purpose, answer is not None, rc, None, counted))

    def _recall(self, action: c.Recall, inline: bool = False) -> None:
        """A kept or backfilled lease: its worker is asked for it back (it answers once any request in flight is
        over)."""
        worker = self.workers.get(action.rid)
        if worker is None:
            return
        # Answered once any request in flight is over: as long as a request may run, and a little more.
        timeout = worker.loaded.manifest.lifecycle.request_timeout_s + self.timings.report_margin_s
        try:
            answer = worker.process.recall(self.token(action.lease), timeout)
        except OSError as exc:  # the pool's own failure (out of descriptors): not the worker's, tried again later
            self.report(ev.LeaseRecalled(action.lease, 0.0, None, f"{type(exc).__name__}: {exc}"))
            return
        if answer is not None:
            idle, served = answer.get("idle_s"), answer.get("served")
            counted = served if isinstance(served, int) and not isinstance(served, bool) and served >= 0 else None
            self.report(ev.LeaseRecalled(action.lease, float(idle) if isinstance(idle, int | float) else 0.0, counted),
                        inline=inline)
            return
        rc = worker.process.wait_dead(DEATH_WAIT_S)
        if rc is not None:
            self.report(ev.WorkerExited(action.rid, rc))
        # else: no answer from a live worker; the core's deadline on the recall escalates it

    def token(self, lease: int) -> str:
        """What names lease ``lease`` to its worker (which refuses it once recalled)."""
        return f"{self.nonce}-{lease}"

    def _hibernate(self, action: c.Hibernate) -> None:
        worker = self.workers[action.rid]
        slug = worker.loaded.slug
        self.observer.on_evicted(slug)
        try:
            worker.hibernation = self.hibernator.hibernate(worker.process)
        except CheckpointError as exc:
            note = f"{worker.slug}[{worker.index}] could not hibernate ({exc}); stopped instead"
            self.hibernator.noted(slug, note)
            self.report(ev.HibernationEnded(action.rid, False, note), inline=True)
            return
        self.hibernator.noted(slug, f"{worker.slug}[{worker.index}] hibernated: {action.why}")
        self.report(ev.HibernationEnded(action.rid, True, action.why))

    def _release_budget(self, rid: int) -> None:
        worker = self.workers.get(rid)
        if worker is None:
            return
        admitter, worker.admitter = worker.admitter, None
        if admitter is not None:
            admitter.release(worker)
        if admitter is self.admission:
            self.report(ev.MemoryFreed())  # whoever waits for memory tries again now

    def _tell_recall(self, action: c.Recall) -> None:
        """A backfilled session's lease: its client is told to give it back before its next request."""
        with self.lock:
            told = self.tell_lease.get(action.lease)
        if told is not None:
            told[1]({"recall": {"lease": action.lease, "why": action.why}})

    def recall_worker(self, slug: str, index: int, why: str) -> None:
        """The host admission service wants this pool's backfilled ``slug[index]`` back for another pool."""
        with self.lock:
            rid = next((w.rid for w in self.workers.values() if w.loaded.slug == slug and w.index == index), None)
        if rid is not None:
            self.report(ev.HostRecall(rid, why))

    def _gone(self, action: c.Gone) -> None:
        self._release_budget(action.rid)
        with self.lock:
            worker = self.workers.pop(action.rid, None)
        if worker is not None:
            self.observer.on_gone(worker, action.cause, action.why, action.served)

    # -- what the maintenance loop does -----------------------------------------------------------
    def maintain(self, beat: bool, connections: int) -> None:
        """Heartbeats, deaths between requests, the core's clock, and what each wait for memory is for."""
        with self.lock:
            workers = list(self.workers.values())
            view = self._look()
            leased = {r.rid for r in view.replicas if r.state in (ReplicaState.LEASED, ReplicaState.DRAINING)}
            for lease in [lease for lease in self.by_lease if lease not in view.leases]:
                self.deaths.ended(lease, self.by_lease.pop(lease))  # recalled, its worker dead, or its client gone
                self.tell_lease.pop(lease, None)
        for worker in workers:
            if beat:  # a worker still loading its model counts on it too
                worker.process.beat()
            # Whoever reaped it (a status read asks the process too), the core hears of the exit here.
            rc = worker.process.poll() if worker.process.proc is not None else None
            if rc is not None and not worker.stopped_on_purpose:
                self.report(ev.WorkerExited(worker.rid, rc))
        # How long each leased worker's request has run, from its in-flight board: status shows it, and a kept
        # lease running one long request is not taken for idle, nor evicted (docs/admission.md).
        in_flight = {worker.rid: ran for worker in workers if worker.rid in leased
                     and (ran := worker.process.in_flight_s()) is not None}
        self.report(ev.Tick(connections, in_flight))
        self.starter.report_waits()

    def forget_connection(self, connection: int) -> None:
        with self.lock:
            for lease in [lease for lease, (conn, _) in self.tell_lease.items() if conn == connection]:
                del self.tell_lease[lease]

    def retire(self, rid: int, cause: StopCause, why: str) -> None:
        self.report(ev.RetireAsked(rid, cause, why))

    # -- what the pool's ops wait on ------------------------------------------------------------------
    def grant(self, grant: c.Grant, key: str) -> LeaseGrant:
        """The lease a waiting client gets: where the worker's socket is, and how long a request may run."""
        with self.lock:
            worker = self.by_lease[grant.lease]
            lease = self._look().lease(grant.lease)
            self.deaths.owners.update({grant.lease: lease.connection} if lease is not None else {})
            priority, backfilled = (lease.priority, lease.backfilled) if lease is not None else ("normal", False)
        process, manifest = worker.process, worker.loaded.manifest
        return LeaseGrant(lease=grant.lease, slug=key, replica=worker.index, pid=process.pid,
                          socket=process.socket_path, cold=grant.cold, transcript=process.transcript_path,
                          request_timeout_s=manifest.lifecycle.request_timeout_s, device=process.device,
                          version=worker.loaded.version,
                          kit=process.launch.kit if process.launch is not None else None,
                          token=self.token(grant.lease), kept=grant.kept, priority=priority, backfilled=backfilled)

    def release(self, release: Release, connection: int) -> dict[str, Any] | None:
        """A lease ends; what the client's last request saw is turned into a fact first (did the worker die?)."""
        with self.lock:
            lease = self._look().lease(release.lease)
            if lease is not None and lease.connection != connection:
                raise ResidentPoolError(f"lease {release.lease} is not held by this connection; a client releases "
                                        "only its own leases", reason="bad_request")
            # Where the core ended the lease first (its worker's exit), the maintenance loop may not have swept it yet.
            worker = self.by_lease.pop(release.lease, None) if lease is not None or self.deaths.owners.get(
                release.lease) == connection else None
            if worker is not None:
                self.deaths.ended(release.lease, worker, connection)
            self.tell_lease.pop(release.lease, None)
        quiet = release.outcome in ("ok", "abandoned", "bad_reply")  # the client does not wait for an answer to these
        if worker is None or lease is None:  # ended already (a kept lease recalled, its worker died, a stop --now)
            with self.lock:  # a worker that serves on (its kept lease taken back for another) is not waited on to die
                told = self.deaths.told(release.lease, connection)
                replica = self._look().replica(worker.rid) if worker is not None else None
            waits = release.outcome == "broken" and (replica is None or replica.ending)
            return _gone(told, worker if waits else None, quiet, self.observer.metrics.book)
        outcome, rc = release.outcome, None
        ran: float | None = None  # a timeout's: how long the worker's model call had run as its client gave up
        answer: dict[str, Any] = {"ok": True}
        book, slug = self.observer.metrics.book, worker.loaded.slug
        if outcome == "exiting":
            error = worker.process.exiting_error(release.reply or {})
            rc = worker.process.returncode
            book.failed(slug, worker.index, "worker_exiting")
            answer["error"] = error.to_dict()
        elif outcome == "broken":
            rc = worker.process.wait_dead(DEATH_WAIT_S)  # died, or a live worker closed on it
            if rc is not None:
                error = worker.process.died_error(rc, stopping=worker.stopped_on_purpose)
                book.failed(slug, worker.index, error.reason)
                answer["error"], outcome = error.to_dict(), "died"
        elif outcome == "timeout":
            book.failed(slug, worker.index, "timeout")
            ran = worker.process.in_flight_s()
        # A worker that ended its lease's request (timed out, exiting, dead) is stopped before the client hears:
        # the next status and the next request see it gone.
        self.report(ev.LeaseReleased(release.lease, connection, outcome, release.served, rc, ran),
                    inline=outcome in ("timeout", "exiting", "died"))
        if outcome == "timeout":  # a request of a shared worker may time out in its queue: the worker serves on
            with self.lock:
                replica = self._look().replica(lease.rid) if lease is not None else None
            answer["stopped"] = replica is None or replica.ending
        return None if quiet else answer

    def wait_gone(self, rids: list[int], bound_s: float) -> None:
        """Wait until none of ``rids`` is left (every stop reports back, or is escalated), at most ``bound_s``."""
        deadline = self.clock() + bound_s
        with self.lock:
            while any(self._look().replica(rid) for rid in rids) and self.clock() < deadline:
                self.changed.wait(0.25)

    def wait_started(self, rids: list[int], bound_s: float) -> list[ResidentPoolError]:
        """Wait until each of ``rids`` has started or failed (at most ``bound_s``); the errors of those that failed."""
        deadline = self.clock() + bound_s

        def starting() -> bool:
            view = self._look()
            return any((replica := view.replica(rid)) is not None and replica.state is ReplicaState.STARTING
                       for rid in rids)

        with self.lock:
            while starting() and self.clock() < deadline:
                self.changed.wait(0.25)
            return [self.start_errors.pop(rid) for rid in rids if rid in self.start_errors]
