"""Carrying out a start for the runtime: prepare it, place its GPU budget where the core says, spawn or restore it.

A start is three actions of the core: ``Start`` (prepare the worker record and say what GPU
memory it needs; a budget no device holds is refused here at once), ``Place`` (one try at the
ledger, or the host admission service; the core decides which start tries and when) and
``Spawn`` (the process, forked from a zygote or spawned, or a hibernated one restored);
``Withdraw`` ends a wait for memory unplaced. Each outcome goes back to the core as an event.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..admission import Admission, read_devices
from ..errors import AdmissionTimeout, ResidentPoolError, WorkerStartError
from ..providers.hibernate import CheckpointError, Hibernation, Hibernator
from ..providers.kit_rules import stray_variables
from ..providers.launch import command_builder
from ..providers.supervisor import CpuOnly
from ..providers.worker_process import Launch, WorkerProcess
from ..providers.zygote import Zygotes
from . import actions as c
from .core import PoolState
from .registry import Loaded, Registry

__all__ = ["Starts", "Worker"]

log = logging.getLogger("resident_pool.pool")
_KEPT_START_ERRORS = 64  # the last failed starts, for warm-ups that wait on them


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
    env: dict[str, str] | None = None  # what admission gave it (CUDA_VISIBLE_DEVICES)
    asked: float = 0.0  # when its start began to wait for memory (monotonic)
    reported: float = 0.0  # when its client last heard what the wait is for
    waits_for: str | None = None  # the last placement's words for what it waits for

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


class Starts:
    """The runtime's start path; the runtime holds the lock, the workers and the core, and hands them here."""

    def __init__(self, core: PoolState, lock: threading.RLock, workers: dict[int, Worker], registry: Registry,
                 admission: Admission, zygotes: Zygotes, hibernator: Hibernator, state_dir: Path, observer: Any,
                 kill_grace_s: float, clock: Callable[[], float], report: Callable[..., Any],
                 waiting: Callable[[int], None]) -> None:
        """``report(name, *args)``: an event for the core (the runtime's ``event``); ``waiting(rid)``: tell the
        client of a start that waits for memory what it waits for."""
        self.core = core
        self.lock = lock
        self.workers = workers
        self.registry = registry
        self.admission = admission
        self.zygotes = zygotes
        self.hibernator = hibernator
        self.state_dir = state_dir
        self.observer = observer
        self.kill_grace_s = kill_grace_s
        self.clock = clock
        self.report = report
        self.waiting = waiting
        self.errors: dict[int, ResidentPoolError] = {}  # for warm-ups waiting on their starts

    def start(self, action: c.Start) -> None:
        """Prepare a start: its worker record, and the GPU memory it needs (refused at once if none could hold it)."""
        with self.lock:
            replica = self.core.replica(action.rid)
            if replica is None:
                return
            key, index, budget = replica.key, replica.index, replica.budget_gb
            worker = self.workers.get(action.rid)
        try:
            if worker is None:
                loaded = self.registry.get(key)
                process = WorkerProcess(loaded.slug, index, state_dir=self.state_dir,
                                        start_timeout_s=loaded.manifest.lifecycle.start_timeout_s)
                worker = Worker(action.rid, key, index, budget, loaded, process)
                with self.lock:
                    self.workers[action.rid] = worker
            need = self._need(worker)
        except Exception as exc:  # noqa: BLE001 - whatever ends a start, its replica hears of it and is decided again
            self._failed(action.rid, worker, exc, key)
            return
        device = int(worker.hibernation.device) if worker.hibernation is not None and worker.hibernation.device \
            else None
        worker.asked, worker.reported, worker.waits_for = self.clock(), 0.0, None
        self.report("prepared", action.rid, need, device, action.wait)

    def _need(self, worker: Worker) -> float | None:
        """The GPU memory a start needs placed first: None where it holds no GPU budget."""
        manifest = worker.loaded.manifest
        if manifest.gpu.policy == "none" or not worker.budget_gb:
            worker.env = {}
            return None
        if manifest.gpu.policy == "recommended" and not read_devices()[0]:
            worker.admitter, worker.env = CpuOnly(), {"CUDA_VISIBLE_DEVICES": ""}
            return None
        self.admission.check(worker.loaded.slug, float(worker.budget_gb))
        return float(worker.budget_gb)

    def place(self, action: c.Place) -> None:
        """One placement try, as the core decided; its outcome (and the room read) goes back to the core."""
        worker = self.workers.get(action.rid)
        if worker is None:
            self.report("not_placed", action.rid, {})
            return
        try:
            placement = self.admission.place(worker, action.need_gb, action.device, action.priority, action.backfill,
                                             action.waited_s, action.once)
        except Exception as exc:  # noqa: BLE001 - a refusal from the host service, a ledger that cannot be written
            self._failed(action.rid, worker, exc, worker.slug)
            return
        if placement.device is None and action.once:
            self.report("start_failed", action.rid, AdmissionTimeout(
                f"{worker.loaded.slug}: no room now for {action.need_gb:g} GB of GPU memory ({placement.why}); a "
                "warm-up does not wait, queue or evict: it tries again later", slug=worker.loaded.slug,
                reason="no_room"))
            return
        if placement.device is None:
            first, worker.waits_for = worker.waits_for is None, placement.why
            self.report("not_placed", action.rid, placement.rooms)
            if first:
                self.waiting(action.rid)  # its client hears at once what it waits for, then every few seconds
            return
        worker.admitter, worker.env = self.admission, {"CUDA_VISIBLE_DEVICES": str(placement.device)}
        self.observer.on_admission(worker.loaded.slug, action.priority, self.clock() - worker.asked)
        self.report("placed", action.rid, placement.device, placement.backfilled)

    def withdraw(self, action: c.Withdraw) -> None:
        """The wait for memory ended unplaced: the error its request hears."""
        worker = self.workers.get(action.rid)
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
        self.report("start_failed", action.rid, error)
        if worker is not None and action.reason != "start_cancelled":
            self.observer.on_start_failed(worker, error)

    def _ahead(self, rid: int) -> list[str]:
        with self.lock:
            rows = self.core.admitting.rows(self.clock())
        names = [f"{r['key']}[{r['replica']}] ({r['needs_gb']:g} GB, {r['priority']})" for r in rows]
        mine = next((n for n, r in enumerate(rows) if r["rid"] == rid), len(rows))
        return names[:mine]

    def spawn(self, action: c.Spawn) -> None:
        """Spawn (or restore) a replica whose memory is placed."""
        worker = self.workers.get(action.rid)
        if worker is None:
            return
        began = self.clock()
        try:
            if self._called_off(action.rid):
                raise WorkerStartError(f"{worker.loaded.slug}: the start was called off", slug=worker.loaded.slug,
                                       reason="start_cancelled")
            if not self._restored(worker):
                self._spawn(worker, worker.env or {})
        except Exception as exc:  # noqa: BLE001 - whatever ends a start, its replica hears of it and is decided again
            self._failed(action.rid, worker, exc, worker.slug)
            return
        self.report("started", action.rid, worker.pid)
        self.observer.on_started(worker, self.clock() - began)

    def _failed(self, rid: int, worker: Worker | None, exc: Exception, key: str) -> None:
        error = self._start_error(rid, worker, exc, key)
        self.report("start_failed", rid, error)
        if worker is not None:
            self.observer.on_start_failed(worker, error)

    def _called_off(self, rid: int) -> bool:
        with self.lock:
            replica = self.core.replica(rid)
            return replica is None or replica.abort is not None

    def _spawn(self, worker: Worker, env: dict[str, str]) -> None:
        loaded, process = worker.loaded, worker.process
        process.device = env.get("CUDA_VISIBLE_DEVICES")
        launch = Launch.of(command_builder(loaded.manifest)(process))
        if loaded.strip_kit:  # stock without the kit: none of its variables, even under passthrough "*"
            import os

            launch = replace(launch, env={**launch.env, **stray_variables(loaded.strip_kit, os.environ, set())})

        def spawned(pid: int) -> None:
            if worker.admitter is self.admission:
                self.admission.started(worker)  # the ledger names the loading worker from now on
            self.report("spawned", worker.rid, pid)

        process.start(launch, env, spawner=self.zygotes.spawner(loaded.manifest, launch), on_spawn=spawned,
                      cancelled=lambda: self._abort_reason(worker.rid))

    def _abort_reason(self, rid: int) -> str | None:
        with self.lock:
            replica = self.core.replica(rid)
            if replica is None:
                return "it was forgotten"
            return replica.abort[1] if replica.abort else None

    def _restored(self, worker: Worker) -> bool:
        """Restore a hibernated worker (admitted already); False when it is to start afresh instead."""
        hibernation, worker.hibernation = worker.hibernation, None
        if hibernation is None:
            return False
        try:
            self.hibernator.restore(worker.process)
            if worker.process.ping(timeout=self.core.timings.liveness_timeout_s) is None:
                raise CheckpointError(f"it did not answer a ping within {self.core.timings.liveness_timeout_s:g} s "
                                      "of its restore")
        except CheckpointError as exc:
            why = f"its restore from hibernation failed ({exc}); stopped, and a fresh worker started"
            worker.process.note(why)
            self.hibernator.noted(worker.loaded.slug, f"{worker.slug}[{worker.index}]: {why}")
            worker.process.kill(grace_s=self.kill_grace_s)
            worker.process = WorkerProcess(worker.loaded.slug, worker.index, state_dir=self.state_dir,
                                           start_timeout_s=worker.loaded.manifest.lifecycle.start_timeout_s)
            self.report("restarted", worker.rid, f"{worker.slug}[{worker.index}]: {why}")
            return False
        self.hibernator.noted(worker.loaded.slug, f"{worker.slug}[{worker.index}] restored from hibernation")
        return True

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
            self.errors[rid] = error
            while len(self.errors) > _KEPT_START_ERRORS:
                del self.errors[next(iter(self.errors))]
        return error
