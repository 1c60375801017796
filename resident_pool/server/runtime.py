"""The runtime: the only code that touches worker processes, admission, zygotes and the hibernator.

It carries out the decision core's actions (on threads where they block) and reports how
each ended back to the core as an event, under the one lock. It decides nothing: where a
choice is to be made, it asks the core.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..admission import Admission, read_devices
from ..errors import ResidentPoolError, WorkerStartError
from ..messages import LeaseGrant, Release
from ..providers.hibernate import CheckpointError, Hibernation, Hibernator
from ..providers.kit_rules import stray_variables
from ..providers.launch import command_builder
from ..providers.supervisor import CpuOnly
from ..providers.worker_process import DEATH_WAIT_S, Launch, WorkerProcess
from ..providers.zygote import Zygotes
from . import actions as c
from .core import PoolState
from .registry import Loaded, Registry
from .states import ReplicaState, StopCause

__all__ = ["Runtime", "Worker"]

log = logging.getLogger("resident_pool.pool")


@dataclass(eq=False)
class Worker:
    """What the runtime holds for one replica: its process, and where its GPU budget was admitted."""

    rid: int
    slug: str
    index: int
    budget_gb: float | None
    loaded: Loaded
    process: WorkerProcess
    admitter: Any = None  # what admitted its budget, told when it is gone
    hibernation: Hibernation | None = None
    stopped_on_purpose: bool = False

    # Admission and the ledger know a worker by slug, replica number, budget and pid.
    @property
    def replica(self) -> int:
        return self.index

    @property
    def vram_budget_gb(self) -> float | None:
        return self.budget_gb

    @property
    def manifest(self) -> Any:
        return self.loaded.manifest

    @property
    def pid(self) -> int | None:
        return self.process.pid


@dataclass
class Waiter:
    """A client waiting for its ticket's answer (a Grant or a Refuse), and how to tell it of a wait."""

    event: threading.Event
    progress: Callable[[dict[str, Any]], None] | None
    answer: c.Grant | c.Refuse | None = None


_KEPT_START_ERRORS = 64  # the last failed starts, for warm-ups that wait on them


