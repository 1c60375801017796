"""Prometheus metrics: the workers' counts folded in, the pool's own, and a real Prometheus scraping them."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from helpers import free_port, healthy, stop_group, wait_until
from prometheus_client.parser import text_string_to_metric_families
from providers import write_provider

from resident_pool import Pool, WorkerRequestError, WorkerStartError
from resident_pool.ops.metrics import METRIC_NAMES, PoolMetrics, StatsBook, WorkerCounts
from resident_pool.worker_base import LATENCY_BUCKETS_S

ROOT = Path(__file__).resolve().parents[1]


def _answer(requests, failures=None, counts=None, total=0.5):
    counts = counts or [requests] + [0] * len(LATENCY_BUCKETS_S)
    return {"requests": requests, "failures": failures or {},
            "latency": {"bounds_s": list(LATENCY_BUCKETS_S), "counts": counts, "sum_s": total}}


def test_a_new_worker_under_the_same_number_adds_to_its_counts_never_resets_them():
    book = StatsBook()
    assert book.record("echo", 0, 100, _answer(5, {"request_failed": 1}))
    assert book.record("echo", 0, 100, _answer(7, {"request_failed": 2}))
    assert book.record("echo", 0, 200, _answer(3))  # restarted: the old process's 7 are kept
    assert not book.record("echo", 0, 200, _answer(2))  # a late answer overtaken by a newer one
    totals, _ = book.totals()
    assert totals[("echo", 0)].requests == 10 and totals[("echo", 0)].failures == {"request_failed": 2}


@pytest.mark.parametrize("hostile", [
    {"requests": -1, "latency": {"bounds_s": list(LATENCY_BUCKETS_S), "counts": [0] * 17, "sum_s": 0}},
    {"requests": True, "latency": {"bounds_s": list(LATENCY_BUCKETS_S), "counts": [0] * 17, "sum_s": 0}},
    {"requests": 1, "latency": {"bounds_s": [1, 2], "counts": [1, 0, 0], "sum_s": 0}},
    {"requests": 1, "latency": {"bounds_s": list(LATENCY_BUCKETS_S), "counts": ["x"] * 17, "sum_s": 0}},
    {"requests": 1, "failures": {f"r{n}": 1 for n in range(40)},
     "latency": {"bounds_s": list(LATENCY_BUCKETS_S), "counts": [1] + [0] * 16, "sum_s": 0}},
    {"requests": 1},
    {"op": "not stats at all"},
])
def test_a_stats_answer_that_is_not_ours_is_ignored(hostile):
    assert WorkerCounts.parse(hostile) is None


def _batching_answer(requests, sizes, waits):
    from resident_pool.worker_base import BATCH_SIZE_BUCKETS

    answer = _answer(requests)
    answer["batches"] = {"calls": 3, "items": requests, "sum_s": 0.1,
                         "size": {"bounds": list(BATCH_SIZE_BUCKETS), "counts": sizes}}
    answer["queue_wait"] = {"bounds_s": list(LATENCY_BUCKETS_S), "counts": waits, "sum_s": 0.02}
    return answer


def test_a_batching_workers_call_sizes_and_queue_waits_become_histograms_per_provider_and_replica():
    """Issue 35: batch size and queue wait histograms per provider, from the worker's own stats."""
    from resident_pool.ops.metrics import _worker_families

    book = StatsBook()
    sizes = [0, 0, 0, 1, 0, 2, 0, 0, 0, 0, 0, 0]  # one call of 5 to 8 requests, two of 17 to 32
    waits = [3, 5] + [0] * (len(LATENCY_BUCKETS_S) - 1)
    assert book.record("embed", 0, 100, _batching_answer(70, sizes, waits))
    assert book.record("echo", 0, 101, _answer(4))  # not a batching worker: no histogram of its own
    families = {family.name: family for family in _worker_families(*book.totals())}
    buckets = {(sample.labels["provider"], sample.labels["le"]): sample.value
               for sample in families["resident_pool_batch_size"].samples if sample.name.endswith("_bucket")}
    assert buckets[("embed", "8")] == 1 and buckets[("embed", "32")] == 3 and ("echo", "8") not in buckets
    sums = [sample.value for sample in families["resident_pool_queue_wait_seconds"].samples
            if sample.name.endswith("_sum")]
    assert sums == [0.02]
    assert WorkerCounts.parse(_batching_answer(70, ["x"] * 12, waits)) is None  # not ours: ignored whole


@pytest.mark.parametrize(("field", "value"), [
    ("requests", 10**400), ("requests", 2**53), ("count", 10**400), ("failure", 2**60),
    ("sum_s", float("nan")), ("sum_s", float("inf")), ("sum_s", -0.5), ("sum_s", 10**400),
], ids=["requests-10e400", "requests-2e53", "bucket-10e400", "failures-2e60", "sum-nan", "sum-inf", "sum-negative",
        "sum-10e400"])
