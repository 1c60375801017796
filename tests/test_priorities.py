"""Priorities and backfill end to end: real pools, real workers, a declared card (no GPU).

The rules themselves are tested in the decision core (test_core_admission.py); these show
the promises a user sees: a small request is not stuck behind a big one that cannot start,
a backfilled session gives its worker back after a request and goes on transparently, the
classes order the waits, and the events and metrics say what happened.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest
from helpers import wait_until
from providers import write_provider

from resident_pool import Pool
from resident_pool.errors import ResidentPoolError


def gpu(manifests: Path, slug: str, budget: float) -> None:
    write_provider(manifests, slug, f'[gpu]\npolicy = "required"\nvram_budget_gb = {budget}\n'
                                    "[lifecycle]\nadmission_timeout_s = 120\n")


def _events() -> list[dict]:
    path = Path(os.environ["RESIDENT_POOL_LOG_DIR"]) / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _predict(slug: str, payload: dict, priority: str = "normal"):
    with Pool() as pool:
        return pool.predict(slug, payload, priority=priority)


def _in_thread(target, outcome: dict, name: str) -> threading.Thread:
    def run():
        try:
            outcome[name] = target()
        except (ResidentPoolError, OSError) as exc:
            outcome[f"{name}_error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_a_small_request_is_served_while_a_big_one_waits_for_the_big_holder(pool_dir, monkeypatch, tmp_path):
    """The issue's case on a declared 10 GB card with 0.5 GB headroom: 8 GB held, 8 GB waiting, 1 GB asked."""
    monkeypatch.setenv("RESIDENT_POOL_GPU_CAPACITY_GB", "10")
    monkeypatch.setenv("RESIDENT_POOL_GPU_HEADROOM_GB", "0.5")
    for slug, budget in (("big", 8), ("big2", 8), ("small", 1)):
        gpu(pool_dir, slug, budget)
    outcome: dict = {}
    with Pool() as pool, pool.session("big") as held:
        held.predict({"action": "echo"})
        big2 = _in_thread(lambda: _predict("big2", {"action": "echo"}), outcome, "big2")
        wait_until(lambda: [w for w in pool.waiting() if w["slug"] == "big2" and w.get("needs_gb")], timeout=30,
                   message="big2 waiting for memory")
        asked = time.monotonic()
        small = _predict("small", {"action": "echo"}, priority="batch")
        served_in = time.monotonic() - asked
        assert small["pid"] and "big2" not in outcome  # served while big2 still waits for big
        assert [w["slug"] for w in pool.waiting() if w.get("needs_gb")] == ["big2"]
        backfilled = [e for e in _events() if e["event"] == "resident-pool.admission.backfilled"]
        assert [(e["slug"], e["payload"]["ahead_of"]) for e in backfilled] == [("small", "big2")]
    big2.join(60)
    assert outcome["big2"]["pid"]  # and big2 once big was free (small, idle and backfilled, gave way if needed)
    assert served_in < 30  # the figure itself (within 1 s) is measured by the bench, not asserted under load


