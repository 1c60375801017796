"""The client's own handling of what the pool answers."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from providers import write_provider

from resident_pool import AdmissionTimeout, Pool


def test_an_admission_timeout_is_raised_once_not_retried(pool_dir, monkeypatch, isolated_dirs):
    monkeypatch.setenv("RESIDENT_POOL_GPU_CAPACITY_GB", "10")
    for slug in ("a6", "b6"):
        write_provider(pool_dir, slug, '[gpu]\npolicy = "required"\nvram_budget_gb = 6\n'
                                       "[lifecycle]\nadmission_timeout_s = 1\n")
    with Pool() as pool, pool.session("a6"):
        started = time.monotonic()
        with pytest.raises(AdmissionTimeout):
            pool.predict("b6", {"action": "echo"})
        waited = time.monotonic() - started
    stream = Path(isolated_dirs["logs"]) / "events.jsonl"
    failed = [e for e in map(json.loads, stream.read_text().splitlines())
              if e["event"] == "resident-pool.worker.start-failed" and e["slug"] == "b6"]
    assert len(failed) == 1 and waited < 2.5, f"{len(failed)} admissions, {waited:.1f} s"
