"""Prometheus metrics of the pool: what it decided (starts, waits, evictions) and what its workers counted.

Requests never pass through the pool, so the workers count them (``worker_base``'s ``stats``
op) and the pool folds each worker's counts in here between requests; a worker that ends
leaves its counts behind, so every counter only grows. Everything else is read from the
pool's own records at scrape time (``snapshot``).

Labels carry slugs, replica numbers and reason words only, never paths or run names:
the HTTP endpoint (loopback, off by default) can be read by any local user.
"""

from __future__ import annotations

import errno
import logging
import math
import os
import re
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from ..errors import ResidentPoolError
from ..host.listeners import listeners, socket_pids, user_name
from ..worker_base import BATCH_SIZE_BUCKETS, LATENCY_BUCKETS_S

__all__ = ["METRIC_NAMES", "PoolMetrics", "StatsBook", "WorkerCounts", "no_pool_text", "port_holder", "serve_http"]

log = logging.getLogger("resident_pool.metrics")

# Starts: an echo's tenth of a second to a large model's quarter hour.
START_BUCKETS_S = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 900.0)
# Admission waits: none at all, up to the default admission_timeout_s of an hour.
WAIT_BUCKETS_S = (0.01, 0.1, 0.5, 1.0, 5.0, 15.0, 60.0, 300.0, 900.0, 1800.0, 3600.0)
UP_HELP = "1 when the pool answered (`resident-pool metrics` prints 0 when none runs)"
_REASON = re.compile(r"[a-z][a-z0-9_]{0,39}")
_MAX_REASONS = 16
MAX_COUNT = 2**53  # the largest integer below which every integer is a float; a worker's count at or over it is a lie
GIB = 1024**3

# Every family the pool exports (histograms add _bucket, _sum and _count; counters _total).
METRIC_NAMES = {
    "resident_pool_up": "gauge",
    "resident_pool_info": "gauge",
    "resident_pool_requests": "counter",
    "resident_pool_request_failures": "counter",
    "resident_pool_request_duration_seconds": "histogram",
    "resident_pool_queue_depth": "gauge",
    "resident_pool_admission_wait_seconds": "histogram",
    "resident_pool_lease_wait_seconds": "histogram",
    "resident_pool_cold_starts": "counter",
    "resident_pool_start_failures": "counter",
    "resident_pool_start_duration_seconds": "histogram",
    "resident_pool_evictions": "counter",
    "resident_pool_worker_stops": "counter",
    "resident_pool_breaker_open": "gauge",
    "resident_pool_replicas": "gauge",
    "resident_pool_idle_seconds": "gauge",
    "resident_pool_request_in_flight_seconds": "gauge",
    "resident_pool_gpu_budget_bytes": "gauge",
    "resident_pool_gpu_used_bytes": "gauge",
    "resident_pool_gpu_peak_bytes": "gauge",
    "resident_pool_gpu_over_budget": "gauge",
    "resident_pool_provider_gpu_peak_bytes": "gauge",
    "resident_pool_batch_size": "histogram",
    "resident_pool_queue_wait_seconds": "histogram",
}


