"""Measured GPU memory against the declared budget, from fake NVML per-process readings."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest
from helpers import wait_until
from providers import write_provider

from resident_pool import Pool
from resident_pool.host.procs import pid_alive
from resident_pool.ops.gpu_memory import GIB, Peaks, budget_advice, group_usage, process_usage


def _readings(path: Path, processes: list[dict]) -> None:
    """What fake NVML reads: one 10 GB device and the processes holding memory on it."""
    temp = path.with_suffix(".tmp")
    temp.write_text(json.dumps({"devices": [{"total_gb": 10, "free_gb": 10, "processes": processes}]}))
    os.replace(temp, path)


def test_fake_readings_sum_per_process_and_a_group_sums_its_members(tmp_path):
    fake = tmp_path / "nvml.json"
    fake.write_text(json.dumps({"devices": [
        {"total_gb": 80, "free_gb": 70, "processes": [{"pid": os.getpid(), "used_gb": 1.5}]},
        {"total_gb": 80, "free_gb": 80, "processes": [{"pid": os.getpid(), "used_gb": 0.5}, {"pid": 1, "used_gb": 9}]},
    ]}))
    usage, source = process_usage(fake)
    assert usage[os.getpid()] == 2 * GIB and "fake NVML" in source
    assert group_usage(usage, os.getpgid(os.getpid())) == 2 * GIB  # pid 1 is another group
    fake.write_text("{not json")
    assert process_usage(fake)[0] is None


def test_advice_when_the_budget_is_far_from_the_measured_peak():
    assert "raise vram_budget_gb" in budget_advice(4, 5.2)
    assert "held for nothing" in budget_advice(24, 3.1)
    assert budget_advice(4, 3.5) is None and budget_advice(None, 3) is None and budget_advice(4, None) is None


def test_peaks_are_kept_across_restarts_and_start_afresh_for_a_new_version(tmp_path):
    peaks = Peaks(tmp_path / "peaks.json")
    assert peaks.observe("fold", "v1", 3.0, 8.0)
    assert not peaks.observe("fold", "v1", 2.0, 8.0)
    again = Peaks(tmp_path / "peaks.json")
    assert again.get("fold", "v1") == 3.0 and again.get("fold", "v2") is None


@pytest.fixture
def fake_nvml(tmp_path, monkeypatch, pool_dir):
    path = tmp_path / "nvml.json"
    _readings(path, [])
    monkeypatch.setenv("RESIDENT_POOL_FAKE_NVML", str(path))
    monkeypatch.setenv("RESIDENT_POOL_CACHE_DIR", str(tmp_path / "cache"))
    return path


def _worker(pool, slug):
    return next((w for w in pool.status()["workers"] if w["slug"] == slug), None)


def test_over_budget_with_the_stop_policy_is_flagged_under_a_request_and_stopped_when_the_lease_ends(
        pool_dir, fake_nvml, isolated_dirs):
    write_provider(pool_dir, "hog", '[gpu]\npolicy = "required"\nvram_budget_gb = 2\nover_budget = "stop"\n')
    with Pool() as pool, pool.session("hog") as session:
        running = {}
        request = threading.Thread(target=lambda: running.update(
            session.predict({"action": "sleep", "seconds": 3})))
        request.start()
        wait_until(lambda: (_worker(pool, "hog") or {}).get("in_flight_s") is not None, timeout=10,
                   message="the request to be in flight")
        _readings(fake_nvml, [{"pid": session.pid, "used_gb": 3.25}])
        flagged = wait_until(lambda: (_worker(pool, "hog") or {}).get("over_budget"), timeout=20,
                             message="the over-budget flag")
        assert "measured 3.25 GB" in flagged and "vram_budget_gb = 2" in flagged
        request.join()
        assert running["slept"] == 3  # the request in flight was only flagged, never cut
        assert session.predict({"action": "echo", "value": "still leased"})["echo"] == "still leased"
        row = _worker(pool, "hog")
        assert row["gpu_used_gb"] == 3.25 and row["state"] == "draining" and pid_alive(session.pid)
        pid = session.pid
    with Pool() as pool:
        wait_until(lambda: _worker(pool, "hog") is None, timeout=20, message="the worker to stop once released")
    assert not pid_alive(pid)

    def events(name):  # the stream is written as the runtime reports, a moment after status forgets the worker
        lines = (Path(isolated_dirs["logs"]) / "events.jsonl").read_text().splitlines()
        return [e for e in map(json.loads, lines) if e["event"] == name]

    over = events("resident-pool.worker.over-budget")
    stopped = wait_until(lambda: events("resident-pool.worker.stopped"), timeout=20, message="the stopped event")
    assert over[0]["payload"] == {"used_gb": 3.25, "budget_gb": 2.0, "policy": "stop"}
    assert stopped[0]["payload"]["cause"] == "over_budget" and stopped[0]["payload"]["gpu_peak_gb"] == 3.25


def test_over_budget_with_the_default_warn_policy_keeps_the_worker_and_the_peak_is_remembered(pool_dir, fake_nvml):
    write_provider(pool_dir, "hog", '[gpu]\npolicy = "required"\nvram_budget_gb = 2\n')
    write_provider(pool_dir, "roomy", '[gpu]\npolicy = "required"\nvram_budget_gb = 7\n')
    with Pool() as pool:
        hog = pool.predict("hog", {"action": "echo"})["pid"]
        roomy = pool.predict("roomy", {"action": "echo"})["pid"]
        _readings(fake_nvml, [{"pid": hog, "used_gb": 2.5}, {"pid": roomy, "used_gb": 1.0}])
        wait_until(lambda: (_worker(pool, "hog") or {}).get("over_budget"), timeout=20, message="the flag")
        assert pool.predict("hog", {"action": "echo"})["pid"] == hog  # warned, still serving
        def measured():
            providers = pool.status()["providers"]
            return providers if providers["roomy"].get("measured_peak_gb") else None

        providers = wait_until(measured, timeout=20, message="the measured peaks in status")
        assert providers["hog"]["measured_peak_gb"] == 2.5 and "raise vram_budget_gb" in providers["hog"]["budget_advice"]
        assert "held for nothing" in providers["roomy"]["budget_advice"]
        pool.stop(None)
    with Pool() as pool:  # a new pool remembers
        pool.shutdown()
    with Pool() as pool:
        assert pool.status()["providers"]["roomy"]["measured_peak_gb"] == 1.0
