"""`resident-pool status` as an operator reads it, and the pool's readiness and watchdog under systemd."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time

from helpers import configured, wait_until
from providers import write_provider

from resident_pool import Pool, WorkerStartError
from resident_pool.providers.manifest import load_manifest


def _cli(*args):
    # A wide terminal, so the tables are read whole rather than folded.
    return subprocess.run([sys.executable, "-m", "resident_pool", *args], capture_output=True, text=True, timeout=120,
                          check=False, env={**os.environ, "COLUMNS": "400"})


def test_status_require_exits_1_when_no_pool_runs_and_plain_status_does_not(pool_dir):
    plain, required = _cli("status"), _cli("status", "--require")
    assert plain.returncode == 0 and "no pool is running" in plain.stdout
    assert required.returncode == 1 and "no pool is running" in required.stdout
    assert _cli("status", "--json", "--require").returncode == 1
    write_provider(pool_dir, "present", "")
    with Pool() as pool:
        pool.status()  # starts the pool
        assert _cli("status", "--require").returncode == 0


def test_status_shows_fingerprint_request_age_known_providers_and_the_last_error(pool_dir):
    write_provider(pool_dir, "busy", "")
    write_provider(pool_dir, "idle-never-run", '[gpu]\npolicy = "required"\nvram_budget_gb = 3\n')
    write_provider(pool_dir, "broken", 'worker_args = ["{socket}", "--exit-before-bind", "2"]\n')
    (pool_dir / "unreadable").mkdir()
    (pool_dir / "unreadable" / "manifest.toml").write_text("slug = \n")
    with Pool() as pool:
        try:
            pool.predict("broken", {})
        except WorkerStartError:
            pass
        with pool.session("busy") as session:
            release = pool_dir / "release"  # the request runs until the test has seen it: a slow CLI never misses it
            request = threading.Thread(target=session.predict,
                                       args=({"action": "hold", "until": str(release), "seconds": 60},))
            request.start()

            def aged():
                (row,) = [w for w in json.loads(_cli("status", "--json").stdout)["workers"] if w["slug"] == "busy"]
                return row if (row["in_flight_s"] or 0) >= 1 else None

            row = wait_until(aged, timeout=20, interval=0.2, message="the request in flight to show its age")
            human = _cli("status").stdout
            release.touch()
            request.join()
    assert row["fingerprint"] == load_manifest(pool_dir / "busy" / "manifest.toml").fingerprint()
    assert row["state"] == "leased" and row["lease"]["age_s"] >= row["in_flight_s"]
    providers = json.loads(_cli("status", "--json").stdout)["providers"]
    assert providers["idle-never-run"]["running"] == 0 and providers["idle-never-run"]["budget_gb"] == 3
    assert "exit code 2" in providers["broken"]["last_error"]
    assert "not valid TOML" in providers["unreadable"]["last_error"]
    for expected in ("fingerprint", "in_flight", "idle-never-run", "exit code 2", row["fingerprint"][:8]):
        assert expected in human



def test_a_kept_lease_between_calls_shows_as_idle_and_in_use_while_its_request_runs(pool_dir):
    """Pool.predict's kept lease holds its worker between calls, and the pool counts it idle then (it retires,
    evicts or recalls it as a ready one): status said plain "leased", as for a session's worker, and Pool.status()
    gave no way to tell the two apart."""
    write_provider(pool_dir, "kept", "")
    with Pool() as pool:
        pool.predict("kept", {"action": "echo"})
        (row,) = pool.status()["workers"]
        human = _cli("status").stdout
        assert row["state"] == "leased" and row["lease"]["kept"] and row["idle"] is True
        assert "leased (kept lease, idle)" in human
        # Another thread's call waits for the one replica: the idle kept lease is recalled, and its new kept lease
        # runs a request, which is not idle.
        call = threading.Thread(target=pool.predict, args=("kept", {"action": "sleep", "seconds": 6}))
        call.start()

        def busy():
            (row,) = pool.status()["workers"]
            return row if row["in_flight_s"] is not None and row["lease"] and row["lease"]["kept"] else None

        row = wait_until(busy, timeout=20, interval=0.1, message="the other thread's request to run")
        human = _cli("status").stdout
        call.join()
    assert row["idle"] is False and "leased (kept lease, in use)" in human


def test_a_session_s_worker_is_never_shown_idle(pool_dir):
    """A session's lease is the strong one: its worker is leased, not idle, between its requests too."""
    write_provider(pool_dir, "held", "")
    with Pool() as pool, pool.session("held") as session:
        session.predict({"action": "echo"})
        (row,) = pool.status()["workers"]
        human = _cli("status").stdout
    assert row["state"] == "leased" and row["idle"] is False and row["lease"]["kept"] is False
    assert "kept lease" not in human


def test_the_daemon_tells_systemd_it_is_ready_pings_its_watchdog_and_says_when_it_stops(pool_dir, tmp_path):
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(tmp_path / "notify"))
    notify.settimeout(20)
    env = {**os.environ, "NOTIFY_SOCKET": str(tmp_path / "notify"), "WATCHDOG_USEC": "1000000"}
    daemon = subprocess.Popen([sys.executable, "-m", "resident_pool", "daemon"], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        messages = []
        while sum(m == "WATCHDOG=1" for m in messages) < 2:
            messages.append(notify.recv(4096).decode())
        assert messages[0].startswith("READY=1") and f"MAINPID={daemon.pid}" in messages[0]
        daemon.send_signal(signal.SIGTERM)
        while "STOPPING=1" not in messages:
            messages.append(notify.recv(4096).decode())
        assert daemon.wait(timeout=30) == 0
    finally:
        if daemon.poll() is None:
            daemon.kill()
            daemon.wait()
        notify.close()


def test_a_worker_that_puts_a_fifo_or_a_link_where_its_start_time_goes_cannot_hang_or_redirect_status(tmp_path):
    from resident_pool.providers.worker_process import WorkerProcess
    from resident_pool.worker_base import IN_FLIGHT_FILE

    process = WorkerProcess("hostile", 0, paths=configured()[1], kill_grace_s=configured()[0].kill_grace_s)
    process.run_dir.mkdir(mode=0o700)
    board = process.run_dir / IN_FLIGHT_FILE
    try:
        os.mkfifo(board)
        answered = []
        reader = threading.Thread(target=lambda: answered.append(process.in_flight_s()), daemon=True)
        reader.start()
        reader.join(timeout=5)
        assert answered == [None]
        board.unlink()
        (tmp_path / "elsewhere").write_bytes(struct.pack("d", time.time() - 60))  # would read as 60 s if followed
        board.symlink_to(tmp_path / "elsewhere")
        assert process.in_flight_s() is None
    finally:
        shutil.rmtree(process.run_dir)
