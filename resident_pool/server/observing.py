"""The pool's observing half: metrics, lifecycle events, measured GPU memory, log retention, richer status.

Mixed into ``PoolServer``, whose lock and records (``providers``, ``admission``) it reads;
it changes a replica only through the pool's own ``_retire`` (the over-budget ``stop``
policy) and writes nothing else of the pool's but each replica's ``measured`` record.
The pool calls the ``_on_*`` hooks where a worker starts, fails to start or ends, and
``_observe_tick`` from its maintenance loop; GPU sampling and pruning run on a thread of
their own (an NVML call that hangs in the driver must not stop heartbeats).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

from ..errors import ResidentPoolError
from ..exits import describe_exit
from ..host import paths
from ..ops.events import EVENTS_FILE, EventLog, stop_cause
from ..ops.gpu_memory import GIB, Peaks, budget_advice, group_usage, process_usage
from ..ops.metrics import PoolMetrics, serve_http
from ..ops.retention import prune_transcripts, transcript_slugs
from ..ops.systemd import notify, watchdog_interval_s
from ..providers.manifest import SLUG, Manifest, load_manifest
from ..providers.worker_process import WorkerProcess
from ..settings import Settings, xdg_dir
from ..version import __version__
from .replica import Replica
from .states import ReplicaState

__all__ = ["GPU_SAMPLE_S", "STATS_INTERVAL_S", "PoolObserving"]

log = logging.getLogger("resident_pool.pool")

# A worker's counts are collected at most this often after releases, never on the release path
# (a held session's round trip must stay within 3x a raw socket echo); GPU memory is sampled
# this often; a provider's transcripts are pruned at most this often after its workers stop
# (a subprocess-mode provider starts one per request, and pruning reads /proc).
STATS_INTERVAL_S = 1.0
STATS_TIMEOUT_S = 2.0
GPU_SAMPLE_S = 2.0
PRUNE_INTERVAL_S = 5.0


class PoolObserving:
    """Mixed into PoolServer: everything an operator reads from outside the pool."""

    def _observe_init(self, config: Settings) -> None:
        self.metrics = PoolMetrics(self.metrics_snapshot)
        self.events = EventLog(paths.log_dir() / EVENTS_FILE)
        self.peaks = Peaks((config.cache_dir or xdg_dir("cache") / "resident-pool") / "gpu-peaks.json")
        self.fake_nvml = config.fake_nvml
        self.metrics_port = config.metrics_port
        self.transcripts_keep = config.transcripts_keep
        self.transcripts_max_bytes = int(config.transcripts_max_mb * 2**20)
        self._http: Any = None
        self.metrics_error: str | None = None
        self._accept_tick = time.monotonic()
        self._watchdog_s = watchdog_interval_s()
        self._last_watchdog = 0.0
        self._ready_sent = False  # systemd hears WATCHDOG=1 only after READY=1
        self._prune_due: set[str] = set()
        self._advised: set[str] = set()

    def _observe_start(self) -> None:
        if self.metrics_port:
            try:
                self._http = serve_http(self.metrics_port, self.metrics.registry)
                log.info("metrics on http://127.0.0.1:%d/metrics", self.metrics_port)
            except ResidentPoolError as exc:  # a port someone else holds: said in the log and in status
                self.metrics_error = str(exc)
                log.error("%s", exc)
        self._prune_due |= transcript_slugs(paths.log_dir())
        self.events.emit("pool.started", version=__version__, manifests=str(self.manifests))
        threading.Thread(target=self._observe_loop, name="observe", daemon=True).start()
        notify(f"READY=1\nMAINPID={os.getpid()}\nSTATUS=serving {self.socket_path}")
        self._ready_sent = True

    def _observe_stop(self) -> None:
        notify("STOPPING=1")
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
        self.events.emit("pool.stopped")

    def _observe_tick(self, now: float) -> None:
        """From the maintenance loop: the watchdog, and the workers' counts due after releases."""
        if (self._watchdog_s and self._ready_sent and now - self._last_watchdog >= self._watchdog_s
                and now - self._accept_tick < max(5.0, self._watchdog_s)):
            self._last_watchdog = now
            notify("WATCHDOG=1")  # both loops turn: the accept loop ticked, and this one got the lock
        due = []
        with self.lock:
            for provider in self.providers.values():
                for replica in provider.replicas.values():
                    measured = replica.measured
                    if (replica.state is ReplicaState.READY and not measured.collecting
                            and replica.served != measured.stats_served
                            and now - measured.stats_at >= STATS_INTERVAL_S):
                        measured.collecting = True
                        due.append(replica)
        for replica in due:
            threading.Thread(target=self._collect_stats, args=(replica,), name=f"stats-{replica.name}",
                             daemon=True).start()

    def _observe_loop(self) -> None:
        """Its own thread: an NVML call that hangs in the driver must not stop heartbeats or retirement."""
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

    def _collect_stats(self, replica: Replica, timeout: float = STATS_TIMEOUT_S) -> None:
        """Fold the worker's own counts into the metrics (it answers between requests)."""
        served, pid = replica.served, replica.pid
        answer = replica.process.stats(timeout=timeout) if pid and replica.process.returncode is None else None
        with self.lock:
            measured = replica.measured
            measured.collecting = False
            measured.stats_at = time.monotonic()
            if answer is not None:
                measured.stats_served = served
        if answer is not None and pid:
            self.metrics.book.record(replica.slug, replica.index, pid, answer)

    def _sample_gpu(self) -> None:
        with self.lock:
            targets = [(provider, replica, replica.pid) for provider in self.providers.values()
                       for replica in provider.replicas.values()
                       if replica.live and replica.pid and _measurable(replica.process)]
        if not targets:
            return
        usage, _ = process_usage(self.fake_nvml)
        if usage is None:
            return
        readings = [(provider, replica, group_usage(usage, pid) / GIB) for provider, replica, pid in targets]
        peaks = []
        with self.lock:
            for provider, replica, used_gb in readings:
                if replica.live and self._gpu_reading(provider, replica, used_gb):
                    peaks.append((replica.slug, replica.version, used_gb, replica.vram_budget_gb))
        for peak in peaks:
            self.peaks.observe(*peak)

    def _gpu_reading(self, provider: Any, replica: Replica, used_gb: float) -> bool:
        """Record one reading (the lock is held): flag and act on a worker over its budget; True on a new peak."""
        measured = replica.measured
        measured.gpu_used_gb = round(used_gb, 3)
        rose = used_gb > 0 and (measured.gpu_peak_gb is None or used_gb > measured.gpu_peak_gb)
        if rose or measured.gpu_peak_gb is None:
            measured.gpu_peak_gb = round(used_gb, 3)
        budget = replica.vram_budget_gb
        policy = replica.manifest.gpu.over_budget if replica.manifest is not None else "warn"
        if budget is not None and used_gb > budget and measured.over_budget is None:
            measured.over_budget = (f"{replica.name} is over its budget: measured {used_gb:.2f} GB of GPU memory, "
                                    f"vram_budget_gb = {budget:g}")
            action = ("it is stopped once its current lease ends" if policy == "stop"
                      else 'it keeps running (over_budget = "warn")')
            log.warning("%s; %s", measured.over_budget, action)
            replica.process.note(f"{measured.over_budget}; {action}")
            self.events.emit("worker.over-budget", replica.slug, replica.index, used_gb=round(used_gb, 3),
                             budget_gb=budget, policy=policy)
        if measured.over_budget and policy == "stop" and replica.retire is None:
            self._retire(provider, replica, f'{measured.over_budget} (over_budget = "stop")')
        return rose

    def _prune(self) -> None:
        with self.lock:
            due, self._prune_due = self._prune_due, set()
            live = {Path(r.process.transcript_path) for p in self.providers.values() for r in p.replicas.values()
                    if r.process.transcript_path and r.state not in (ReplicaState.STOPPED, ReplicaState.FAILED)}
        for slug in sorted(due):
            prune_transcripts(paths.log_dir(), slug, self.transcripts_keep, self.transcripts_max_bytes, live)

    def _on_admission(self, provider: Any, admitter: Any, waited_s: float) -> None:
        if admitter is self.admission:
            self.metrics.admission_wait.labels(provider.slug).observe(waited_s)

    def _on_started(self, provider: Any, replica: Replica, start_s: float) -> None:
        self.metrics.cold_starts.labels(provider.slug).inc()
        self.metrics.start_seconds.labels(provider.slug).observe(start_s)
        self.events.emit("worker.started", provider.slug, replica.index, pid=replica.pid, device=replica.process.device,
                         budget_gb=replica.vram_budget_gb, version=replica.version, start_s=round(start_s, 3))

    def _on_start_failed(self, provider: Any, replica: Replica, error: ResidentPoolError, opened: bool) -> None:
        reason = error.reason if SLUG.fullmatch(error.reason or "") else "other"
        self.metrics.start_failures.labels(provider.slug, reason).inc()
        rc = error.exit_code
        self.events.emit("worker.start-failed", provider.slug, replica.index, reason=error.reason, exit_code=rc,
                         exit=None if rc is None else describe_exit(rc), breaker_opened=opened, error=error.headline,
                         transcript=error.transcript)

    def _on_stopped(self, provider: Any, replica: Replica) -> None:
        with self.lock:
            self._prune_due.add(provider.slug)  # its transcript is closed now, and may go
        cause = stop_cause(replica.stop_why)
        self.metrics.stops.labels(provider.slug, cause).inc()
        rc = replica.process.returncode
        self.events.emit("worker.stopped", provider.slug, replica.index, cause=cause, why=replica.stop_why,
                         pid=replica.pid, exit=None if rc is None else describe_exit(rc), served=replica.served,
                         gpu_peak_gb=replica.measured.gpu_peak_gb)
        advice = budget_advice(replica.vram_budget_gb, self.peaks.get(provider.slug, replica.version))
        if advice and provider.slug not in self._advised:
            self._advised.add(provider.slug)
            log.warning("%s: %s", provider.slug, advice)

    def metrics_snapshot(self) -> dict[str, Any]:
        """The pool's records as the metrics collector reads them at scrape time."""
        waiting_gpu: dict[str, int] = {}
        for ticket in self.admission.waiting():
            waiting_gpu[ticket["slug"]] = waiting_gpu.get(ticket["slug"], 0) + 1
        providers, workers = {}, []
        with self.lock:
            for slug, provider in self.providers.items():
                states = dict.fromkeys((s.value for s in ReplicaState if s not in (ReplicaState.STOPPED,
                                                                                   ReplicaState.FAILED)), 0)
                for replica in provider.replicas.values():
                    states[replica.state.value] = states.get(replica.state.value, 0) + 1
                    workers.append({"slug": slug, "replica": replica.index, "idle_s": round(replica.idle_s(), 1),
                                    "budget_gb": replica.vram_budget_gb, "gpu_used_gb": replica.measured.gpu_used_gb,
                                    "gpu_peak_gb": replica.measured.gpu_peak_gb,
                                    "over_budget": replica.measured.over_budget is not None,
                                    "process": replica.process if replica.state is ReplicaState.LEASED else None})
                providers[slug] = {"waiting_replica": len(provider.queue), "waiting_gpu": waiting_gpu.get(slug, 0),
                                   "breaker_open": provider.breaker.remaining_s() > 0, "states": states,
                                   "peak_gb": self.peaks.get(slug, provider.version)}
        for worker in workers:
            process = worker.pop("process")
            worker["in_flight_s"] = process.in_flight_s() if process is not None else None
        return {"version": __version__, "providers": providers, "workers": workers}

    def _observe_status(self, state: dict[str, Any]) -> dict[str, Any]:
        """What an operator acts on, beside the records: fingerprints, request ages, measured memory, known
        providers not running, budget advice."""
        with self.lock:
            replicas = {(slug, r.index): r for slug, p in self.providers.items() for r in p.replicas.values()}
            facts = {slug: (p.manifest, p.fingerprint, p.version, sum(r.live for r in p.replicas.values()))
                     for slug, p in self.providers.items()}
        for worker in state["workers"]:
            replica = replicas.get((worker["slug"], worker["replica"]))
            measured = replica.measured if replica is not None else None
            worker["fingerprint"] = replica.manifest.fingerprint() if replica and replica.manifest else None
            in_flight = replica.process.in_flight_s() if replica and worker["state"] in ("leased", "draining") else None
            worker["in_flight_s"] = None if in_flight is None else round(in_flight, 1)
            worker["gpu_used_gb"] = measured.gpu_used_gb if measured else None
            worker["gpu_peak_gb"] = measured.gpu_peak_gb if measured else None
            worker["over_budget"] = measured.over_budget if measured else None
            worker["kept_warm"] = bool(replica) and self._kept_warm(self.providers[worker["slug"]], replica)
        for slug, (manifest, fingerprint, version, running) in facts.items():
            entry = state["providers"].setdefault(slug, {})
            peak = self.peaks.get(slug, version)
            entry.update(_provider_facts(manifest, fingerprint), running=running, measured_peak_gb=peak,
                         budget_advice=budget_advice(manifest.gpu.vram_budget_gb if manifest.gpu.policy != "none"
                                                     else None, peak))
        for path in sorted(self.manifests.glob("*/manifest.toml")):
            slug = path.parent.name
            if slug in state["providers"]:
                continue
            try:
                manifest = load_manifest(path)
            except ResidentPoolError as exc:
                state["providers"][slug] = {"manifest": str(path), "running": 0, "last_error": exc.headline,
                                            "breaker": None}
                continue
            try:
                peak = self.peaks.get(slug, manifest.version())
            except ResidentPoolError:
                peak = None
            facts = _provider_facts(manifest, manifest.fingerprint())
            state["providers"][slug] = {"manifest": str(path), "running": 0, "last_error": None, "breaker": None,
                                        "measured_peak_gb": peak,
                                        "budget_advice": budget_advice(facts["budget_gb"], peak), **facts}
        state["pool"]["metrics"] = f"http://127.0.0.1:{self.metrics_port}/metrics" if self._http else None
        state["pool"]["metrics_error"] = self.metrics_error
        state["pool"]["events"] = str(self.events.path)
        return state



def _measurable(process: WorkerProcess) -> bool:
    """Its GPU memory can be read from its process group: not a docker or podman container (outside our tree)."""
    return process.launch is not None and process.launch.stop is None and process.returncode is None


def _provider_facts(manifest: Manifest, fingerprint: str) -> dict[str, Any]:
    gpu = manifest.gpu
    return {"fingerprint": fingerprint, "budget_gb": gpu.vram_budget_gb if gpu.policy != "none" else None,
            "over_budget": gpu.over_budget, "min_replicas": manifest.lifecycle.min_replicas,
            "max_replicas": manifest.lifecycle.max_replicas, "mode": manifest.mode}
