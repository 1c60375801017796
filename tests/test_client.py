"""The client's own handling of what the pool answers."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
from helpers import wait_until
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


def test_two_threads_of_one_client_each_hear_and_keep_their_own_wait_for_gpu_admission(pool_dir, monkeypatch):
    """Issue 32: what a wait reported came back only through the client's one ``on_wait`` (the Prefect helpers set
    it on a client their tasks' threads share, and read the report back through a thread-local); a session now
    hears its own waits (``on_wait=``) and keeps the last as ``session.wait``, and the client's own is untouched."""
    monkeypatch.setenv("RESIDENT_POOL_GPU_CAPACITY_GB", "10")
    for slug in ("a6", "b6"):
        write_provider(pool_dir, slug, '[gpu]\npolicy = "required"\nvram_budget_gb = 6\n')
    write_provider(pool_dir, "plain", "")
    heard = {"a6": [], "plain": []}
    kept = {}

    def use(pool, slug):
        with pool.session(slug, on_wait=heard[slug].append) as session:
            kept[slug] = session.wait
            session.predict({"action": "echo"})

    with Pool() as pool:
        with pool.session("b6"):  # 6 of the 10 GB held: a6 waits for them
            waiter = threading.Thread(target=use, args=(pool, "a6"))
            waiter.start()
            wait_until(lambda: heard["a6"], timeout=30, message="a6's first report of its wait")
            other = threading.Thread(target=use, args=(pool, "plain"))  # on its own thread, while a6 waits
            other.start()
            other.join(timeout=60)
            assert not other.is_alive() and "a6" not in kept  # served while a6 still waited
        waiter.join(timeout=60)
        assert not waiter.is_alive()
        assert pool.on_wait is None
    assert heard["plain"] == [] and kept["plain"] is None
    assert {wait["slug"] for wait in heard["a6"]} == {"a6"} and kept["a6"] == heard["a6"][-1]
    assert kept["a6"]["needs_gb"] == 6 and "b6[0] 6 GB on GPU 0" in "; ".join(kept["a6"]["holders"])