@dataclass
class WorkerCounts:
    """One worker's (or several ended workers') request counts, as the ``stats`` op answers them."""

    requests: int = 0
    failures: dict[str, int] = field(default_factory=dict)
    buckets: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS_S) + 1))
    sum_s: float = 0.0
    # A batching worker's: the sizes of its model calls (and the items they took), and its requests' queue waits.
    batch_sizes: list[int] = field(default_factory=lambda: [0] * (len(BATCH_SIZE_BUCKETS) + 1))
    batch_items: int = 0
    waits: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS_S) + 1))
    waits_s: float = 0.0

    @property
    def batching(self) -> bool:
        return any(self.batch_sizes)

    def plus(self, other: WorkerCounts) -> WorkerCounts:
        failures = dict(self.failures)
        for reason, n in other.failures.items():
            failures[reason] = failures.get(reason, 0) + n

        def add(mine: list[int], theirs: list[int]) -> list[int]:
            return [a + b for a, b in zip(mine, theirs, strict=True)]

        return WorkerCounts(self.requests + other.requests, failures, add(self.buckets, other.buckets),
                            self.sum_s + other.sum_s, add(self.batch_sizes, other.batch_sizes),
                            self.batch_items + other.batch_items, add(self.waits, other.waits),
                            self.waits_s + other.waits_s)

    @classmethod
    def parse(cls, answer: dict[str, Any]) -> WorkerCounts | None:
        """A worker's answer checked field by field; None for one that is not ours (a hostile or broken worker)."""
        try:
            requests = answer["requests"]
            latency = answer["latency"]
            counts, bounds, total = latency["counts"], latency["bounds_s"], latency["sum_s"]
            failures = answer.get("failures") or {}
            if (not _count(requests) or list(bounds) != list(LATENCY_BUCKETS_S)
                    or len(counts) != len(LATENCY_BUCKETS_S) + 1 or not all(_count(c) for c in counts)
                    or not _seconds(total) or not isinstance(failures, dict) or len(failures) > _MAX_REASONS):
                return None
            kept = {}
            for reason, n in failures.items():
                if not _count(n):
                    return None
                kept[reason if isinstance(reason, str) and _REASON.fullmatch(reason) else "other"] = n
        except (KeyError, TypeError):
            return None
        found = cls(requests, kept, list(counts), float(total))
        return found if "batches" not in answer or found._batching(answer) else None

    def _batching(self, answer: dict[str, Any]) -> bool:
        """A batching worker's histograms, checked as the rest; False for ones that are not ours."""
        try:
            batches, waits = answer["batches"], answer["queue_wait"]
            sizes, wait_counts = batches["size"]["counts"], waits["counts"]
            if (list(batches["size"]["bounds"]) != list(BATCH_SIZE_BUCKETS)
                    or len(sizes) != len(BATCH_SIZE_BUCKETS) + 1 or not all(_count(c) for c in sizes)
                    or not _count(batches["items"]) or list(waits["bounds_s"]) != list(LATENCY_BUCKETS_S)
                    or len(wait_counts) != len(LATENCY_BUCKETS_S) + 1 or not all(_count(c) for c in wait_counts)
                    or not _seconds(waits["sum_s"])):
                return False
        except (KeyError, TypeError):
            return False
        self.batch_sizes, self.batch_items = list(sizes), batches["items"]
        self.waits, self.waits_s = list(wait_counts), float(waits["sum_s"])
        return True


def _count(value: Any) -> bool:
    """A count a float holds exactly: the text format writes every sample as a float, and one past 1e308
    raised OverflowError in every later scrape (resident_pool_up included) until the pool restarted."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < MAX_COUNT


def _seconds(value: Any) -> bool:
    """A sum of durations: finite and not negative (NaN or infinity would poison every sum it joins)."""
    return (isinstance(value, int | float) and not isinstance(value, bool) and 0 <= value < MAX_COUNT
            and math.isfinite(value))


class StatsBook:
    """Per (provider, replica number): the counts of its ended workers plus the live one's latest."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.ended: dict[tuple[str, int], WorkerCounts] = {}
        self.live: dict[tuple[str, int], tuple[int, WorkerCounts]] = {}
        self.pool_failures: dict[tuple[str, int, str], int] = {}

    def record(self, slug: str, replica: int, pid: int, answer: dict[str, Any]) -> bool:
        """Take a worker's ``stats`` answer; False when it is malformed (and ignored)."""
        counts = WorkerCounts.parse(answer)
        if counts is None:
            log.warning("%s[%d] (pid %d) answered stats the pool cannot read; ignored", slug, replica, pid)
            return False
        key = (slug, replica)
        with self.lock:
            previous = self.live.get(key)
            if previous is not None and previous[0] != pid:  # a new process under this number: bank the old one
                self.ended[key] = self.ended.get(key, WorkerCounts()).plus(previous[1])
            elif previous is not None and counts.requests < previous[1].requests:
                return False  # a late answer overtaken by a newer one
            self.live[key] = (pid, counts)
        return True

    def failed(self, slug: str, replica: int, reason: str) -> None:
        """A failure only the pool sees: the request ended the worker (worker_died, worker_exiting, timeout)."""
        with self.lock:
            key = (slug, replica, reason)
            self.pool_failures[key] = self.pool_failures.get(key, 0) + 1

    def totals(self) -> tuple[dict[tuple[str, int], WorkerCounts], dict[tuple[str, int, str], int]]:
        with self.lock:
            keys = set(self.ended) | set(self.live)
            totals = {key: self.ended.get(key, WorkerCounts()).plus(self.live[key][1] if key in self.live
                                                                     else WorkerCounts()) for key in keys}
            return totals, dict(self.pool_failures)


