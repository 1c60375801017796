"""The host pool with real pool, client and worker processes."""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from helpers import both_ways, wait_until
from providers import write_provider

from resident_pool import AdmissionRefused, AdmissionTimeout, Pool, StateDirError, WorkerStartError
from resident_pool.host.procs import pid_alive

ROOT = Path(__file__).resolve().parents[1]


def gpu_provider(manifests, slug, budget, extra="", args='["{socket}"]', max_replicas=1, admission_timeout=60):
    body = (f"worker_args = {args}\n[gpu]\npolicy = \"required\"\nvram_budget_gb = {budget}\n"
            f"[lifecycle]\nmax_replicas = {max_replicas}\n"
            f"admission_timeout_s = {admission_timeout}\n{extra}")
    return write_provider(manifests, slug, body)


def copy_echo(manifests):
    shutil.copytree(ROOT / "manifests" / "echo", manifests / "echo")


CLIENT = textwrap.dedent(
    """
    import json, sys, time
    from resident_pool import Pool
    slug, payload = sys.argv[1], json.loads(sys.argv[2])
    pool = Pool()
    arrived = time.time()
    result = pool.predict(slug, payload)
    print(json.dumps({"slug": slug, "arrived": arrived, "answered": time.time(), "result": result}), flush=True)
    pool.close()
    """
)


