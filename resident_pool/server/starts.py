"""How a replica's worker starts: admission (its GPU budget, waiting where it must), then a spawn, a fork
from a zygote, or a restore from hibernation; the outcome goes back to the core as an event.

Part of the runtime (it acts, it decides nothing): the runtime hands it each Start action.
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from ..admission import read_devices
from ..errors import ResidentPoolError, WorkerStartError
from ..providers.hibernate import CheckpointError
from ..providers.kit_rules import stray_variables
from ..providers.launch import command_builder
from ..providers.supervisor import CpuOnly
from ..providers.worker_process import Launch, WorkerProcess
from . import actions as c
from .handles import Waiter, Worker

if TYPE_CHECKING:
    from .runtime import Runtime

__all__ = ["Starter"]

log = logging.getLogger("resident_pool.pool")


class Starter:
    """Carries out Start actions for the runtime."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime

    def run(self, action: c.Start) -> None:
        with self.runtime.lock:
            replica = self.runtime.core.replica(action.rid)
            if replica is None:
                return
            key, index, budget = replica.key, replica.index, replica.budget_gb
            worker = self.runtime.workers.get(action.rid)
            waiter = self.runtime.waiters.get(action.ticket) if action.ticket is not None else None
        began = self.runtime.clock()
        try:
            if worker is None:
                loaded = self.runtime.registry.get(key)
                process = WorkerProcess(loaded.slug, index, state_dir=self.runtime.state_dir,
                                        start_timeout_s=loaded.manifest.lifecycle.start_timeout_s)
                worker = Worker(action.rid, key, index, budget, loaded, process)
                self.runtime.adopt(worker)
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
            observer = self.runtime.observer
            self.runtime.event("start_failed", action.rid, error,
                               noted=(lambda: observer.on_start_failed(worker, error)) if worker is not None else None)
            return
        took = self.runtime.clock() - began
        self.runtime.event("started", action.rid, worker.pid, bool(answer.get("recall")),
                   noted=lambda: self.runtime.observer.on_started(worker, took))

    def _admit(self, worker: Worker, action: c.Start, waiter: Waiter | None) -> dict[str, str]:
        manifest = worker.loaded.manifest
        admitter = None if manifest.gpu.policy == "none" else (
            CpuOnly() if manifest.gpu.policy == "recommended" and not read_devices()[0] else self.runtime.admission)
        if not worker.budget_gb or admitter is None:
            self.runtime.event("admitted", action.rid, None)
            return {}
        asked = self.runtime.clock()
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
            if admitter is self.runtime.admission:
                self.runtime.observer.on_admission(worker.loaded.slug, self.runtime.clock() - asked)
        worker.admitter = admitter
        self.runtime.event("admitted", action.rid, env.get("CUDA_VISIBLE_DEVICES"))
        return env

    def _called_off(self, rid: int) -> bool:
        with self.runtime.lock:
            replica = self.runtime.core.replica(rid)
            return replica is None or replica.abort is not None

    def _spawn(self, worker: Worker, env: dict[str, str]) -> dict[str, Any]:
        loaded, process = worker.loaded, worker.process
        process.device = env.get("CUDA_VISIBLE_DEVICES")
        launch = Launch.of(command_builder(loaded.manifest)(process))
        if loaded.strip_kit:  # stock without the kit: none of its variables, even under passthrough "*"
            launch = replace(launch, env={**launch.env, **stray_variables(loaded.strip_kit, os.environ, set())})

        def spawned(pid: int) -> None:
            if worker.admitter is self.runtime.admission:
                self.runtime.admission.started(worker)  # the ledger names the loading worker from now on
            self.runtime.event("spawned", worker.rid, pid)

        spawner = self.runtime.zygotes.spawner(loaded.manifest, launch)
        return process.start(launch, env, spawner=spawner, on_spawn=spawned,
                             cancelled=lambda: self._abort_reason(worker.rid))

    def _abort_reason(self, rid: int) -> str | None:
        with self.runtime.lock:
            replica = self.runtime.core.replica(rid)
            if replica is None:
                return "it was forgotten"
            return replica.abort[1] if replica.abort else None

    def _restored(self, worker: Worker) -> dict[str, Any] | None:
        """Restore a hibernated worker (admitted already): its first answer; None when it starts afresh instead."""
        hibernation, worker.hibernation = worker.hibernation, None
        if hibernation is None:
            return None
        try:
            self.runtime.hibernator.restore(worker.process)
            timeout = self.runtime.core.timings.liveness_timeout_s
            answer = worker.process.ping(timeout=timeout)
            if answer is None:
                raise CheckpointError(f"it did not answer a ping within {timeout:g} s of its restore")
        except CheckpointError as exc:
            why = f"its restore from hibernation failed ({exc}); stopped, and a fresh worker started"
            worker.process.note(why)
            self.runtime.hibernator.noted(worker.loaded.slug, f"{worker.slug}[{worker.index}]: {why}")
            worker.process.kill(grace_s=self.runtime.kill_grace_s)
            worker.process = WorkerProcess(worker.loaded.slug, worker.index, state_dir=self.runtime.state_dir,
                                           start_timeout_s=worker.loaded.manifest.lifecycle.start_timeout_s)
            self.runtime.event("restarted", worker.rid, f"{worker.slug}[{worker.index}]: {why}")
            return None
        self.runtime.hibernator.noted(worker.loaded.slug, f"{worker.slug}[{worker.index}] restored from hibernation")
        return answer

    def _start_error(self, rid: int, worker: Worker | None, exc: Exception, key: str) -> ResidentPoolError:
        if isinstance(exc, ResidentPoolError):
            error = exc
        else:
            transcript = worker.process.transcript_path if worker is not None else None
            error = WorkerStartError(f"{key}: could not start a worker: {type(exc).__name__}: {exc}", slug=key,
                                     transcript=transcript)
        if worker is not None and worker.process.proc is not None and worker.process.returncode is None:
            worker.process.kill(grace_s=self.runtime.kill_grace_s)
        self.runtime.keep_error(rid, error)
        return error