class PoolMetrics:
    """The pool's registry: its own counters and histograms, and a collector reading its records at scrape time."""

    def __init__(self, snapshot: Callable[[], dict[str, Any]]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.book = StatsBook()
        r = self.registry
        self.cold_starts = Counter("resident_pool_cold_starts", "Workers started (each start pays the model load)",
                                   ["provider"], registry=r)
        self.start_failures = Counter("resident_pool_start_failures", "Worker starts that failed, by reason",
                                      ["provider", "reason"], registry=r)
        self.start_seconds = Histogram("resident_pool_start_duration_seconds", "Spawn to first answer of a worker",
                                       ["provider"], buckets=START_BUCKETS_S, registry=r)
        self.admission_wait = Histogram("resident_pool_admission_wait_seconds",
                                        "How long a start waited for GPU memory, by the class of its request",
                                        ["provider", "priority"], buckets=WAIT_BUCKETS_S, registry=r)
        self.lease_wait = Histogram("resident_pool_lease_wait_seconds",
                                    "How long a request waited for its worker (a free replica, a start, GPU memory), "
                                    "by class", ["priority"], buckets=WAIT_BUCKETS_S, registry=r)
        self.evictions = Counter("resident_pool_evictions", "Idle workers stopped to make room on a GPU",
                                 ["provider"], registry=r)
        self.stops = Counter("resident_pool_worker_stops", "Workers that ended, by cause (idle, evicted, drained, "
                             "died, ...)", ["provider", "cause"], registry=r)
        r.register(_Records(self.book, snapshot))

    def render(self) -> str:
        """The text exposition format (for `resident-pool metrics` and a node-exporter textfile collector)."""
        return generate_latest(self.registry).decode()


class _Records(Collector):
    """Families built at scrape time from the worker counts and the pool's snapshot."""

    def __init__(self, book: StatsBook, snapshot: Callable[[], dict[str, Any]]) -> None:
        self.book = book
        self.snapshot = snapshot

    def describe(self) -> list[Metric]:
        return []  # built per scrape; nothing to check against the registry's names up front

    def collect(self) -> Iterator[Metric]:
        state = self.snapshot()
        yield from _worker_families(*self.book.totals())
        yield GaugeMetricFamily("resident_pool_up", UP_HELP, value=1)
        info = GaugeMetricFamily("resident_pool_info", "The pool process: its version", labels=["version"])
        info.add_metric([state["version"]], 1)
        yield info
        queue = GaugeMetricFamily("resident_pool_queue_depth", "Requests waiting: for a free replica, or for GPU "
                                  "memory", labels=["provider", "waiting_for"])
        breaker = GaugeMetricFamily("resident_pool_breaker_open", "1 while the provider's start breaker refuses "
                                    "requests", labels=["provider"])
        replicas = GaugeMetricFamily("resident_pool_replicas", "Workers by state", labels=["provider", "state"])
        peak = GaugeMetricFamily("resident_pool_provider_gpu_peak_bytes", "The provider's highest measured GPU "
                                 "memory (kept across pool restarts)", labels=["provider"])
        for slug, provider in state["providers"].items():
            queue.add_metric([slug, "replica"], provider["waiting_replica"])
            queue.add_metric([slug, "gpu"], provider["waiting_gpu"])
            breaker.add_metric([slug], 1 if provider["breaker_open"] else 0)
            for name, n in provider["states"].items():
                replicas.add_metric([slug, name], n)
            if provider["peak_gb"] is not None:
                peak.add_metric([slug], provider["peak_gb"] * GIB)
        yield from (queue, breaker, replicas, peak)
        labels = ["provider", "replica"]
        idle = GaugeMetricFamily("resident_pool_idle_seconds", "Seconds since the worker's last lease ended "
                                 "(0 while leased)", labels=labels)
        in_flight = GaugeMetricFamily("resident_pool_request_in_flight_seconds", "Age of the request the worker "
                                      "is running (0 when none)", labels=labels)
        budget = GaugeMetricFamily("resident_pool_gpu_budget_bytes", "Declared vram_budget_gb", labels=labels)
        used = GaugeMetricFamily("resident_pool_gpu_used_bytes", "Measured GPU memory of the worker's process "
                                 "group (NVML)", labels=labels)
        worker_peak = GaugeMetricFamily("resident_pool_gpu_peak_bytes", "Highest measured GPU memory of this "
                                        "worker", labels=labels)
        over = GaugeMetricFamily("resident_pool_gpu_over_budget", "1 when measured memory went above the budget",
                                 labels=labels)
        for worker in state["workers"]:
            key = [worker["slug"], str(worker["replica"])]
            idle.add_metric(key, worker["idle_s"])
            in_flight.add_metric(key, worker["in_flight_s"] or 0.0)
            if worker["budget_gb"] is not None:
                budget.add_metric(key, worker["budget_gb"] * GIB)
                over.add_metric(key, 1 if worker["over_budget"] else 0)
            if worker["gpu_used_gb"] is not None:
                used.add_metric(key, worker["gpu_used_gb"] * GIB)
                worker_peak.add_metric(key, worker["gpu_peak_gb"] * GIB)
        yield from (idle, in_flight, budget, used, worker_peak, over)


def _worker_families(totals: dict[tuple[str, int], WorkerCounts],
                     pool_failures: dict[tuple[str, int, str], int]) -> Iterator[Metric]:
    labels = ["provider", "replica"]
    requests = CounterMetricFamily("resident_pool_requests", "Requests a worker answered (ok or failed)",
                                   labels=labels)
    failures = CounterMetricFamily("resident_pool_request_failures", "Failed requests by reason: request_failed "
                                   "(the model raised), worker_died, worker_exiting, timeout", labels=[*labels,
                                                                                                     "reason"])
    latency = HistogramMetricFamily("resident_pool_request_duration_seconds", "Request time inside the worker",
                                    labels=labels)
    sizes = HistogramMetricFamily("resident_pool_batch_size", "Requests per model call of a batching worker",
                                  labels=labels)
    waits = HistogramMetricFamily("resident_pool_queue_wait_seconds", "How long a batching worker's requests "
                                  "waited in its queue for their model call", labels=labels)
    bounds = [*(f"{b:g}" for b in LATENCY_BUCKETS_S), "+Inf"]
    size_bounds = [*(f"{b:g}" for b in BATCH_SIZE_BUCKETS), "+Inf"]
    merged: dict[tuple[str, int, str], int] = dict(pool_failures)
    for (slug, replica), counts in sorted(totals.items()):
        key = [slug, str(replica)]
        requests.add_metric(key, counts.requests)
        latency.add_metric(key, _cumulative(bounds, counts.buckets), counts.sum_s)
        if counts.batching:
            sizes.add_metric(key, _cumulative(size_bounds, counts.batch_sizes), counts.batch_items)
            waits.add_metric(key, _cumulative(bounds, counts.waits), counts.waits_s)
        for reason, n in counts.failures.items():
            merged[(slug, replica, reason)] = merged.get((slug, replica, reason), 0) + n
    for (slug, replica, reason), n in sorted(merged.items()):
        failures.add_metric([slug, str(replica), reason], n)
    yield from (requests, failures, latency, sizes, waits)


def _cumulative(bounds: list[str], counts: list[int]) -> list[tuple[str, int]]:
    running, cumulative = 0, []
    for bound, n in zip(bounds, counts, strict=True):
        running += n
        cumulative.append((bound, running))
    return cumulative


def no_pool_text() -> str:
    """What `resident-pool metrics` prints when no pool runs: a textfile collector then shows it down."""
    return f"# HELP resident_pool_up {UP_HELP}\n# TYPE resident_pool_up gauge\nresident_pool_up 0.0\n"


def serve_http(port: int, registry: CollectorRegistry) -> Any:
    """Serve ``registry`` on 127.0.0.1:``port`` (never another interface); returns the server, to shut down.

    A port someone else holds is a ResidentPoolError (reason ``metrics_port_taken``) naming the holder:
    whatever answers there is not this pool, and a scrape would read its numbers. The pool then serves
    metrics nowhere (a port of its own choosing would be one nobody scrapes).
    """
    from prometheus_client import start_http_server

    try:
        server, _ = start_http_server(port, addr="127.0.0.1", registry=registry)
    except OSError as exc:
        if exc.errno != errno.EADDRINUSE:
            raise ResidentPoolError(f"metrics: cannot serve on 127.0.0.1:{port} ({exc.strerror}); no metrics are "
                                    "served; choose another RESIDENT_POOL_METRICS_PORT (`resident-pool metrics` "
                                    "still prints them)", reason="metrics_port_unusable",
                                    details={"port": port}) from None
        holder = port_holder(port)
        raise ResidentPoolError(
            f"metrics: 127.0.0.1:{port} is already taken by {holder or 'another process'}, not this pool, so a "
            "scrape of that port reads someone else's numbers; this pool serves no metrics (on no other port "
            "either): stop that process, or set RESIDENT_POOL_METRICS_PORT to a free port and scrape that; "
            "`resident-pool metrics` still prints the pool's own", reason="metrics_port_taken",
            details={"port": port, "holder": holder}) from None
    return server


def port_holder(port: int) -> str | None:
    """Who listens on TCP ``port`` on any local address: "uid N (name)", with the pid where it is one of ours
    (another user's sockets show their uid, never their pid)."""
    found = listeners(port)
    if not found:
        return None
    uid = found[0].uid
    if uid != os.getuid():
        return user_name(uid)
    pids = socket_pids(found[0].inode)
    mine = f"another process of yours (pid {pids[0]})" if pids else "another process of yours"
    return f"{mine}, {user_name(uid)}"
