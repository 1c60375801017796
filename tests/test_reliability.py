"""Faults, load and soak against the whole pool: what the caller sees, nothing lost, nothing leaked.

`make reliability` runs this file alone and prints the table; `make test` runs it but load and soak.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from helpers import wait_until
from providers import write_provider

from resident_pool import Pool, RequestTimeout, WorkerRequestError, WorkerStartError
from resident_pool.errors import ResidentPoolError
from resident_pool.host.procs import pid_alive

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.reliability
# Load and soak (marked soak) run under `make reliability` only, at full size there; FULL=0 gives a quick run by hand.
FULL = os.environ.get("RESIDENT_POOL_FULL_RELIABILITY") == "1"


def _after_fault_clean(pool: Pool, state_dir: str) -> None:
    """No ledger entry for a dead pid, no socket without a live worker behind it."""
    state = pool.status()
    assert all(pid_alive(entry["pid"]) for entry in state["ledger"])
    live = {Path(w["socket"]).parent.name for w in state["workers"] if w["pid"]}
    workers_dir = Path(state_dir) / "w"
    run_dirs = set(os.listdir(workers_dir)) if workers_dir.is_dir() else set()
    assert run_dirs <= live, f"worker folders (socket, heartbeat) without a live worker: {run_dirs - live}"


WORKER_FAULTS = [
    ("worker SIGKILL mid-request", {"action": "sigkill"}, WorkerRequestError, "worker_died", "SIGKILL"),
    ("worker segfault (native crash)", {"action": "segfault"}, WorkerRequestError, "worker_died", "SIGSEGV"),
    ("worker abort mid-request", {"action": "abort"}, WorkerRequestError, "worker_died", "SIGABRT"),
    ("worker exits 5 inside a prediction", {"action": "exit", "code": 5}, WorkerRequestError, "worker_exiting",
     "exit code 5"),
    ("worker exits 3 inside a prediction", {"action": "exit", "code": 3}, WorkerRequestError, "worker_exiting",
     "exit code 3"),
    ("worker hangs past request_timeout_s", {"action": "sleep", "seconds": 60}, RequestTimeout, "request_timeout",
     "request_timeout_s = 1"),
]


@pytest.mark.parametrize(("fault", "payload", "error", "reason", "words"), WORKER_FAULTS, ids=[f[0] for f in WORKER_FAULTS])
def test_worker_faults(pool_dir, isolated_dirs, reliability_row, fault, payload, error, reason, words):
    write_provider(pool_dir, "faulty", "[lifecycle]\nrequest_timeout_s = 1\n")
    with Pool() as pool:
        first = pool.predict("faulty", {"action": "echo"})["pid"]
        with pytest.raises(error) as info:
            pool.predict("faulty", payload)
        assert info.value.reason == reason
        assert words in str(info.value)
        wait_until(lambda: not pid_alive(first), timeout=10, message="the faulty worker to be gone")
        after = pool.predict("faulty", {"action": "echo", "value": "next"})
        assert after["echo"] == "next" and after["pid"] != first
        _after_fault_clean(pool, isolated_dirs["state"])
    reliability_row(fault, f"{type(info.value).__name__}({reason}); next request served")


def test_worker_exits_3_and_5_at_start(pool_dir, reliability_row):
    for code in (3, 5):
        write_provider(pool_dir, f"refuses{code}", f'worker_args = ["{{socket}}", "--exit-before-bind", "{code}"]\n')
    write_provider(pool_dir, "fine", "")
    with Pool() as pool:
        for code in (3, 5):
            with pytest.raises(WorkerStartError) as info:
                pool.predict(f"refuses{code}", {})
            assert info.value.exit_code == code
        assert pool.predict("fine", {"action": "echo", "value": 1})["echo"] == 1  # the pool serves the rest
    reliability_row("worker exits 3 / 5 at start", "WorkerStartError naming the code; breaker open; others served")


def test_stop_of_a_worker_that_ignores_sigterm_and_leaks_a_child(pool_dir, reliability_row):
    write_provider(pool_dir, "stubborn", 'worker_args = ["{socket}", "--ignore-term"]\n')
    with Pool() as pool:
        child = pool.predict("stubborn", {"action": "spawn_child"})["child"]
        pid = pool.status()["workers"][0]["pid"]
        assert pool.stop("stubborn") == ["stubborn[0]"]
        assert not pid_alive(pid)
        wait_until(lambda: not pid_alive(child), timeout=15, message="the leaked child to die with its worker")
    reliability_row("worker ignores SIGTERM; worker leaks a child", "stop escalates to SIGKILL of the group")


def test_a_lease_whose_worker_died_is_told_how_even_when_the_pool_saw_the_death_first(pool_dir):
    """A kept lease's release after a broken exchange races the pool's own look at its workers (a tick): when the pool
    saw the death first, the lease had already ended, and its answer said only "gone": the caller was told the
    connection broke, not that the worker was killed."""
    from resident_pool.messages import Release

    write_provider(pool_dir, "dies", "")
    with Pool() as pool:
        lease, _ = pool._acquire("dies", keep=True)  # Pool.predict's: the pool ends a kept lease with its worker
        os.kill(lease["pid"], signal.SIGKILL)
        wait_until(lambda: not pool.status()["workers"], timeout=10, message="the pool to see its worker die")
        time.sleep(1.0)  # the scene: a few of the pool's ticks (0.25 s) pass, and its look ends the lease
        answer = pool._call(Release(lease["lease"], "broken", 0).to_message())
    assert "SIGKILL" in answer.get("error", {}).get("error", ""), answer


def test_a_worker_killed_while_idle_leaves_no_stale_socket(pool_dir, isolated_dirs, reliability_row):
    write_provider(pool_dir, "stale", "")
    with Pool() as pool:
        pid = pool.predict("stale", {"action": "echo"})["pid"]
        (worker,) = pool.status()["workers"]
        os.kill(pid, signal.SIGKILL)  # idle: it cannot remove its socket itself
        wait_until(lambda: not os.path.exists(worker["socket"]), timeout=10, message="the pool to clear its socket")
        wait_until(lambda: "SIGKILL" in (pool.status()["providers"]["stale"]["last_error"] or ""), timeout=10,
                   message="the death to be recorded")
        assert pool.predict("stale", {"action": "echo"})["pid"] != pid
        _after_fault_clean(pool, isolated_dirs["state"])
    reliability_row("worker SIGKILL while idle", "the pool saw it within a tick, cleared its socket, recorded why; "
                    "next request served by a new worker")


CAMPAIGN = textwrap.dedent(
    """
    import json, sys, time
    from resident_pool import Pool
    answered = {}
    for n in range(int(sys.argv[1])):
        for attempt in range(50):
            try:
                pool = Pool()
                answered[n] = pool.predict("echo", {"n": n})["echo"]["n"]
                pool.close()
                break
            except OSError:  # the pool went away: the next Pool() starts a new one
                time.sleep(0.05)  # back off, then retry (50 attempts at most)
        print(n, flush=True)
    print(json.dumps(answered), flush=True)
    """
)


def test_pool_sigkill_during_a_campaign(pool_dir, isolated_dirs, reliability_row, monkeypatch):
    monkeypatch.setenv("RESIDENT_POOL_ORPHAN_GRACE_S", "1")  # orphans of the killed pool retire within the test
    monkeypatch.setenv("RESIDENT_POOL_HEARTBEAT_STALE_S", "2")
    shutil.copytree(ROOT / "manifests" / "echo", pool_dir / "echo")
    with subprocess.Popen([sys.executable, "-c", CAMPAIGN, "300"], stdout=subprocess.PIPE, text=True) as campaign:
        while int(campaign.stdout.readline()) < 100:
            pass
        first_pool = int(Path(isolated_dirs["state"], "pool.pid").read_text())
        os.kill(first_pool, signal.SIGKILL)
        lines = campaign.stdout.read().splitlines()
    answered = json.loads(lines[-1])
    assert sorted(int(n) for n in answered) == list(range(300))
    assert all(int(n) == value for n, value in answered.items())  # none crossed
    with Pool() as pool:
        assert pool.status()["pool"]["pid"] != first_pool
    reliability_row("pool SIGKILL during a campaign", "clients reconnected to a new pool", lost=300 - len(answered))


WAITER = textwrap.dedent(
    """
    from resident_pool import Pool
    print("asking", flush=True)
    Pool().predict("b6", {"action": "echo"})
    """
)


def test_client_sigkill_while_waiting_for_admission(pool_dir, reliability_row, monkeypatch):
    monkeypatch.setenv("RESIDENT_POOL_GPU_CAPACITY_GB", "10")
    for slug in ("a6", "b6"):
        write_provider(pool_dir, slug, '[gpu]\npolicy = "required"\nvram_budget_gb = 6\n')
    with Pool() as pool, pool.session("a6") as held:
        held.predict({"action": "echo"})
        with subprocess.Popen([sys.executable, "-c", WAITER], stdout=subprocess.PIPE, text=True) as waiter:
            waiter.stdout.readline()
            wait_until(lambda: [w["slug"] for w in pool.waiting() if "needs_gb" in w] == ["b6"], message="b6 queued")
            waiter.kill()
        killed = time.monotonic()
        # The killed client's queue place goes when the pool sees its connection close.
        wait_until(lambda: not [w for w in pool.waiting() if "needs_gb" in w], timeout=10, message="the place released")
        released_s = time.monotonic() - killed
    with Pool() as pool:
        assert pool.predict("b6", {"action": "echo", "value": "after"})["echo"] == "after"
    reliability_row("client SIGKILL while waiting for admission", "its queue place released",
                    released_s=round(released_s, 2))


def test_unwritable_transcript_directory(pool_dir, isolated_dirs, reliability_row):
    write_provider(pool_dir, "logless", "")
    shutil.copytree(ROOT / "manifests" / "echo", pool_dir / "echo")
    with Pool() as pool:
        pool.predict("echo", {})
        shutil.rmtree(isolated_dirs["logs"])
        Path(isolated_dirs["logs"]).write_text("a file where the transcripts should go")
        started = time.monotonic()
        with pytest.raises(ResidentPoolError, match=r"log directory \S+ (cannot be created|is not a plain directory)") as info:
            pool.predict("logless", {"action": "echo"})
        assert time.monotonic() - started < 10  # a clear error, not a hang
        assert "RESIDENT_POOL_LOG_DIR" in str(info.value)
    reliability_row("transcript directory unusable", f"{type(info.value).__name__}: names the directory and the fix")


def test_state_directory_deleted_under_a_running_pool(pool_dir, isolated_dirs, reliability_row):
    shutil.copytree(ROOT / "manifests" / "echo", pool_dir / "echo")
    with Pool() as pool:
        old_worker = pool.predict("echo", {})["pid"]
        old_pool = pool.status()["pool"]["pid"]
    shutil.rmtree(isolated_dirs["state"])
    wait_until(lambda: not pid_alive(old_pool), timeout=15, message="the orphaned pool to stand down")
    assert not pid_alive(old_worker)
    with Pool() as pool:
        assert pool.predict("echo", {"after": True})["echo"] == {"after": True}
        assert pool.status()["pool"]["pid"] != old_pool
    reliability_row("state directory deleted under a running pool", "old pool stands down; a new one serves")


RACER = textwrap.dedent(
    """
    from resident_pool import Pool
    with Pool() as pool:
        print(pool.status()["pool"]["pid"], flush=True)
    """
)


def test_two_pools_racing_to_start(pool_dir, reliability_row):
    racers = [subprocess.Popen([sys.executable, "-c", RACER], stdout=subprocess.PIPE, text=True) for _ in range(4)]
    pids = {int(racer.communicate(timeout=60)[0]) for racer in racers}
    assert len(pids) == 1
    reliability_row("four clients racing to start a pool", "one pool started")


LOAD_CLIENT = textwrap.dedent(
    """
    import json, sys, time
    from resident_pool import Pool
    me, count = int(sys.argv[1]), int(sys.argv[2])
    pool = Pool()
    latencies, crossed, pids = [], 0, set()
    for n in range(count):
        started = time.perf_counter()
        answer = pool.predict("twin", {"action": "echo", "value": [me, n]})
        latencies.append(time.perf_counter() - started)
        crossed += answer["echo"] != [me, n]
        pids.add(answer["pid"])
    print(json.dumps({"latencies": latencies, "crossed": crossed, "pids": sorted(pids)}))
    """
)


@pytest.mark.soak
@pytest.mark.timeout(600)
def test_load_64_clients_over_2_replicas(pool_dir, reliability_row):
    write_provider(pool_dir, "twin", "[lifecycle]\nmax_replicas = 2\n")
    clients, per_client = (64, 200) if FULL else (16, 100)
    with Pool() as pool:
        pool.predict("twin", {"action": "echo"})
    started = time.monotonic()
    procs = [subprocess.Popen([sys.executable, "-c", LOAD_CLIENT, str(me), str(per_client)], stdout=subprocess.PIPE,
                              text=True) for me in range(clients)]
    results = [json.loads(proc.communicate(timeout=500)[0]) for proc in procs]
    elapsed = time.monotonic() - started
    latencies = [x for r in results for x in r["latencies"]]
    assert len(latencies) == clients * per_client  # every request answered
    assert sum(r["crossed"] for r in results) == 0
    with Pool() as pool:
        workers = pool.status()["workers"]
    assert len(workers) == 2 and sum(w["served"] for w in workers) == clients * per_client + 1
    p99 = sorted(latencies)[int(0.99 * len(latencies))]
    reliability_row(f"load: {clients} processes x {per_client} requests, 2 replicas", "all answered once, none crossed",
                    throughput_per_s=round(len(latencies) / elapsed), p50_ms=round(statistics.median(latencies) * 1e3, 2),
                    p99_ms=round(p99 * 1e3, 2))


def _rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _fd_targets(pid: int) -> list[str]:
    """What each open descriptor is, for a message that says which one grew."""
    targets = []
    for fd in sorted(os.listdir(f"/proc/{pid}/fd"), key=int):
        try:
            targets.append(f"{fd}={os.readlink(f'/proc/{pid}/fd/{fd}')}")
        except OSError:
            pass  # closed while listed
    return targets


@pytest.mark.soak
@pytest.mark.timeout(900)
@pytest.mark.parametrize(("slug", "count", "payload"), [("echo", 50_000 if FULL else 10_000, {"x": "MKV" * 10}),
                                                        ("minilm", 2_000 if FULL else 400,
                                                         {"inputs": ["MKTAYIAKQRQISFVKSHFSRQ"]})])
def test_soak(pool_dir, reliability_row, slug, count, payload):
    shutil.copytree(ROOT / "manifests" / slug, pool_dir / slug)
    with Pool() as pool:
        for _ in range(200):  # past warm-up allocations
            pool.predict(slug, payload)
        state = pool.status()
        pool_pid, worker_pid = state["pool"]["pid"], state["workers"][0]["pid"]
        before = (_rss_kb(pool_pid), _rss_kb(worker_pid), _fds(pool_pid), _fds(worker_pid))
        before_targets = _fd_targets(pool_pid)
        with pool.session(slug) as session:
            for _ in range(count // 2):
                session.predict(payload)
        for _ in range(count - count // 2):
            pool.predict(slug, payload)
        # The pool closes the last request's connection on its own thread, a moment after the client has its reply.
        try:
            wait_until(lambda: _fds(pool_pid) <= before[2] and _fds(worker_pid) <= before[3], timeout=15,
                       message="the last connections to close")
        except AssertionError:
            pass  # the assertion below says which count grew
        after = (_rss_kb(pool_pid), _rss_kb(worker_pid), _fds(pool_pid), _fds(worker_pid))
        after_targets = _fd_targets(pool_pid)
    pool_growth, worker_growth = (after[0] - before[0]) / 1024, (after[1] - before[1]) / 1024
    assert after[2:] == before[2:], (f"open fds grew: {before[2:]} -> {after[2:]}; the pool's before: "
                                     f"{before_targets}, after: {after_targets}")
    assert pool_growth < 2 and worker_growth < 2
    reliability_row(f"soak: {count} requests on {slug}", "fds unchanged", pool_rss_growth_mb=round(pool_growth, 2),
                    worker_rss_growth_mb=round(worker_growth, 2), fds=f"{before[2]}/{before[3]}")
