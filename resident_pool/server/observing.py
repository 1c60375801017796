"""What an operator reads from outside the pool: metrics, lifecycle events, measured GPU memory, retention.

The observer changes no replica: it reads the snapshots the runtime hands it (the core's
records and the processes beside them), keeps its own measurements per replica, and asks
the runtime to retire a worker over its budget (``over_budget = "stop"``). The runtime
calls its ``on_*`` hooks where a worker starts, fails to start or ends. GPU sampling and
pruning run on a thread of their own: an NVML call that hangs in the driver must not stop
heartbeats or retirement.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ResidentPoolError
from ..exits import describe_exit
from ..host.paths import Paths
from ..messages import SLUG
from ..ops.events import EVENTS_FILE, EventLog
from ..ops.gpu_memory import GIB, Peaks, budget_advice, group_usage, process_usage
from ..ops.metrics import PoolMetrics, serve_http
from ..ops.retention import prune_transcripts, transcript_slugs
from ..ops.systemd import notify, watchdog_interval_s
from ..providers.worker_process import WorkerProcess
from ..settings import Settings
from ..version import __version__
from .handles import Worker
from .states import ReplicaState, StopCause
from .view import CoreView, ReplicaView

__all__ = ["GPU_SAMPLE_S", "STATS_INTERVAL_S", "Measured", "Observer"]

log = logging.getLogger("resident_pool.pool")

# A worker's counts are collected at most this often after releases, never on the release path
# (a held session's round trip must stay within 1.5x a raw socket echo); GPU memory is sampled
# this often; a provider's transcripts are pruned at most this often after its workers stop
# (a subprocess-mode provider starts one per request, and pruning reads /proc).
STATS_INTERVAL_S = 1.0
KEPT_STATS_INTERVAL_S = 5.0
STATS_TIMEOUT_S = 2.0
GPU_SAMPLE_S = 2.0
PRUNE_INTERVAL_S = 5.0

# (core snapshot, {rid: runtime Worker}) taken together under the pool's lock
Snapshot = Callable[[], tuple[CoreView, dict[int, Worker]]]


@dataclass
class Measured:
    """What the observer measured of one worker."""

    gpu_used_gb: float | None = None  # its process group's GPU memory (NVML), None where unmeasured
    gpu_peak_gb: float | None = None
    over_budget: str | None = None  # the sentence, from the first reading above the budget
    stats_at: float = 0.0  # when the worker's own counts were last collected (monotonic)
    stats_served: int = -1  # ``served`` then: a release since makes a new collection due
    collecting: bool = False


class Observer:
    """Metrics, events, GPU readings, transcript pruning and the systemd watchdog of one pool."""

    def __init__(self, config: Settings, paths: Paths, manifests: Path, socket_path: str, snapshot: Snapshot,
                 retire: Callable[[int, StopCause, str], None], finished: threading.Event) -> None:
        self.paths = paths
        self.manifests = manifests
        self.socket_path = socket_path
        self.snapshot = snapshot
        self.retire = retire
        self.finished = finished
        self.metrics = PoolMetrics(self.metrics_snapshot)
        self.events = EventLog(paths.log_dir() / EVENTS_FILE)
        self.peaks = Peaks(paths.cache / "gpu-peaks.json")
        self.fake_nvml = config.fake_nvml
        self.metrics_port = config.metrics_port
        self.transcripts_keep = config.transcripts_keep
        self.transcripts_max_bytes = int(config.transcripts_max_mb * 2**20)
        self.measured: dict[int, Measured] = {}
        self._lock = threading.Lock()  # guards measured and the sets below; never held across I/O
        self._http: Any = None
        self.metrics_error: str | None = None  # why no metrics are served (a port someone else holds)
        self._watchdog_s = watchdog_interval_s()
        self._last_watchdog = 0.0
        self._ready_sent = False  # systemd hears WATCHDOG=1 only after READY=1
        self._prune_due: set[str] = set()
        self._advised: set[str] = set()

    # -- the pool's life ----------------------------------------------------------------------
    def start(self) -> None:
        if self.metrics_port:
            try:
                self._http = serve_http(self.metrics_port, self.metrics.registry)
                log.info("metrics on http://127.0.0.1:%d/metrics", self.metrics_port)
            except ResidentPoolError as exc:  # a port someone else holds: said in the log and in status
                self.metrics_error = str(exc)
                log.error("%s", exc)
        self._prune_due |= transcript_slugs(self.paths.log_dir())
        self.events.emit("pool.started", version=__version__, manifests=str(self.manifests))
        threading.Thread(target=self._loop, name="observe", daemon=True).start()
        notify(f"READY=1\nMAINPID={os.getpid()}\nSTATUS=serving {self.socket_path}")
        self._ready_sent = True

    def stop(self) -> None:
        notify("STOPPING=1")
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
        self.events.emit("pool.stopped")

    def tick(self, now: float, accept_tick: float) -> None:
        """From the maintenance loop: the watchdog, and the workers' counts due after releases."""
        if (self._watchdog_s and self._ready_sent and now - self._last_watchdog >= self._watchdog_s
                and now - accept_tick < max(5.0, self._watchdog_s)):
            self._last_watchdog = now
            notify("WATCHDOG=1")  # both loops turn: the accept loop ticked, and this one got the lock
        view, workers = self.snapshot()
        due = []
        with self._lock:
            for replica in view.replicas:
                measured = self.measured.setdefault(replica.rid, Measured())
                # A kept lease (Pool.predict) tells the pool of its requests only now and then: its worker's
                # counts are asked for every few seconds instead, between its requests.
                kept = replica.kept
                if ((replica.state is ReplicaState.READY and replica.served != measured.stats_served
                     and now - measured.stats_at >= STATS_INTERVAL_S)
                        or (kept and now - measured.stats_at >= KEPT_STATS_INTERVAL_S)) \
                        and not measured.collecting and replica.rid in workers:
                    measured.collecting = True
                    due.append((workers[replica.rid], replica.served))
        for worker, served in due:
            threading.Thread(target=self.collect_stats, args=(worker, STATS_TIMEOUT_S, served),
                             name=f"stats-{worker.rid}", daemon=True).start()

    def _loop(self) -> None:
        # NVML (its binding and its library) is loaded now, not under the first worker: the pool's
        # memory is then flat from the start (the soak test holds it to < 2 MB over 10,000 requests).
        process_usage(self.fake_nvml)
        last_prune = -PRUNE_INTERVAL_S
        while not self.finished.is_set():
            try:
                self._sample_gpu()
                if self._prune_due and time.monotonic() - last_prune >= PRUNE_INTERVAL_S:
                    last_prune = time.monotonic()
                    self._prune()
            except Exception:  # one bad pass must not end measuring for good; logged with its traceback
                log.exception("observing pass failed")
            self.finished.wait(GPU_SAMPLE_S)

    # -- a worker's own counts and its memory ------------------------------------------------------
    def collect_stats(self, worker: Worker, timeout: float = STATS_TIMEOUT_S, served: int | None = None) -> None:
        """Fold the worker's own counts into the metrics (it answers between requests)."""
        pid = worker.process.pid
        # Never behind a request in flight: the worker answers one at a time, and a kept lease's caller waits.
        asked = pid and worker.process.returncode is None and worker.process.in_flight_s() is None
        answer = worker.process.stats(timeout=timeout) if asked else None
        with self._lock:
            measured = self.measured.setdefault(worker.rid, Measured())
            measured.collecting = False
            measured.stats_at = time.monotonic()
            if answer is not None and served is not None:
                measured.stats_served = served
        if answer is not None and pid:
            self.metrics.book.record(worker.loaded.slug, worker.index, pid, answer)

    def _sample_gpu(self) -> None:
        view, workers = self.snapshot()
        targets = [(replica, workers[replica.rid]) for replica in view.replicas
                   if replica.rid in workers and replica.pid and _measurable(workers[replica.rid].process)
                   and replica.state not in (ReplicaState.STOPPING, ReplicaState.STOPPED)]
        if not targets:
            return
        usage, _ = process_usage(self.fake_nvml)
        if usage is None:
            return
        for replica, worker in targets:
            if replica.pid is not None:  # those without one were left out above
                self._gpu_reading(replica, worker, group_usage(usage, replica.pid) / GIB)

    def _gpu_reading(self, replica: ReplicaView, worker: Worker, used_gb: float) -> None:
        """Record one reading: flag and act on a worker over its budget; remember a new peak."""
        budget = replica.budget_gb
        policy = worker.loaded.manifest.gpu.over_budget
        with self._lock:
            measured = self.measured.setdefault(replica.rid, Measured())
            measured.gpu_used_gb = round(used_gb, 3)
            rose = used_gb > 0 and (measured.gpu_peak_gb is None or used_gb > measured.gpu_peak_gb)
            if rose or measured.gpu_peak_gb is None:
                measured.gpu_peak_gb = round(used_gb, 3)
            first = budget is not None and used_gb > budget and measured.over_budget is None
            if first:
                measured.over_budget = (f"{replica.name} is over its budget: measured "
                                        f"{used_gb:.2f} GB of GPU memory, vram_budget_gb = {budget:g}")
            over = measured.over_budget
        if first:
            action = ("it is stopped once its current lease ends" if policy == "stop"
                      else 'it keeps running (over_budget = "warn")')
            log.warning("%s; %s", over, action)
            worker.process.note(f"{over}; {action}")
            self.events.emit("worker.over-budget", replica.slug, replica.index, used_gb=round(used_gb, 3),
                             budget_gb=budget, policy=policy)
        if over and policy == "stop" and replica.retiring is None:
            self.retire(replica.rid, StopCause.OVER_BUDGET, f'{over} (over_budget = "stop")')
        if rose:
            self.peaks.observe(replica.slug, replica.version, used_gb, budget)

    def _prune(self) -> None:
        _state, workers = self.snapshot()
        with self._lock:
            due, self._prune_due = self._prune_due, set()
        live = {Path(w.process.transcript_path) for w in workers.values() if w.process.transcript_path}
        for slug in sorted(due):
            prune_transcripts(self.paths.log_dir(), slug, self.transcripts_keep, self.transcripts_max_bytes, live)

    # -- hooks the runtime calls ---------------------------------------------------------------------
    def on_admission(self, slug: str, priority: str, waited_s: float) -> None:
        self.metrics.admission_wait.labels(slug, priority).observe(waited_s)

    def on_lease(self, priority: str, waited_s: float) -> None:
        self.metrics.lease_wait.labels(priority).observe(waited_s)

    def on_started(self, worker: Worker, start_s: float) -> None:
        slug = worker.loaded.slug
        self.metrics.cold_starts.labels(slug).inc()
        self.metrics.start_seconds.labels(slug).observe(start_s)
        self.events.emit("worker.started", slug, worker.index, pid=worker.pid, device=worker.process.device,
                         budget_gb=worker.budget_gb, version=worker.loaded.version, start_s=round(start_s, 3))

    def on_start_failed(self, worker: Worker, error: ResidentPoolError) -> None:
        """Count and tell the failed start; a start that opened the breaker is also ``breaker.open``, once.

        Runs before the waiting client hears the error, so the error carries that event's id and time: a Prefect
        task that saw it emits the same event (a Prefect server keeps one event per id), related to its run,
        and the relay's copy of the line, or the task's, whichever arrives second, is not a second opening.
        """
        slug = worker.loaded.slug
        reason = error.reason if SLUG.fullmatch(error.reason or "") else "other"
        self.metrics.start_failures.labels(slug, reason).inc()
        rc = error.exit_code
        exit_words = None if rc is None else describe_exit(rc)
        self.events.emit("worker.start-failed", slug, worker.index, reason=error.reason, exit_code=rc,
                         exit=exit_words, error=error.headline, transcript=error.transcript)
        if error.details.get("breaker_opened"):
            # The provider's, not a replica's: replica None makes the relay name the provider as its resource.
            record = self.events.emit("breaker.open", slug, None, reason=error.reason, exit_code=rc, exit=exit_words,
                                      error=error.headline, transcript=error.transcript)
            error.details["breaker_event"] = {"id": record["id"], "occurred": record["occurred"]}

    def on_evicted(self, slug: str) -> None:
        self.metrics.evictions.labels(slug).inc()

    def on_gone(self, worker: Worker, cause: StopCause | None, why: str | None, served: int) -> None:
        """The worker ended (``cause`` None: its start failed)."""
        slug = worker.loaded.slug
        with self._lock:
            measured = self.measured.pop(worker.rid, Measured())
            self._prune_due.add(slug)  # its transcript is closed now, and may go
        if cause is None:
            return
        self.metrics.stops.labels(slug, cause.value).inc()
        rc = worker.process.returncode
        self.events.emit("worker.stopped", slug, worker.index, cause=cause.value, why=why, pid=worker.pid,
                         exit=None if rc is None else describe_exit(rc), served=served,
                         gpu_peak_gb=measured.gpu_peak_gb)
        advice = budget_advice(worker.budget_gb, self.peaks.get(slug, worker.loaded.version))
        if advice and slug not in self._advised:
            self._advised.add(slug)
            log.warning("%s: %s", slug, advice)

    # -- what is read from outside ------------------------------------------------------------------
    def metrics_snapshot(self) -> dict[str, Any]:
        """The pool's records as the metrics collector reads them at scrape time."""
        view, _ = self.snapshot()
        waiting_gpu: dict[str, int] = {}
        for entry in view.gpu_line:
            waiting_gpu[entry.key] = waiting_gpu.get(entry.key, 0) + 1
        providers: dict[str, dict[str, Any]] = {}
        rows = []
        live_states = [s.value for s in ReplicaState if s not in (ReplicaState.STOPPED, ReplicaState.FAILED)]
        for key, provider in view.providers.items():
            providers[key] = {"waiting_replica": len(provider.waiting), "waiting_gpu": waiting_gpu.get(key, 0),
                              "breaker_open": bool(provider.breaker and provider.breaker["open"]),
                              "states": dict.fromkeys(live_states, 0),
                              "peak_gb": self.peaks.get(provider.slug, provider.version)}
        with self._lock:
            measured = {rid: (m.gpu_used_gb, m.gpu_peak_gb, m.over_budget) for rid, m in self.measured.items()}
        for replica in view.replicas:
            states = providers[replica.key]["states"]
            states[replica.state.value] = states.get(replica.state.value, 0) + 1
            used, peak, over = measured.get(replica.rid, (None, None, None))
            rows.append({"slug": replica.key, "replica": replica.index, "idle_s": replica.idle_s,
                         "budget_gb": replica.budget_gb, "gpu_used_gb": used, "gpu_peak_gb": peak,
                         "over_budget": over is not None,
                         "in_flight_s": replica.in_flight_s})
        return {"version": __version__, "providers": providers, "workers": rows}

    def measured_of(self, rid: int) -> Measured:
        with self._lock:
            return self.measured.get(rid, Measured())

    def describe(self) -> dict[str, Any]:
        return {"metrics": f"http://127.0.0.1:{self.metrics_port}/metrics" if self._http else None,
                "metrics_error": self.metrics_error, "events": str(self.events.path)}


def _measurable(process: WorkerProcess) -> bool:
    """Its GPU memory can be read from its process group: not a docker or podman container (outside our tree)."""
    return process.launch is not None and process.launch.stop is None and process.returncode is None