class Runtime:
    """Carries out the core's actions and reports their outcomes; holds the one lock."""

    def __init__(self, core: PoolState, registry: Registry, admission: Admission, zygotes: Zygotes,
                 hibernator: Hibernator, state_dir: Path, observer: Any, kill_grace_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.core = core
        self.registry = registry
        self.admission = admission
        self.zygotes = zygotes
        self.hibernator = hibernator
        self.state_dir = state_dir
        self.observer = observer
        self.kill_grace_s = kill_grace_s
        self.clock = clock
        self.lock = threading.RLock()
        self.changed = threading.Condition(self.lock)  # notified after every event: warm and stop wait on it
        self.workers: dict[int, Worker] = {}
        self.by_lease: dict[int, Worker] = {}  # the worker each lease holds, kept past the replica's end
        self.waiters: dict[int, Waiter] = {}
        self.start_errors: dict[int, ResidentPoolError] = {}  # for warm-ups waiting on their starts
        self.nonce = secrets.token_hex(8)  # lease tokens of this pool never name another pool's lease
        self.on_exit: Callable[[str], None] = lambda why: None

    # -- events in, actions out -----------------------------------------------------------------
    def event(self, name: str, *args: Any, inline: bool = False, noted: Callable[[], None] | None = None) -> Any:
        """Report ``name`` to the core under the lock, then carry out what it decided.

        ``noted`` runs once the core has decided, before any waiting client hears the answer: what a client
        reads next (the events stream) already says what happened.
        """
        with self.lock:
            result = getattr(self.core, name)(self.clock(), *args)
            actions = result[1] if isinstance(result, tuple) else result
            if noted is not None:
                noted()
            later = self.settle(actions)
            self.changed.notify_all()
        self.carry_out(later, inline=inline)
        return result

    def settle(self, actions: list[c.Action]) -> list[c.Action]:
        """Answer waiting clients at once (the lock is held); return what must run outside it."""
        later = []
        for action in actions:
            if isinstance(action, (c.Grant, c.Refuse)):
                waiter = self.waiters.get(action.ticket)
                if isinstance(action, c.Grant):
                    worker = self.workers[action.rid]
                    self.by_lease[action.lease] = worker
                if waiter is not None:
                    waiter.answer = action
                    waiter.event.set()
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
            else:
                run = {c.Start: self._start, c.Stop: self._stop, c.Ping: self._ping,
                       c.Hibernate: self._hibernate, c.Recall: self._recall}[type(action)]
                if inline and isinstance(action, c.Recall):
                    self._recall(action, inline=True)  # an eviction: the stop after it runs here too
                elif inline:
                    run(action)
                else:
                    self._thread(run, action)

    def _thread(self, run: Callable[[Any], None], action: Any) -> None:
        try:
            threading.Thread(target=run, args=(action,), daemon=True,
                             name=f"{type(action).__name__.lower()}-{action.rid}").start()
        except RuntimeError as exc:  # no thread to be had: a failure of the pool's own, never the worker's
            log.warning("cannot start a thread for %s (%s)", action, exc)
            if isinstance(action, c.Ping):
                self.event("pinged", action.rid, action.purpose, False, None, f"no thread: {exc}")
            elif isinstance(action, c.Start):
                self.event("start_failed", action.rid, ResidentPoolError(
                    f"the pool could not start a thread for a worker start ({exc})", reason="pool_error"))
            else:
                run(action)  # a stop or a hibernation runs here rather than leave a replica half done

    # -- starting ---------------------------------------------------------------------------------
    def _start(self, action: c.Start) -> None:
        with self.lock:
            replica = self.core.replica(action.rid)
            if replica is None:
                return
            key, index, budget = replica.key, replica.index, replica.budget_gb
            worker = self.workers.get(action.rid)
            waiter = self.waiters.get(action.ticket) if action.ticket is not None else None
        began = self.clock()
        try:
            if worker is None:
                loaded = self.registry.get(key)
                process = WorkerProcess(loaded.slug, index, state_dir=self.state_dir,
                                        start_timeout_s=loaded.manifest.lifecycle.start_timeout_s)
                worker = Worker(action.rid, key, index, budget, loaded, process)
                with self.lock:
                    self.workers[action.rid] = worker
            env = self._admit(worker, action, waiter)
            if self._called_off(action.rid):
                raise WorkerStartError(f"{worker.loaded.slug}: the start was called off", slug=worker.loaded.slug,
                                       reason="start_cancelled")
            answer = self._restored(worker) if action.restore else None
            if answer is None:
                answer = self._spawn(worker, env)
        except Exception as exc:  # noqa: BLE001 - whatever ends a start, its replica hears of it and is decided again
            error = self._start_error(action.rid, worker, exc, key)
            if not action.wait and error.reason == "no_room":
                log.info("%s: could not keep a worker warm now: %s", key, error.headline)
            self.event("start_failed", action.rid, error,
                       noted=(lambda: self.observer.on_start_failed(worker, error)) if worker is not None else None)
            return
        took = self.clock() - began
        self.event("started", action.rid, worker.pid, bool(answer.get("recall")),
                   noted=lambda: self.observer.on_started(worker, took))

    def _admit(self, worker: Worker, action: c.Start, waiter: Waiter | None) -> dict[str, str]:
        manifest = worker.loaded.manifest
        admitter = None if manifest.gpu.policy == "none" else (
            CpuOnly() if manifest.gpu.policy == "recommended" and not read_devices()[0] else self.admission)
        if not worker.budget_gb or admitter is None:
            self.event("admitted", action.rid, None)
            return {}
        asked = self.clock()
        device = int(worker.hibernation.device) if worker.hibernation is not None and worker.hibernation.device \
            else None
        def report(wait: dict[str, Any]) -> None:
            log.info("%s waits for %g GB (%.0f s so far); free %s; held by %s", wait["slug"], wait["needs_gb"],
                     wait["waited_s"], wait["free"], "; ".join(wait["holders"]) or "nobody in the pool")
            if waiter is not None and waiter.progress is not None:
                waiter.progress({"waiting_for_admission": wait})

        try:
            env = dict(admitter.admit(worker, wait=action.wait, device=device, on_wait=report,
                                      cancelled=lambda: self._called_off(action.rid)))
        finally:
            if admitter is self.admission:
                self.observer.on_admission(worker.loaded.slug, self.clock() - asked)
        worker.admitter = admitter
        self.event("admitted", action.rid, env.get("CUDA_VISIBLE_DEVICES"))
        return env

    def _called_off(self, rid: int) -> bool:
        with self.lock:
            replica = self.core.replica(rid)
            return replica is None or replica.abort is not None

    def _spawn(self, worker: Worker, env: dict[str, str]) -> dict[str, Any]:
        loaded, process = worker.loaded, worker.process
        process.device = env.get("CUDA_VISIBLE_DEVICES")
        launch = Launch.of(command_builder(loaded.manifest)(process))
        if loaded.strip_kit:  # stock without the kit: none of its variables, even under passthrough "*"
            import os

            launch = replace(launch, env={**launch.env, **stray_variables(loaded.strip_kit, os.environ, set())})

        def spawned(pid: int) -> None:
            if worker.admitter is self.admission:
                self.admission.started(worker)  # the ledger names the loading worker from now on
            self.event("spawned", worker.rid, pid)

        return process.start(launch, env, spawner=self.zygotes.spawner(loaded.manifest, launch), on_spawn=spawned,
                             cancelled=lambda: self._abort_reason(worker.rid))

    def _abort_reason(self, rid: int) -> str | None:
        with self.lock:
            replica = self.core.replica(rid)
            if replica is None:
                return "it was forgotten"
            return replica.abort[1] if replica.abort else None

    def _restored(self, worker: Worker) -> dict[str, Any] | None:
        """Restore a hibernated worker (admitted already): its first answer; None when it starts afresh instead."""
        hibernation, worker.hibernation = worker.hibernation, None
        if hibernation is None:
            return None
        try:
            self.hibernator.restore(worker.process)
            answer = worker.process.ping(timeout=self.core.timings.liveness_timeout_s)
            if answer is None:
                raise CheckpointError(f"it did not answer a ping within {self.core.timings.liveness_timeout_s:g} s "
                                      "of its restore")
        except CheckpointError as exc:
            why = f"its restore from hibernation failed ({exc}); stopped, and a fresh worker started"
            worker.process.note(why)
            self.hibernator.noted(worker.loaded.slug, f"{worker.slug}[{worker.index}]: {why}")
            worker.process.kill(grace_s=self.kill_grace_s)
            worker.process = WorkerProcess(worker.loaded.slug, worker.index, state_dir=self.state_dir,
                                           start_timeout_s=worker.loaded.manifest.lifecycle.start_timeout_s)
            self.event("restarted", worker.rid, f"{worker.slug}[{worker.index}]: {why}")
            return None
        self.hibernator.noted(worker.loaded.slug, f"{worker.slug}[{worker.index}] restored from hibernation")
        return answer

    def _start_error(self, rid: int, worker: Worker | None, exc: Exception, key: str) -> ResidentPoolError:
        if isinstance(exc, ResidentPoolError):
            error = exc
        else:
            transcript = worker.process.transcript_path if worker is not None else None
            error = WorkerStartError(f"{key}: could not start a worker: {type(exc).__name__}: {exc}", slug=key,
                                     transcript=transcript)
        if worker is not None and worker.process.proc is not None and worker.process.returncode is None:
            worker.process.kill(grace_s=self.kill_grace_s)
        with self.lock:
            self.start_errors[rid] = error
            while len(self.start_errors) > _KEPT_START_ERRORS:
                del self.start_errors[next(iter(self.start_errors))]
        return error

    # -- stopping, pinging, hibernating ------------------------------------------------------------
    def _stop(self, action: c.Stop) -> None:
        worker = self.workers.get(action.rid)
        failure = None
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
        self.event("stopped", action.rid, failure)

    def _ping(self, action: c.Ping) -> None:
        worker = self.workers.get(action.rid)
        if worker is None:
            return
        busy = action.purpose == "liveness" and worker.process.in_flight_s() is not None
        try:  # a request in flight (a kept lease's) answers for the worker: it is alive and computing
            answer = {"busy": True} if busy else worker.process.ping(timeout=action.timeout_s, raise_own=True)
        except OSError as exc:
            self.event("pinged", action.rid, action.purpose, False, None, f"{type(exc).__name__}: {exc}")
            return
        if answer is None and action.purpose == "liveness" and worker.process.in_flight_s() is not None:
            answer = {"busy": True}  # a request began after the look and held the ping up: alive
        rc = None
        if answer is None:
            # Its socket closes a moment before it can be reaped: wait that moment, or a death reads as a hang.
            rc = worker.process.wait_dead(DEATH_WAIT_S)
        elif action.purpose == "liveness":
            self.observer.collect_stats(worker)  # still checking: the worker is idle
        self.event("pinged", action.rid, action.purpose, answer is not None, rc)

    def _recall(self, action: c.Recall, inline: bool = False) -> None:
        worker = self.workers.get(action.rid)
        if worker is None:
            return
        # Answered once any request in flight is over: as long as a request may run, and a little more.
        timeout = worker.loaded.manifest.lifecycle.request_timeout_s + self.core.timings.report_margin_s
        answer = worker.process.recall(self.token(action.lease), timeout)
        if answer is not None:
            idle = answer.get("idle_s")
            self.event("recalled", action.lease, float(idle) if isinstance(idle, int | float) else 0.0, inline=inline)
            return
        rc = worker.process.wait_dead(DEATH_WAIT_S)
        if rc is not None:
            self.event("exited", action.rid, rc)
        # else: no answer from a live worker; the core's deadline on the recall escalates it

    def token(self, lease: int) -> str:
        """What names lease ``lease`` to its worker (which refuses it once recalled)."""
        return f"{self.nonce}-{lease}"

    def _hibernate(self, action: c.Hibernate) -> None:
        worker = self.workers[action.rid]
        slug = worker.loaded.slug
        try:
            worker.hibernation = self.hibernator.hibernate(worker.process)
        except CheckpointError as exc:
            note = f"{worker.slug}[{worker.index}] could not hibernate ({exc}); stopped instead"
            self.hibernator.noted(slug, note)
            self.event("hibernated", action.rid, False, note, inline=True)
            return
        self.hibernator.noted(slug, f"{worker.slug}[{worker.index}] hibernated: {action.why}")
        self.event("hibernated", action.rid, True, action.why)

    def _release_budget(self, rid: int) -> None:
        worker = self.workers.get(rid)
        if worker is None:
            return
        admitter, worker.admitter = worker.admitter, None
        if admitter is not None:
            admitter.release(worker)

    def _gone(self, action: c.Gone) -> None:
        self._release_budget(action.rid)
        with self.lock:
            worker = self.workers.pop(action.rid, None)
        if worker is not None:
            self.observer.on_gone(worker, action.cause, action.why, action.served)

    # -- what the maintenance loop does -----------------------------------------------------------
    def maintain(self, beat: bool, connections: int) -> None:
        """Heartbeats, deaths between requests, and the core's clock: idle, liveness, overdue, quiet."""
        with self.lock:
            workers = list(self.workers.values())
            for lease in [lease for lease in self.by_lease if lease not in self.core.leases]:
                del self.by_lease[lease]  # recalled, or its client went away: its release finds nothing
        for worker in workers:
            if beat:  # a worker still loading its model counts on it too
                worker.process.beat()
            # Whoever reaped it (a status read asks the process too), the core hears of the exit here.
            rc = worker.process.poll() if worker.process.proc is not None else None
            if rc is not None and not worker.stopped_on_purpose:
                self.event("exited", worker.rid, rc)
        self.event("tick", connections, bool(self.admission.waiting()))

    def evict(self, needed_gb: float) -> bool:
        """Admission's ask for room: stop (or hibernate) the least recently used idle GPU worker, here and now.

        Workers kept warm (min_replicas) go after every other idle one, and only when giving back every idle
        kept-warm budget would let the request fit: never for nothing.
        """
        with self.lock:
            candidate = self.core.eviction_candidate()
        if candidate is None:
            return False
        rid, kept, freed = candidate
        if kept and not self.admission.fits_if_freed(needed_gb, freed):
            return False
        worker = self.workers.get(rid)
        if self.event("evict", rid, needed_gb, inline=True) and worker is not None:
            self.observer.on_evicted(worker.loaded.slug)
        return True

    def retire(self, rid: int, cause: StopCause, why: str) -> None:
        self.event("retire", rid, cause, why)

    # -- what the pool's ops wait on ------------------------------------------------------------------
    def grant(self, grant: c.Grant, key: str) -> LeaseGrant:
        """The lease a waiting client gets: where the worker's socket is, and how long a request may run."""
        with self.lock:
            worker = self.by_lease[grant.lease]
        process, manifest = worker.process, worker.loaded.manifest
        return LeaseGrant(lease=grant.lease, slug=key, replica=worker.index, pid=process.pid,
                          socket=process.socket_path, cold=grant.cold, transcript=process.transcript_path,
                          request_timeout_s=manifest.lifecycle.request_timeout_s, device=process.device,
                          version=worker.loaded.version,
                          kit=process.launch.kit if process.launch is not None else None,
                          token=self.token(grant.lease), kept=grant.kept)

    def release(self, release: Release, connection: int) -> dict[str, Any] | None:
        """A lease ends; what the client's last request saw is turned into a fact first (did the worker die?)."""
        with self.lock:
            lease = self.core.leases.get(release.lease)
            if lease is not None and lease.connection != connection:
                raise ResidentPoolError(f"lease {release.lease} is not held by this connection; a client releases "
                                        "only its own leases", reason="bad_request")
            worker = self.by_lease.pop(release.lease, None) if lease is not None else None
        quiet = release.outcome in ("ok", "abandoned")  # the client does not wait for an answer to these
        if worker is None:  # ended already (a kept lease recalled, a stop --now): the client may acquire again
            return None if quiet else {"ok": True, "gone": True}
        outcome, rc, answer = release.outcome, None, {"ok": True}
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
        # A worker that ended its lease's request (timed out, exiting, dead) is stopped before the client hears:
        # the next status and the next request see it gone.
        self.event("released", release.lease, connection, outcome, release.served, rc,
                   inline=outcome in ("timeout", "exiting", "died"))
        return None if quiet else answer

    def wait_gone(self, rids: list[int], bound_s: float) -> None:
        """Wait until none of ``rids`` is left (every stop reports back, or is escalated), at most ``bound_s``."""
        deadline = self.clock() + bound_s
        with self.lock:
            while any(rid in self.core.replicas for rid in rids) and self.clock() < deadline:
                self.changed.wait(0.25)

    def wait_started(self, rids: list[int], bound_s: float) -> list[ResidentPoolError]:
        """Wait until each of ``rids`` has started or failed (at most ``bound_s``); the errors of those that failed."""
        deadline = self.clock() + bound_s

        def starting() -> bool:
            return any(self.core.replicas.get(rid) is not None
                       and self.core.replicas[rid].state is ReplicaState.STARTING for rid in rids)

        with self.lock:
            while starting() and self.clock() < deadline:
                self.changed.wait(0.25)
            return [self.start_errors.pop(rid) for rid in rids if rid in self.start_errors]
