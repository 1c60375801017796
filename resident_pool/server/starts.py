"""How a replica's worker starts, as three actions of the core: ``Start`` (prepare the worker record and say what
GPU memory it needs; a budget no device holds is refused here at once), ``Place`` (one try at the ledger, or the
host admission service; the core's GPU line decides which start tries and when) and ``Spawn`` (the process,
forked from a zygote or spawned, or a hibernated one restored); ``Withdraw`` ends a wait for memory unplaced.
Each outcome goes back to the core as an event.

Part of the runtime (it acts, it decides nothing): the runtime hands it each of those actions.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from dataclasses import replace
from typing import Any, Protocol

from ..admission import Admission
from ..errors import AdmissionTimeout, ResidentPoolError, WorkerStartError
from ..host.paths import Paths
from ..providers.hibernate import CheckpointError, Hibernator
from ..providers.kit_rules import stray_variables
from ..providers.launch import command_builder
from ..providers.supervisor import CpuOnly
from ..providers.worker_process import Launch, WorkerProcess
from ..providers.zygote import Zygotes
from ..settings import Settings
from . import actions as c
from . import events as ev
from .actions import Timings
from .handles import Waiter, Worker
from .observing import Observer
from .registry import Registry
from .view import CoreView

__all__ = ["WAIT_REPORT_S", "Runtime", "Starter"]

log = logging.getLogger("resident_pool.pool")
WAIT_REPORT_S = 5.0  # how often a request waiting for memory hears what it waits for


class Runtime(Protocol):
    """What the starter asks of the runtime that holds it: to hear how a step ended, and the records it keeps."""

    lock: threading.RLock
    workers: dict[int, Worker]
    waiters: dict[int, Waiter]

    def clock(self) -> float: ...

    def report(self, event: ev.Event, inline: bool = False,
               noted: Callable[[ev.Decision], None] | None = None) -> ev.Decision: ...

    def view(self) -> CoreView: ...

    def adopt(self, worker: Worker) -> None: ...

    def keep_error(self, rid: int, error: ResidentPoolError) -> None: ...


class Starter:
    """Carries out Start, Place, Withdraw and Spawn actions for the runtime."""

    def __init__(self, runtime: Runtime, registry: Registry, admission: Admission, zygotes: Zygotes,
                 hibernator: Hibernator, observer: Observer, paths: Paths, config: Settings,
                 timings: Timings) -> None:
        self.runtime = runtime
        self.registry = registry
        self.admission = admission
        self.zygotes = zygotes
        self.hibernator = hibernator
        self.observer = observer
        self.paths = paths
        self.config = config
        self.kill_grace_s = config.kill_grace_s
        self.timings = timings

    def carry_out(self, action: c.Start | c.Place | c.Withdraw | c.Spawn) -> None:
        """One step of a start, as the core decided it."""
        if isinstance(action, c.Start):
            self.start(action)
        elif isinstance(action, c.Place):
            self.place(action)
        elif isinstance(action, c.Withdraw):
            self.withdraw(action)
        else:
            self.spawn(action)

    def start(self, action: c.Start) -> None:
        """Prepare a start: its worker record, and the GPU memory it needs (refused at once if none could hold it)."""
        runtime = self.runtime
        with runtime.lock:
            replica = runtime.view().replica(action.rid)
            if replica is None:
                return
            key, index, budget = replica.key, replica.index, replica.budget_gb
            worker = runtime.workers.get(action.rid)
        try:
            if worker is None:
                loaded = self.registry.get(key)
                if loaded is None:  # registered before any start of it, and kept while any replica of it lives
                    raise ResidentPoolError(f"{key}: its manifest is not loaded in this pool", slug=key)
                process = WorkerProcess(loaded.slug, index, paths=self.paths, kill_grace_s=self.kill_grace_s,
                                        start_timeout_s=loaded.manifest.lifecycle.start_timeout_s)
                worker = Worker(action.rid, key, index, budget, loaded, process)
                runtime.adopt(worker)
            need = self._need(worker)
        except Exception as exc:  # noqa: BLE001 - whatever ends a start, its replica hears of it and is decided again
            self._failed(action.rid, worker, exc, key)
            return
        device = int(worker.hibernation.device) if worker.hibernation is not None and worker.hibernation.device \
            else None
        worker.asked, worker.reported, worker.waits_for = runtime.clock(), 0.0, None
        runtime.report(ev.StartPrepared(action.rid, need, device, action.wait))

    def _need(self, worker: Worker) -> float | None:
        """The GPU memory a start needs placed first: None where it holds no GPU budget."""
        manifest = worker.loaded.manifest
        if manifest.gpu.policy == "none" or not worker.budget_gb:
            worker.env = {}
            return None
        if manifest.gpu.policy == "recommended" and not self.admission.devices()[0]:
            worker.admitter, worker.env = CpuOnly(), {"CUDA_VISIBLE_DEVICES": ""}
            return None
        self.admission.check(worker.loaded.slug, float(worker.budget_gb))
        return float(worker.budget_gb)

    def place(self, action: c.Place) -> None:
        """One placement try, as the core decided; its outcome (and the room read) goes back to the core."""
        runtime = self.runtime
        worker = runtime.workers.get(action.rid)
        if worker is None:
            runtime.report(ev.BudgetNotPlaced(action.rid, {}))
            return
        try:
            placement = self.admission.place(worker, action.need_gb, action.device, action.priority,
                                                action.backfill, action.waited_s, action.once)
        except Exception as exc:  # noqa: BLE001 - a refusal from the host service, a ledger that cannot be written
            self._failed(action.rid, worker, exc, worker.slug)
            return
        if placement.device is None and action.once:
            runtime.report(ev.StartFailed(action.rid, AdmissionTimeout(
                f"{worker.loaded.slug}: no room now for {action.need_gb:g} GB of GPU memory ({placement.why}); a "
                "warm-up does not wait, queue or evict: it tries again later", slug=worker.loaded.slug,
                reason="no_room")))
            return
        if placement.device is None:
            first, worker.waits_for = worker.waits_for is None, placement.why
            runtime.report(ev.BudgetNotPlaced(action.rid, placement.rooms))
            if first:
                self.report_waits(action.rid)  # its client hears at once what it waits for, then every few seconds
            return
        worker.admitter, worker.env = self.admission, {"CUDA_VISIBLE_DEVICES": str(placement.device)}
        self.observer.on_admission(worker.loaded.slug, action.priority, runtime.clock() - worker.asked)
        runtime.report(ev.BudgetPlaced(action.rid, placement.device, placement.backfilled))

    def withdraw(self, action: c.Withdraw) -> None:
        """The wait for memory ended unplaced: the error its request hears."""
        runtime = self.runtime
        worker = runtime.workers.get(action.rid)
        slug = worker.loaded.slug if worker is not None else str(action.rid)
        if worker is not None and worker.admitter is None:
            try:
                self.admission.withdraw(worker)
            except (OSError, ResidentPoolError) as exc:  # the host service forgets an ask whose pool went quiet
                log.warning("%s: could not withdraw its admission ask: %s", slug, exc)
        if action.reason == "admission_timeout" and worker is not None:
            error: ResidentPoolError = self.admission.timeout_error(slug, float(worker.budget_gb or 0),
                                                                       action.waited_s, self._ahead(action.rid))
        elif action.reason == "no_room":
            error = AdmissionTimeout(f"{slug}: no room now for {worker.budget_gb if worker else 0:g} GB of GPU "
                                     "memory; a warm-up does not wait, queue or evict: it tries again later",
                                     slug=slug, reason="no_room")
            log.info("%s: could not keep a worker warm now: %s", slug, error.headline)
        else:
            error = WorkerStartError(f"{slug}: the start was called off", slug=slug, reason="start_cancelled")
        observer = self.observer
        runtime.report(ev.StartFailed(action.rid, error),
                       noted=(lambda decision: observer.on_start_failed(worker, decision.error or error))
                       if worker is not None and action.reason != "start_cancelled" else None)

    def _ahead(self, rid: int) -> list[str]:
        with self.runtime.lock:
            line = self.runtime.view().gpu_line
        names = [f"{e.key}[{e.replica}] ({e.needs_gb:g} GB, {e.priority})" for e in line]
        mine = next((n for n, e in enumerate(line) if e.rid == rid), len(line))
        return names[:mine]

    def spawn(self, action: c.Spawn) -> None:
        """Spawn (or restore) a replica whose memory is placed."""
        runtime = self.runtime
        worker = runtime.workers.get(action.rid)
        if worker is None:
            return
        began = runtime.clock()
        try:
            if self._called_off(action.rid):
                raise WorkerStartError(f"{worker.loaded.slug}: the start was called off", slug=worker.loaded.slug,
                                       reason="start_cancelled")
            answer = self._restored(worker)
            if answer is None:
                answer = self._spawn(worker, worker.env or {})
        except Exception as exc:  # noqa: BLE001 - whatever ends a start, its replica hears of it and is decided again
            self._failed(action.rid, worker, exc, worker.slug)
            return
        if worker.admitter is self.admission:
            self.admission.loaded(worker)  # NVML's free memory shows its budget from now on
        took = runtime.clock() - began
        runtime.report(ev.WorkerStarted(action.rid, worker.pid, bool(answer.get("recall"))),
                       noted=lambda _: self.observer.on_started(worker, took))

    def report_waits(self, only: int | None = None) -> None:
        """Every few seconds, each request waiting for memory hears (and the log says) what it waits for; ``only``:
        that start's, now (its first try found no room)."""
        runtime = self.runtime
        now = runtime.clock()
        with runtime.lock:
            line = runtime.view().gpu_line
            due = []
            for n, entry in enumerate(line):
                worker = runtime.workers.get(entry.rid)
                if worker is None or (only is not None and entry.rid != only):
                    continue
                # The first report as soon as a try found no room (or it waits behind another), then every few s.
                tried = worker.waits_for is not None or not entry.placing
                if tried and now - worker.reported >= WAIT_REPORT_S:
                    worker.reported = now
                    waiter = runtime.waiters.get(entry.ticket) if entry.ticket is not None else None
                    ahead = [f"{e.key}[{e.replica}] ({e.needs_gb:g} GB, {e.priority})" for e in line[:n]]
                    due.append((worker, entry, ahead, waiter))
        for worker, entry, ahead, waiter in due:
            wait = self.admission.describe(worker.loaded.slug, entry.needs_gb, entry.waited_s, ahead,
                                              worker.waits_for)
            wait.update(priority=entry.priority, position=entry.position)
            log.info("%s waits for %g GB (%s, %.0f s so far); free %s; held by %s", wait["slug"], wait["needs_gb"],
                     entry.priority, wait["waited_s"], wait["free"], "; ".join(wait["holders"]) or "nobody")
            if waiter is not None and waiter.progress is not None:
                waiter.progress({"waiting_for_admission": wait})

    def _failed(self, rid: int, worker: Worker | None, exc: Exception, key: str) -> None:
        error = self._start_error(rid, worker, exc, key)
        observer = self.observer
        self.runtime.report(ev.StartFailed(rid, error),  # the error a breaker opened with says so (decision.error)
                            noted=(lambda decision: observer.on_start_failed(worker, decision.error or error))
                            if worker is not None else None)

    def _called_off(self, rid: int) -> bool:
        replica = self.runtime.view().replica(rid)
        return replica is None or replica.called_off is not None

    def _spawn(self, worker: Worker, env: dict[str, str]) -> dict[str, Any]:
        runtime, loaded, process = self.runtime, worker.loaded, worker.process
        process.device = env.get("CUDA_VISIBLE_DEVICES")
        launch = Launch.of(command_builder(loaded.manifest, self.config, self.paths)(process))
        if loaded.strip_kit:  # stock without the kit: none of its variables, even under passthrough "*"
            launch = replace(launch, env={**launch.env, **stray_variables(loaded.strip_kit, os.environ, set())})

        def spawned(pid: int) -> None:
            if worker.admitter is self.admission:
                self.admission.started(worker)  # the ledger names the loading worker from now on
            runtime.report(ev.WorkerSpawned(worker.rid, pid))

        spawner = self.zygotes.spawner(loaded.manifest, launch)
        return process.start(launch, env, spawner=spawner, on_spawn=spawned,
                             cancelled=lambda: self._abort_reason(worker.rid))

    def _abort_reason(self, rid: int) -> str | None:
        replica = self.runtime.view().replica(rid)
        return "it was forgotten" if replica is None else replica.called_off

    def _restored(self, worker: Worker) -> dict[str, Any] | None:
        """Restore a hibernated worker (placed already): its first answer; None when it starts afresh instead."""
        runtime = self.runtime
        hibernation, worker.hibernation = worker.hibernation, None
        if hibernation is None:
            return None
        try:
            self.hibernator.restore(worker.process)
            timeout = self.timings.liveness_timeout_s
            answer = worker.process.ping(timeout=timeout)
            if answer is None:
                raise CheckpointError(f"it did not answer a ping within {timeout:g} s of its restore")
        except CheckpointError as exc:
            why = f"its restore from hibernation failed ({exc}); stopped, and a fresh worker started"
            worker.process.note(why)
            self.hibernator.noted(worker.loaded.slug, f"{worker.slug}[{worker.index}]: {why}")
            worker.process.kill(grace_s=self.kill_grace_s)
            worker.process = WorkerProcess(worker.loaded.slug, worker.index, paths=self.paths,
                                           kill_grace_s=self.kill_grace_s,
                                           start_timeout_s=worker.loaded.manifest.lifecycle.start_timeout_s)
            runtime.report(ev.RestoreFailed(worker.rid, f"{worker.slug}[{worker.index}]: {why}"))
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
        self.runtime.keep_error(rid, error)
        return error