def test_a_backfilled_session_is_recalled_after_its_request_and_goes_on_transparently(pool_dir, monkeypatch, tmp_path):
    """big (8) is held; big2 (9) waits; small (2) is backfilled. When big is free, big2 still needs small's memory:
    small's lease is recalled after its current request; its next request waits again, behind big2."""
    audit = tmp_path / "audit.jsonl"
    monkeypatch.setenv("RESIDENT_POOL_GPU_CAPACITY_GB", "10")
    monkeypatch.setenv("RESIDENT_POOL_LEDGER_AUDIT", str(audit))
    for slug, budget in (("big", 8), ("big2", 9), ("small", 2)):
        gpu(pool_dir, slug, budget)
    outcome: dict = {}
    answered: dict[str, float] = {}
    with Pool() as pool:
        def hold_big():
            with Pool() as mine, mine.session("big") as session:
                session.predict({"action": "sleep", "seconds": 1.0})

        def want_big2():
            result = _predict("big2", {"action": "echo"})
            answered["big2"] = time.monotonic()
            return result

        def small_session():
            seen = []
            with Pool() as mine, mine.session("small") as session:
                seen.append(session.backfilled)
                for _ in range(8):
                    session.predict({"action": "sleep", "seconds": 0.5})
                    answered.setdefault("small", []).append(time.monotonic())
                return {"backfilled_at_first": seen[0], "recalls": session.recalls}

        threads = [_in_thread(hold_big, outcome, "big")]
        wait_until(lambda: any(w["slug"] == "big" and w["state"] == "leased" for w in pool.status()["workers"]),
                   timeout=30, message="big busy")
        threads.append(_in_thread(want_big2, outcome, "big2"))
        wait_until(lambda: [w for w in pool.waiting() if w["slug"] == "big2" and w.get("needs_gb")], timeout=30,
                   message="big2 waiting")
        threads.append(_in_thread(small_session, outcome, "small"))
        for thread in threads:
            thread.join(120)
    assert not [k for k in outcome if k.endswith("_error")], outcome
    assert outcome["small"] == {"backfilled_at_first": True, "recalls": 1}
    # small's requests after the recall waited for big2 (one request of small's ran past big's end, no more)
    assert sum(1 for t in answered["small"] if t > answered["big2"]) >= 1
    for state in (json.loads(line)["entries"] for line in audit.read_text().splitlines()):
        assert sum(e["budget_gb"] for e in state) <= 10
    recalled = [e for e in _events() if e["event"] == "resident-pool.admission.recalled"]
    assert recalled and recalled[0]["slug"] == "small"


def test_waits_are_served_by_class_and_the_metrics_carry_the_wait_by_class(pool_dir):
    write_provider(pool_dir, "one", "[lifecycle]\nmax_replicas = 1\n")
    order: list[str] = []
    lock = threading.Lock()
    with Pool() as pool, pool.session("one") as held:
        held.predict({"action": "echo"})

        def ask(cls: str):
            def run():
                # The order is written while the lease is held: written after the call, the next class's answer
                # could come first (seen under load: a thread descheduled between its release and its append).
                with Pool() as own, own.session("one", priority=cls) as session:
                    session.predict({"action": "echo"})
                    with lock:
                        order.append(cls)
            return run

        threads = []
        for cls in ("batch", "normal", "interactive"):
            threads.append(threading.Thread(target=ask(cls)))
            threads[-1].start()
            count = len(threads)
            wait_until(lambda n=count: len([w for w in pool.waiting() if w["slug"] == "one"]) == n,
                       timeout=30, message=f"{cls} waiting")
        rows = [w for w in pool.waiting() if w["slug"] == "one"]
        assert [w["priority"] for w in rows] == ["interactive", "normal", "batch"]
        held.release()
        for thread in threads:
            thread.join(60)
        metrics = pool.metrics_text()
    assert order == ["interactive", "normal", "batch"]
    assert 'resident_pool_lease_wait_seconds_count{priority="batch"} 1.0' in metrics


def test_a_priority_that_is_not_a_class_is_refused_naming_the_classes(pool_dir):
    write_provider(pool_dir, "one", "")
    with Pool() as pool, pytest.raises(ResidentPoolError, match="not a class: one of interactive, normal, batch"):
        pool.predict("one", {}, priority="urgent")


def test_the_screen_flows_progress_artifact_says_what_waits_in_order_with_classes(monkeypatch):
    import resident_pool.prefect as helpers

    class Waiting:
        def waiting(self):
            return [{"slug": "boltz2", "priority": "interactive", "ranks_as": "interactive", "age_s": 4.2,
                     "needs_gb": 30, "waits_for": "30 GB needed, at most 12 GB free on a device"},
                    {"slug": "minilm", "priority": "batch", "ranks_as": "normal", "age_s": 310.0,
                     "waits_for": "max_replicas = 1; minilm[0] leased"}]

    monkeypatch.setattr(helpers, "_client", lambda manifests: Waiting())
    text = helpers.queue_summary()
    assert text.splitlines() == [
        "1. boltz2 (interactive), 4 s, needs 30 GB: 30 GB needed, at most 12 GB free on a device",
        "2. minilm (batch, ranks as normal), 310 s, needs a replica: max_replicas = 1; minilm[0] leased"]