def run_client(slug, payload):
    return subprocess.Popen([sys.executable, "-c", CLIENT, slug, json.dumps(payload)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def finish(proc, timeout=60):
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err
    return json.loads(out)


@pytest.mark.smoke
@both_ways
def test_a_second_process_is_served_by_the_worker_the_first_started(pool_dir, way):
    copy_echo(pool_dir)
    if way == "zygote":
        manifest = pool_dir / "echo" / "manifest.toml"
        manifest.write_text(manifest.read_text().replace("[lifecycle]\n", '[lifecycle]\npreload = ["json"]\n'))
    first = finish(run_client("echo", {"n": 1}))
    second = finish(run_client("echo", {"n": 2}))
    assert first["result"]["pid"] == second["result"]["pid"]
    assert pid_alive(first["result"]["pid"])  # it outlived the process that started it
    with Pool() as pool:
        state = pool.status()
    (worker,) = state["workers"]
    assert worker["starts"] == 1 and worker["served"] == 2
    assert worker["started_by"].split()[0] == way
    assert state["providers"]["echo"]["start"]["way"] == way


def test_a_pool_starts_a_plain_worker_and_it_answers(pool_dir):
    """The first start of a replica once failed with AttributeError on every path (a start's record written on
    the wrong object): the simplest provider, one request."""
    write_provider(pool_dir, "echo", "")
    with Pool(manifests=pool_dir) as pool:
        answer = pool.predict("echo", {"x": 1})
        pool.stop("echo")
    assert answer is not None


def _contended(pool_dir, monkeypatch, tmp_path):
    """a6 busy on a declared 10 GB card; b6 (6 GB) waits for it; c3 (3 GB) asks next, and fits beside a6 now."""
    audit = tmp_path / "ledger-audit.jsonl"
    monkeypatch.setenv("RESIDENT_POOL_GPU_CAPACITY_GB", "10")
    monkeypatch.setenv("RESIDENT_POOL_LEDGER_AUDIT", str(audit))
    gpu_provider(pool_dir, "a6", 6)
    gpu_provider(pool_dir, "b6", 6)
    gpu_provider(pool_dir, "c3", 3)
    return audit


@pytest.mark.smoke
def test_budgets_never_oversubscribe_a_request_that_fits_is_backfilled_and_the_head_gets_the_evicted_memory(
        pool_dir, monkeypatch, tmp_path):
    audit = _contended(pool_dir, monkeypatch, tmp_path)
    with Pool() as pool:
        holder = run_client("a6", {"action": "sleep", "seconds": 8})
        wait_until(lambda: any(w["slug"] == "a6" and w["state"] == "leased" for w in pool.status()["workers"]),
                   timeout=30, message="a6 to be busy")
        b = run_client("b6", {"action": "sleep", "seconds": 0.2})
        wait_until(lambda: [w["slug"] for w in pool.waiting() if "needs_gb" in w] == ["b6"], message="b6 waiting")
        c = run_client("c3", {"action": "sleep", "seconds": 0.2})  # fits beside a6 now: it does not wait for b6
        served = finish(c)
        assert b.poll() is None and holder.poll() is None  # c3 was served while b6 waited for a6
        results = [finish(p) for p in (holder, b)] + [served]
        more = [run_client(slug, {"action": "echo", "value": n}) for n, slug in enumerate(["a6", "c3", "b6", "c3"])]
        results += [finish(p) for p in more]
    assert all(r["result"] for r in results)  # every request answered
    states = [json.loads(line)["entries"] for line in audit.read_text().splitlines()]
    assert states
    for entries in states:  # every change the ledger went through
        assert sum(e["budget_gb"] for e in entries) <= 10
    assert _first_appearances(states)[:3] == ["a6", "c3", "b6"]  # c3 backfilled; b6 next, once a6 was idle
    assert "evicted (idle) to make room" in _transcript("a6").read_text()


def test_with_backfill_off_waiters_are_admitted_in_arrival_order(pool_dir, monkeypatch, tmp_path):
    """RESIDENT_POOL_BACKFILL=0: the strict order a site may choose instead of backfill."""
    monkeypatch.setenv("RESIDENT_POOL_BACKFILL", "0")
    audit = _contended(pool_dir, monkeypatch, tmp_path)
    with Pool() as pool:
        holder = run_client("a6", {"action": "sleep", "seconds": 8})
        wait_until(lambda: any(w["slug"] == "a6" and w["state"] == "leased" for w in pool.status()["workers"]),
                   timeout=30, message="a6 to be busy")
        b = run_client("b6", {"action": "sleep", "seconds": 0.2})
        wait_until(lambda: [w["slug"] for w in pool.waiting() if "needs_gb" in w] == ["b6"], message="b6 waiting")
        c = run_client("c3", {"action": "sleep", "seconds": 0.2})  # would fit now, but b6 came first
        wait_until(lambda: [w["slug"] for w in pool.waiting() if "needs_gb" in w] == ["b6", "c3"], timeout=30,
                   message="c3 queued behind b6")
        results = [finish(p) for p in (holder, b, c)]
    assert all(r["result"] for r in results)
    states = [json.loads(line)["entries"] for line in audit.read_text().splitlines()]
    assert _first_appearances(states)[:3] == ["a6", "b6", "c3"]


def _first_appearances(states):
    seen, order = set(), []
    for entries in states:
        for entry in entries:
            key = (entry["slug"], entry["since"])
            if key not in seen:
                seen.add(key)
                order.append(entry["slug"])
    return order


def _transcript(slug):
    logs = Path(os.environ["RESIDENT_POOL_LOG_DIR"])
    return sorted(logs.glob(f"{slug}-*.log"))[0]


def test_a_budget_no_device_can_hold_is_refused_at_once_and_a_long_wait_times_out(pool_dir, monkeypatch):
    monkeypatch.setenv("RESIDENT_POOL_GPU_CAPACITY_GB", "10")
    gpu_provider(pool_dir, "huge", 12)
    gpu_provider(pool_dir, "a6", 6)
    gpu_provider(pool_dir, "b6", 6, admission_timeout=1)
    with Pool() as pool:
        pool.status()  # the pool is up: what is timed below is the refusal, not the pool's own start
        started = time.monotonic()
        with pytest.raises(AdmissionRefused, match="needs 12 GB but the largest device holds 10 GB"):
            pool.predict("huge", {})
        assert time.monotonic() - started < 5  # refused at once, not after admission_timeout_s (3600 s here)
        with pool.session("a6") as held:
            held.predict({"action": "echo"})
            with Pool() as other, pytest.raises(AdmissionTimeout) as info:
                other.predict("b6", {})
        message = str(info.value)
        assert "waited" in message and "6 GB" in message and "a6[0]" in message and "free now: GPU 0: 4 GB" in message


def test_memory_held_outside_the_pool_makes_admission_wait(pool_dir, monkeypatch, tmp_path):
    readings = tmp_path / "nvml.json"
    readings.write_text(json.dumps({"devices": [{"total_gb": 10, "free_gb": 2}]}))
    monkeypatch.setenv("RESIDENT_POOL_FAKE_NVML", str(readings))
    gpu_provider(pool_dir, "c3", 3)
    with Pool() as pool:
        client = run_client("c3", {"action": "echo", "value": "admitted"})
        wait_until(lambda: [w["slug"] for w in pool.waiting() if "needs_gb" in w] == ["c3"], message="c3 waiting")
        assert client.poll() is None
        readings.write_text(json.dumps({"devices": [{"total_gb": 10, "free_gb": 9}]}))  # the outsider let go
        assert finish(client)["result"]["echo"] == "admitted"


def test_a_killed_pool_leaves_no_gpu_held_and_the_next_client_starts_afresh(pool_dir, monkeypatch, isolated_dirs):
    monkeypatch.setenv("RESIDENT_POOL_GPU_CAPACITY_GB", "10")
    monkeypatch.setenv("RESIDENT_POOL_ORPHAN_GRACE_S", "1")  # the orphan retires within the test
    monkeypatch.setenv("RESIDENT_POOL_HEARTBEAT_STALE_S", "2")
    gpu_provider(pool_dir, "a6", 6)
    first = finish(run_client("a6", {"action": "echo"}))["result"]["pid"]
    pool_pid = int(Path(isolated_dirs["state"], "pool.pid").read_text())
    os.kill(pool_pid, signal.SIGKILL)
    wait_until(lambda: not pid_alive(first), timeout=15, message="the orphaned worker to retire itself")
    second = finish(run_client("a6", {"action": "echo"}))["result"]["pid"]
    assert second != first
    with Pool() as pool:
        state = pool.status()
    assert state["pool"]["pid"] != pool_pid
    assert [(e["slug"], e["pid"]) for e in state["ledger"]] == [("a6", second)]


HOLDER = textwrap.dedent(
    """
    import signal
    from resident_pool import Pool
    pool = Pool()
    with pool.session("echo") as session:
        session.predict({"hello": 1})
        print("holding", flush=True)
        signal.pause()  # hold the session until the test kills this process
    """
)


def test_a_killed_client_gives_its_worker_back_at_once(pool_dir):
    copy_echo(pool_dir)
    (pool_dir / "echo" / "manifest.toml").write_text(
        (pool_dir / "echo" / "manifest.toml").read_text().replace("max_replicas = 4", "max_replicas = 1"))
    with subprocess.Popen([sys.executable, "-c", HOLDER], stdout=subprocess.PIPE, text=True) as holder:
        assert holder.stdout.readline().strip() == "holding"
        holder.kill()
    killed = time.monotonic()
    with Pool() as pool:
        assert pool.predict("echo", {"after": 1})["echo"] == {"after": 1}
    assert time.monotonic() - killed < 2.0


def test_a_refusing_provider_costs_one_start_then_fails_fast(pool_dir):
    write_provider(pool_dir, "refuser", 'worker_args = ["{socket}", "--exit-before-bind", "3"]\n')
    with Pool() as pool:
        with pytest.raises(WorkerStartError) as first:
            pool.predict("refuser", {})
        assert first.value.exit_code == 3 and "refusal" in str(first.value)
        started = time.monotonic()
        for _ in range(100):
            with pytest.raises(WorkerStartError) as again:
                pool.predict("refuser", {})
            assert again.value.exit_code == 3 and "breaker" in str(again.value)
        assert time.monotonic() - started < 10
        breaker = pool.status()["breakers"]["refuser"]
    assert breaker["open"] and breaker["refused"] == 100 and breaker["failures"] == 1
    assert len(list(Path(os.environ["RESIDENT_POOL_LOG_DIR"]).glob("refuser-*.log"))) == 1  # one start only


def test_two_replicas_serve_two_requests_at_the_same_time(pool_dir):
    write_provider(pool_dir, "twin", "[lifecycle]\nmax_replicas = 2\n")
    with Pool() as pool:
        pool.predict("twin", {"action": "echo"})  # one warm replica
        results = []
        threads = [threading.Thread(target=lambda: results.append(pool.predict("twin", {"action": "sleep", "seconds": 1.5})))
                   for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        replicas = {w["replica"] for w in pool.status()["workers"]}
    first, second = sorted(results, key=lambda r: r["started"])
    assert first["pid"] != second["pid"] and replicas == {0, 1}
    assert second["started"] < first["ended"]  # they overlapped


def test_the_pool_socket_is_0600_and_an_open_state_dir_is_refused(pool_dir, isolated_dirs):
    copy_echo(pool_dir)
    with Pool() as pool:
        pool.predict("echo", {})
        assert stat.S_IMODE(os.stat(pool.socket_path).st_mode) == 0o600
    shutdown = Pool(start=False)
    shutdown.shutdown()
    shutdown.close()
    os.chmod(isolated_dirs["state"], 0o777)
    with pytest.raises(StateDirError, match="chmod 700"):
        Pool()
    os.chmod(isolated_dirs["state"], 0o700)
    os.chown(isolated_dirs["state"], 65534, -1)
    with pytest.raises(StateDirError, match="owned by uid 65534"):
        Pool()
    os.chown(isolated_dirs["state"], os.getuid(), -1)


def test_a_warm_pool_predict_is_one_round_trip_to_the_worker_and_asks_the_pool_nothing(pool_dir, monkeypatch):
    write_provider(pool_dir, "kept", "")
    with Pool() as pool:
        first = pool.predict("kept", {"action": "echo"})
        asked = []
        original = Pool._call

        def counting(self, message, *args, **kwargs):
            asked.append(message["op"])
            return original(self, message, *args, **kwargs)

        monkeypatch.setattr(Pool, "_call", counting)
        second = pool.predict("kept", {"action": "echo"})
        monkeypatch.setattr(Pool, "_call", original)
        (worker,) = pool.status()["workers"]
    assert second["pid"] == first["pid"] and [op for op in asked if op != "used"] == []
    assert worker["state"] == "leased" and worker["lease"]["kept"]  # held between calls, idle all the same
    assert worker["idle_s"] >= 0 and not worker["lease"]["recalling"]


@pytest.mark.smoke
def test_a_client_that_waits_takes_the_kept_lease_back_and_its_holder_acquires_again_unseen(pool_dir, monkeypatch):
    write_provider(pool_dir, "one", "")  # max_replicas = 1: the second client can only have the same worker
    with Pool() as holder:
        pid = holder.predict("one", {"action": "echo"})["pid"]
        answer = finish(run_client("one", {"action": "echo", "value": "other"}))  # another process, at once
        assert answer["result"]["pid"] == pid and answer["result"]["echo"] == "other"
        asked = []
        original = Pool._call
        monkeypatch.setattr(Pool, "_call", lambda self, m, *args, **kwargs: asked.append(m["op"]) or original(
            self, m, *args, **kwargs))
        again = holder.predict("one", {"action": "echo", "value": "holder again"})  # its lease was taken back
    assert again["pid"] == pid and again["echo"] == "holder again"
    assert asked.count("acquire") == 1  # refused as recalled by the worker, then acquired again