def test_one_workers_absurd_count_is_refused_and_logged_and_every_scrape_still_answers(field, value, caplog):
    """A worker is not trusted with the pool's /metrics: one report it makes must not end every scrape."""
    answer = _answer(3, {"request_failed": 1})
    if field == "requests":
        answer["requests"] = value
    elif field == "count":
        answer["latency"]["counts"][1] = value
    elif field == "failure":
        answer["failures"]["request_failed"] = value
    else:
        answer["latency"]["sum_s"] = value
    metrics = PoolMetrics(_snapshot)
    assert metrics.book.record("echo", 0, 100, _answer(2))
    with caplog.at_level("WARNING", logger="resident_pool.metrics"):
        assert not metrics.book.record("echo", 0, 100, answer)
        assert not metrics.book.record("echo", 0, 200, answer)  # nor banked when the worker is replaced
    assert "echo[0] (pid 100) answered stats the pool cannot read; ignored" in caplog.text
    families = {f.name: f for f in text_string_to_metric_families(metrics.render())}
    assert families["resident_pool_up"].samples[0].value == 1
    samples = {(s.name, s.labels.get("replica")): s.value for f in families.values() for s in f.samples}
    assert samples[("resident_pool_requests_total", "0")] == 2  # what it reported before, and nothing more


def test_a_reason_that_is_not_a_word_becomes_other_so_no_label_carries_it():
    counts = WorkerCounts.parse(_answer(2, {"/home/alice/secret run": 1, "request_failed": 1}))
    assert counts.failures == {"other": 1, "request_failed": 1}


def _snapshot():
    return {"version": "9.9", "providers": {"echo": {"waiting_replica": 2, "waiting_gpu": 1, "breaker_open": True,
                                                     "states": {"ready": 1, "leased": 1}, "peak_gb": 3.0}},
            "workers": [{"slug": "echo", "replica": 0, "idle_s": 4.0, "in_flight_s": None, "budget_gb": 4.0,
                         "gpu_used_gb": 3.0, "gpu_peak_gb": 3.5, "over_budget": False},
                        {"slug": "echo", "replica": 1, "idle_s": 0.0, "in_flight_s": 12.5, "budget_gb": None,
                         "gpu_used_gb": None, "gpu_peak_gb": None, "over_budget": False}]}


def test_the_text_format_holds_every_declared_family_and_labels_carry_no_paths():
    metrics = PoolMetrics(_snapshot)
    metrics.book.record("echo", 0, 100, _answer(4, {"request_failed": 1}, total=0.25))
    metrics.book.failed("echo", 0, "worker_died")
    metrics.cold_starts.labels("echo").inc()
    metrics.start_seconds.labels("echo").observe(0.4)
    metrics.admission_wait.labels("echo", "normal").observe(0.0)
    metrics.lease_wait.labels("interactive").observe(0.01)
    metrics.evictions.labels("echo").inc()
    metrics.stops.labels("echo", "idle").inc()
    metrics.start_failures.labels("echo", "start_failed").inc()
    families = {f.name: f for f in text_string_to_metric_families(metrics.render())}
    assert set(METRIC_NAMES) <= set(families)
    assert {name: families[name].type for name in METRIC_NAMES} == METRIC_NAMES
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families.values() for s in f.samples}
    assert samples[("resident_pool_requests_total", (("provider", "echo"), ("replica", "0")))] == 4
    assert samples[("resident_pool_request_failures_total",
                    (("provider", "echo"), ("reason", "worker_died"), ("replica", "0")))] == 1
    assert samples[("resident_pool_request_duration_seconds_count", (("provider", "echo"), ("replica", "0")))] == 4
    assert samples[("resident_pool_breaker_open", (("provider", "echo"),))] == 1
    assert samples[("resident_pool_queue_depth", (("provider", "echo"), ("waiting_for", "replica")))] == 2
    assert samples[("resident_pool_request_in_flight_seconds", (("provider", "echo"), ("replica", "1")))] == 12.5
    assert samples[("resident_pool_gpu_used_bytes", (("provider", "echo"), ("replica", "0")))] == 3 * 2**30
    values = [v for f in families.values() for s in f.samples for v in s.labels.values()]
    assert values and not [v for v in values if "/" in v or " " in v]


def _cli(*args, check=True):
    done = subprocess.run([sys.executable, "-m", "resident_pool", *args], capture_output=True, text=True, timeout=120,
                          check=False)
    if check:
        assert done.returncode == 0, done.stderr
    return done


