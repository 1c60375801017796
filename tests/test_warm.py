"""Warm-up on demand: `resident-pool warm`, the Prefect warm task, and min_replicas kept warm."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers import wait_until
from providers import write_provider

from resident_pool import AdmissionTimeout, Pool
from resident_pool.host.procs import pid_alive


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "resident_pool", *args], capture_output=True, text=True, timeout=120,
                          check=False)


def _workers(pool, slug):
    return sorted((w for w in pool.status()["workers"] if w["slug"] == slug), key=lambda w: w["replica"])


def test_warm_starts_the_replicas_asked_for_and_a_second_warm_starts_none(pool_dir):
    write_provider(pool_dir, "warmable", "[lifecycle]\nmax_replicas = 3\n")
    done = _cli("warm", "warmable", "--replicas", "2")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 of 2 worker(s) warm (2 started now)" in done.stdout
    with Pool() as pool:
        assert [w["state"] for w in _workers(pool, "warmable")] == ["ready", "ready"]
    again = _cli("warm", "warmable", "--replicas", "2")
    assert "(0 started now)" in again.stdout
    too_many = _cli("warm", "warmable", "--replicas", "4")
    assert too_many.returncode == 1 and "max_replicas = 3" in too_many.stderr  # errors on stderr


def test_warm_on_a_provider_that_cannot_start_fails_naming_why(pool_dir):
    write_provider(pool_dir, "broken", 'worker_args = ["{socket}", "--exit-before-bind", "3"]\n')
    done = _cli("warm", "broken")
    assert done.returncode == 1 and "WorkerStartError" in done.stderr and "exit code 3" in done.stderr


@pytest.mark.slow
@pytest.mark.usefixtures("prefect_harness")
def test_after_resident_pool_warm_a_campaigns_first_chunk_is_warm(pool_dir, tmp_path):
    sys.path.insert(0, str(pool_dir.parents[0]))
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "flows"))
    from screen import screen

    write_provider(pool_dir, "embedder", "", worker="embedder.py")
    inputs = tmp_path / "inputs.jsonl"
    inputs.write_text("".join(json.dumps({"id": f"s{n}", "sequence": "MKV" * (n + 1)}) + "\n" for n in range(5)))
    assert _cli("warm", "embedder").returncode == 0
    summary = screen(input=str(inputs), provider="embedder", chunk_size=10, output=str(tmp_path / "out.jsonl"))
    assert summary["ok"] == 5 and summary["chunks"] == 1
    assert summary["cold_starts"] == 0  # the one chunk's lease said cold: false


@pytest.mark.usefixtures("prefect_harness")
def test_the_warm_task_at_the_start_of_a_flow_makes_the_first_lease_warm(pool_dir):
    from prefect import flow, task

    from resident_pool.prefect import pool_session, warm_provider

    write_provider(pool_dir, "warmed", "")

    @task
    def first_chunk():
        with pool_session("warmed") as session:
            return {"cold": session.cold, "echo": session.predict({"action": "echo", "value": 1})["echo"]}

    @flow
    def campaign():
        warmed = warm_provider.submit("warmed")
        return warmed.result(), first_chunk.submit(wait_for=[warmed]).result()

    warmed, chunk = campaign()
    assert warmed["started"] == 1 and chunk == {"cold": False, "echo": 1}


def test_min_replicas_start_with_the_pool_and_are_exempt_from_a_half_second_idle_retirement(pool_dir):
    write_provider(pool_dir, "kept", "[lifecycle]\nmin_replicas = 1\nmax_replicas = 2\nidle_timeout_s = 0.5\n")
    with Pool() as pool:
        (first,) = wait_until(lambda: [w for w in _workers(pool, "kept") if w["state"] == "ready"], timeout=30,
                              message="min_replicas started with the pool")
        assert first["kept_warm"] and pool.status()["providers"]["kept"]["min_replicas"] == 1
        assert _cli("warm", "kept", "--replicas", "2").returncode == 0
        assert len(_workers(pool, "kept")) == 2
        # Both idle alike: the one beyond min_replicas retires, the kept one stays.
        (left,) = wait_until(lambda: len(_workers(pool, "kept")) == 1 and _workers(pool, "kept"), timeout=30,
                             message="the extra replica to retire")
        assert left["pid"] == first["pid"] and left["idle_s"] >= 0.5 and pid_alive(first["pid"])
        pool.stop("kept")
        # Stopped by hand (or dead): the pool brings it back.
        back = wait_until(lambda: [w for w in _workers(pool, "kept") if w["state"] == "ready"], timeout=30,
                          message="min_replicas topped up again")
        assert back[0]["pid"] != first["pid"]


def _gpu(pool_dir, slug, budget, extra=""):
    write_provider(pool_dir, slug, f'[gpu]\npolicy = "required"\nvram_budget_gb = {budget}\n'
                                   f"[lifecycle]\nadmission_timeout_s = 1\n{extra}")


def test_a_kept_warm_worker_is_evicted_last_and_only_when_that_lets_the_request_fit(pool_dir, monkeypatch):
    monkeypatch.setenv("RESIDENT_POOL_GPU_CAPACITY_GB", "10")
    _gpu(pool_dir, "kept", 4, "min_replicas = 1\n")
    _gpu(pool_dir, "other", 4)
    _gpu(pool_dir, "big", 6)
    _gpu(pool_dir, "seven", 7)
    with Pool() as pool:
        kept = wait_until(lambda: [w for w in _workers(pool, "kept") if w["state"] == "ready"], timeout=30,
                          message="the kept-warm worker")[0]["pid"]
        other = pool.predict("other", {"action": "echo"})["pid"]
        pool.predict("big", {"action": "echo"})  # 4 + 4 + 6 > 10: the idle "other" goes, not "kept"
        assert not pid_alive(other) and pid_alive(kept)
        # "big" (6) held: even giving back "kept" (4) leaves 4 of the 7 needed. Nothing is evicted for nothing.
        with pool.session("big"):
            with pytest.raises(AdmissionTimeout):
                pool.predict("seven", {"action": "echo"})
            assert pid_alive(kept)
        # Now "big" is idle: it goes first, and then "kept" too, since only both free enough for 7.
        seven = pool.predict("seven", {"action": "echo"})["pid"]
        assert not pid_alive(kept)
        # Topping min_replicas up again finds no room: it neither waits nor evicts the worker just admitted.
        wait_until(lambda: "no room now" in (pool.status()["providers"]["kept"]["last_error"] or ""), timeout=30,
                   message="the kept-warm top-up to find no room")
        assert pid_alive(seven) and pool.status()["providers"]["kept"]["breaker"] is None