def test_resident_pool_metrics_prints_the_text_format_and_says_down_when_no_pool_runs(pool_dir):
    down = _cli("metrics")
    assert "resident_pool_up 0.0" in down.stdout and "no pool is running" in down.stderr
    shutil.copytree(ROOT / "manifests" / "echo", pool_dir / "echo")
    with Pool() as pool:
        for n in range(3):
            pool.predict("echo", {"n": n})

        def requests_counted():
            text = _cli("metrics").stdout
            return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
                    if s.labels.get("provider") == "echo" and s.name == "resident_pool_requests_total"}

        wait_until(lambda: requests_counted().get("resident_pool_requests_total") == 3, timeout=20,
                   message="the worker's 3 requests in the metrics")


# -- a real Prometheus -----------------------------------------------------------------------
def _query(port, expr):
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=5) as response:
        data = json.loads(response.read())
    assert data["status"] == "success", data
    return {tuple(sorted(r["metric"].items())): float(r["value"][1]) for r in data["data"]["result"]}


def _scalar(port, expr):
    result = _query(port, expr)
    return next(iter(result.values())) if result else None


@pytest.fixture
def prometheus(tmp_path):
    """A real Prometheus server scraping the pool's metrics port every second."""
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("prometheus is not installed here (Debian package prometheus; .ci/run installs it)")
    target, web = free_port(), free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(f"global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nscrape_configs:\n"
                      f"  - job_name: resident-pool\n    static_configs:\n      - targets: ['127.0.0.1:{target}']\n")
    with open(tmp_path / "prometheus.log", "w") as log:
        server = subprocess.Popen([binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                                   f"--web.listen-address=127.0.0.1:{web}"], stdout=log, stderr=subprocess.STDOUT,
                                  start_new_session=True)
        try:
            wait_until(lambda: healthy(f"http://127.0.0.1:{web}/-/ready"), timeout=60, interval=0.2,
                       message="Prometheus to be ready")
            yield target, web
        finally:
            stop_group(server)


@pytest.mark.slow
def test_with_the_metrics_port_on_a_real_prometheus_reads_requests_failures_evictions_starts_and_the_breaker(
        pool_dir, monkeypatch, prometheus):
    target, web = prometheus
    monkeypatch.setenv("RESIDENT_POOL_METRICS_PORT", str(target))
    monkeypatch.setenv("RESIDENT_POOL_GPU_CAPACITY_GB", "10")
    for slug in ("a6", "b6"):
        write_provider(pool_dir, slug, '[gpu]\npolicy = "required"\nvram_budget_gb = 6\n')
    write_provider(pool_dir, "refuser", 'worker_args = ["{socket}", "--exit-before-bind", "3"]\n')
    with Pool() as pool:
        for n in range(5):
            pool.predict("a6", {"action": "echo", "value": n})
        with pytest.raises(WorkerRequestError):
            pool.predict("a6", {"action": "raise"})
        pool.predict("b6", {"action": "echo", "value": "evicts a6"})  # 6 + 6 > 10: a6 is idle, so evicted
        with pytest.raises(WorkerStartError):
            pool.predict("refuser", {})  # exit 3 at start: a refusal opens the breaker at once

        def seen(expr, want):
            return wait_until(lambda: _scalar(web, expr) == want, timeout=30, interval=0.5,
                              message=f"Prometheus to read {expr} == {want} (last {_scalar(web, expr)})")

        seen('sum(resident_pool_requests_total{provider="a6"})', 6)
        seen('sum(resident_pool_request_failures_total{provider="a6",reason="request_failed"})', 1)
        seen('resident_pool_evictions_total{provider="a6"}', 1)
        seen('sum(resident_pool_worker_stops_total{provider="a6",cause="evicted"})', 1)
        seen('resident_pool_cold_starts_total{provider="a6"}', 1)
        seen('resident_pool_cold_starts_total{provider="b6"}', 1)
        seen('resident_pool_start_failures_total{provider="refuser",reason="start_failed"}', 1)
        seen('resident_pool_breaker_open{provider="refuser"}', 1)
        seen('resident_pool_request_duration_seconds_count{provider="a6"}', 6)
        seen('resident_pool_gpu_budget_bytes{provider="b6"}', 6 * 2**30)
        pool.stop("refuser")  # closes the breaker
        seen('resident_pool_breaker_open{provider="refuser"}', 0)
        labels = _query(web, '{job="resident-pool"}')
        assert labels and not [v for key in labels for _, v in key if "/" in v]
        # The Grafana dashboard's queries parse and run on a real Prometheus, and its request panel has data.
        from test_infra import dashboard_queries

        for expr in dashboard_queries():
            if not expr.startswith("label_values"):
                _query(web, expr.replace("$__rate_interval", "1m").replace("$provider", ".*"))
        (requests_panel, *_) = dashboard_queries()
        rates = _query(web, requests_panel.replace("$__rate_interval", "1m").replace("$provider", ".*"))
        assert (("provider", "a6"),) in rates
