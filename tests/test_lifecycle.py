"""One owner of a worker's life: regressions for what the pool did to workers its clients were using.

Real pool, client and worker processes. Each test keeps the defaults a user gets unless its
name says which setting it changes and why.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
from pathlib import Path

import pytest
from helpers import wait_until
from providers import write_provider

from resident_pool import Pool, WorkerRequestError
from resident_pool.procs import pid_alive

pytestmark = pytest.mark.reliability  # `make reliability` prints these rows too


def _pool_pid(isolated_dirs) -> int:
    return int(Path(isolated_dirs["state"], "pool.pid").read_text())


def _threads(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise AssertionError(f"no Threads line for pid {pid}")


def _worker(pool: Pool, slug: str) -> dict:
    (worker,) = [w for w in pool.status()["workers"] if w["slug"] == slug]
    return worker


def test_a_session_longer_than_a_short_idle_timeout_keeps_its_worker(pool_dir, reliability_row):
    """idle_timeout_s = 2 with 1.5 s requests: the session outlasts the timeout, the worker must not."""
    write_provider(pool_dir, "slow", "[lifecycle]\nidle_timeout_s = 2\n")
    with Pool() as pool, pool.session("slow") as session:
        pids = {session.predict({"action": "sleep", "seconds": 1.5})["pid"] for _ in range(3)}
    assert len(pids) == 1
    reliability_row('session longer than idle_timeout_s', '3 x 1.5 s on idle_timeout_s = 2: all answered by one worker')


def test_one_request_longer_than_a_short_idle_timeout_is_not_cut_off(pool_dir, reliability_row):
    """idle_timeout_s = 2 with one 5 s request: a request in flight is never idle."""
    write_provider(pool_dir, "slow", "[lifecycle]\nidle_timeout_s = 2\n")
    with Pool() as pool:
        answer = pool.predict("slow", {"action": "sleep", "seconds": 5})
    assert answer["slept"] == 5
    # Before the fix the stop was decided 2 s in and landed ~35 s later; the decision is the bug.
    assert not _transcript_has("slow", "retiring")
    reliability_row('request longer than idle_timeout_s', '5 s on idle_timeout_s = 2: answered; no retirement decided')


def test_an_idle_worker_is_still_retired_after_its_idle_timeout_of_two_seconds(pool_dir):
    """idle_timeout_s = 2 so the retirement is seen within the test."""
    write_provider(pool_dir, "slow", "[lifecycle]\nidle_timeout_s = 2\n")
    with Pool() as pool:
        pid = pool.predict("slow", {"action": "echo"})["pid"]
        wait_until(lambda: not pid_alive(pid), timeout=15, message="the idle worker to retire")
        wait_until(lambda: not [w for w in pool.status()["workers"] if w["slug"] == "slow"], timeout=10,
                   message="the retired replica to leave the status")
        assert _transcript_has("slow", "idle for")


def test_an_edited_manifest_is_served_by_a_new_worker_and_the_old_one_drains(pool_dir, reliability_row):
    manifest = write_provider(pool_dir, "edited", 'worker_args = ["{socket}"]\n')
    with Pool() as pool, Pool() as other:
        with pool.session("edited") as held:
            old = held.predict({"action": "echo"})["pid"]
            manifest.write_text(manifest.read_text().replace('["{socket}"]', '["{socket}", "--v2"]'))
            fresh = other.predict("edited", {"action": "echo"})["pid"]
            assert fresh != old
            assert held.predict({"action": "echo"})["pid"] == old  # the old lease still finishes its work
            assert _state(pool, old) == "draining"
        wait_until(lambda: not pid_alive(old), timeout=30, message="the old version's worker to stop")
        assert other.predict("edited", {"action": "echo"})["pid"] == fresh
        wait_until(lambda: len({w["version"] for w in pool.status()["workers"] if w["slug"] == "edited"}) == 1,
                   timeout=10, message="only the new version left in the status")
    reliability_row('manifest edited while a worker is leased', 'new requests on the new version; the old lease finished, then its worker stopped')


def _state(pool: Pool, pid: int) -> str | None:
    for worker in pool.status()["workers"]:
        if worker["pid"] == pid:
            return worker["state"]
    return None


def test_a_lifecycle_only_edit_keeps_the_warm_worker(pool_dir, reliability_row):
    manifest = write_provider(pool_dir, "tuned", "[lifecycle]\nidle_timeout_s = 600\n")
    with Pool() as pool:
        first = pool.predict("tuned", {"action": "echo"})["pid"]
        version = _worker(pool, "tuned")["version"]
        manifest.write_text('description = "retuned"\n'
                            + manifest.read_text().replace("idle_timeout_s = 600", "idle_timeout_s = 900"))
        assert pool.predict("tuned", {"action": "echo"})["pid"] == first
        assert _worker(pool, "tuned")["version"] == version
    reliability_row('lifecycle-only manifest edit', 'same warm worker, same version')


def test_a_request_past_a_one_second_request_timeout_names_slug_timeout_and_transcript(pool_dir, reliability_row):
    """request_timeout_s = 1 so the timeout is reached within the test."""
    from resident_pool.errors import RequestTimeout

    write_provider(pool_dir, "hung", "[lifecycle]\nrequest_timeout_s = 1\n")
    with Pool() as pool:
        with pytest.raises(RequestTimeout) as info:
            pool.predict("hung", {"action": "sleep", "seconds": 30})
        error = info.value
        assert isinstance(error, TimeoutError) and isinstance(error, WorkerRequestError)
        assert error.slug == "hung" and error.reason == "request_timeout"
        assert "request_timeout_s = 1" in str(error) and error.transcript in str(error)
        assert Path(error.transcript).is_file()
        assert pool.predict("hung", {"action": "echo"})["echo"] is None  # a fresh worker serves the next
    reliability_row('request past request_timeout_s', 'RequestTimeout naming slug, timeout, transcript; next served by a fresh worker')


KILLED_MID_REQUEST = textwrap.dedent(
    """
    import json, sys
    from resident_pool import Pool
    pool = Pool()
    with pool.session(sys.argv[1]) as session:
        print(json.dumps({"pid": session.pid}), flush=True)
        session.predict({"action": "sleep", "seconds": float(sys.argv[2]), "marker": sys.argv[3]})
    """
)


def _abandon(slug: str, seconds: float, marker: Path) -> int:
    """A client that starts a long request and is SIGKILLed 1 s into it; returns the worker's pid."""
    with subprocess.Popen([sys.executable, "-c", KILLED_MID_REQUEST, slug, str(seconds), str(marker)],
                          stdout=subprocess.PIPE, text=True) as client:
        pid = json.loads(client.stdout.readline())["pid"]
        wait_until(lambda: _transcript_has(slug, "action sleep"), timeout=10, message="the request to start")
        client.kill()
    return pid


def _transcript_has(slug: str, text: str) -> bool:
    logs = Path(os.environ["RESIDENT_POOL_LOG_DIR"])
    return any(text in path.read_text(errors="replace") for path in logs.glob(f"{slug}-*.log"))


def test_a_client_killed_mid_request_leaves_its_worker_draining_until_the_request_ends(pool_dir, tmp_path, reliability_row):
    write_provider(pool_dir, "solo", "")
    marker = tmp_path / "abandoned-finished"
    with Pool() as pool:
        pid = _abandon("solo", 4, marker)
        wait_until(lambda: _state(pool, pid) == "draining", timeout=5, message="the worker to show draining")
        answer = pool.predict("solo", {"action": "echo"})  # waits for the worker to be free
        assert marker.exists()  # the abandoned request finished before this one was served
        assert answer["pid"] == pid and _state(pool, pid) == "ready"
    reliability_row('client SIGKILL mid-request', 'worker shown draining; next client served once the abandoned request ended')


def test_an_abandoned_request_past_a_one_second_abandon_grace_stops_the_worker(pool_dir, tmp_path, reliability_row):
    """abandon_grace_s = 1 so the grace runs out within the test."""
    write_provider(pool_dir, "solo", "[lifecycle]\nabandon_grace_s = 1\n")
    marker = tmp_path / "never"
    with Pool() as pool:
        pid = _abandon("solo", 120, marker)
        wait_until(lambda: not pid_alive(pid), timeout=20, message="the abandoned worker to be stopped")
        assert pool.predict("solo", {"action": "echo"})["pid"] != pid
    assert not marker.exists()
    reliability_row('abandoned request past abandon_grace_s', 'worker stopped, GPU given back; next served by a new worker')


@pytest.mark.parametrize("option", ["--load-seconds 4", "--non-daemon-thread"])
def test_a_pool_killed_while_its_worker_loads_or_holds_a_stray_thread_leaks_no_worker(
        pool_dir, isolated_dirs, monkeypatch, option, reliability_row):
    """orphan_grace_s = 1 (and a 2 s heartbeat) so the orphaned worker retires within the test."""
    monkeypatch.setenv("RESIDENT_POOL_ORPHAN_GRACE_S", "1")
    monkeypatch.setenv("RESIDENT_POOL_HEARTBEAT_STALE_S", "2")
    write_provider(pool_dir, "loader", f'worker_args = ["{{socket}}", "{option.split()[0]}"'
                   + (f', "{option.split()[1]}"' if " " in option else "") + "]\n")
    client = subprocess.Popen([sys.executable, "-c", "from resident_pool import Pool; Pool().predict('loader', {})"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: _transcript_has("loader", "testworker pid"), timeout=15, message="the worker to start")
        worker_pid = int(next(Path(isolated_dirs["logs"]).glob("loader-*.log")).read_text()
                         .split("testworker pid ")[1].split()[0])
        if option == "--non-daemon-thread":
            wait_until(lambda: _transcript_has("loader", "listening on"), timeout=15, message="serve()")
        os.kill(_pool_pid(isolated_dirs), signal.SIGKILL)
    finally:
        client.kill()
        client.wait()
    wait_until(lambda: not pid_alive(worker_pid), timeout=30, message="the orphaned worker to exit")
    reliability_row(f"pool SIGKILL while its worker {'loads its model' if 'load' in option else 'runs a stray thread'}",
                    "the orphaned worker saw the heartbeat stop and exited")


def test_starting_and_stopping_workers_leaks_no_pool_thread(pool_dir, isolated_dirs, reliability_row):
    write_provider(pool_dir, "cycled", "")
    with Pool() as pool:
        pool.predict("cycled", {"action": "echo"})
        pool.stop("cycled")
        pool_pid = _pool_pid(isolated_dirs)
        before = _threads(pool_pid)
        for _ in range(12):
            pool.predict("cycled", {"action": "echo"})
            pool.stop("cycled")
        wait_until(lambda: _threads(pool_pid) <= before, timeout=10,
                   message=f"the pool's threads to fall back to {before}")
    reliability_row('12 worker starts and stops', 'pool threads back to where they were')


def test_an_error_in_acquire_that_is_not_the_librarys_own_is_answered_and_frees_the_provider(pool_dir, tmp_path, reliability_row):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    manifest = write_provider(pool_dir, "broken", f'work_root = "{blocker}/work"\n')
    with Pool() as pool:
        with pytest.raises(Exception) as info:
            pool.predict("broken", {"action": "echo"})
        assert "broken" in str(info.value) and str(blocker) in str(info.value)
        assert type(info.value).__module__.startswith("resident_pool")
        manifest.write_text(manifest.read_text().replace(f'work_root = "{blocker}/work"\n', ""))
        assert pool.predict("broken", {"action": "echo"})["echo"] is None  # nothing left held
    reliability_row('foreign error in acquire (work_root unusable)', 'WorkerStartError naming the path; the provider served once fixed')


def test_an_over_long_socket_path_is_a_named_error_not_a_dropped_connection(pool_dir, monkeypatch, tmp_path, reliability_row):
    from resident_pool.client import shutdown_pool

    # The pool's own socket fits under this state directory; a worker's, a 40-character slug deeper, does not.
    long_state = Path(tempfile.mkdtemp(prefix="rp-")) / ("long" * 15)
    monkeypatch.setenv("RESIDENT_POOL_STATE_DIR", str(long_state))
    write_provider(pool_dir, "x" * 40, "")
    try:
        with Pool() as pool:
            with pytest.raises(Exception, match="AF_UNIX limit") as info:
                pool.predict("x" * 40, {"action": "echo"})
            assert type(info.value).__module__.startswith("resident_pool") and "x" * 40 in str(info.value)
            assert pool.status()["workers"] == []  # nothing half-made is left held
    finally:
        shutdown_pool()
    reliability_row('worker socket path over the AF_UNIX limit', 'StateDirError naming the path; nothing left held')


def test_ready_raising_is_answered_and_the_worker_serves(pool_dir, reliability_row):
    write_provider(pool_dir, "shaky", 'worker_args = ["{socket}", "--ready-raises"]\n')
    with Pool() as pool:
        assert pool.predict("shaky", {"action": "echo", "value": 7})["echo"] == 7
        assert _worker(pool, "shaky")["state"] == "ready"
    reliability_row('ready() raises in the worker', 'answered with ready_error; the worker serves')


def test_two_starts_in_the_same_second_write_two_transcripts(pool_dir, isolated_dirs):
    write_provider(pool_dir, "twice", "")
    with Pool() as pool:
        pool.predict("twice", {"action": "echo"})
        pool.stop("twice")
        pool.predict("twice", {"action": "echo"})
    transcripts = list(Path(isolated_dirs["logs"]).glob("twice-*.log"))
    assert len(transcripts) == 2
    assert all(path.read_text().count("testworker pid") == 1 for path in transcripts)


def test_a_keyboard_interrupt_exit_is_named_by_its_signal(pool_dir, reliability_row):
    write_provider(pool_dir, "interrupted", "")
    with Pool() as pool, pytest.raises(WorkerRequestError) as info:
        pool.predict("interrupted", {"action": "interrupt"})
    assert info.value.reason == "worker_exiting"
    assert info.value.exit_code == -signal.SIGINT
    assert "exit code unknown" not in str(info.value) and "SIGINT" in str(info.value)
    reliability_row('KeyboardInterrupt in a prediction', 'worker_exiting, killed by SIGINT named')


def test_a_worker_that_stops_answering_is_stopped_by_a_one_second_liveness_ping(pool_dir, reliability_row):
    """ping_interval_s = 1 so the liveness check runs within the test."""
    write_provider(pool_dir, "frozen", "[lifecycle]\nping_interval_s = 1\n")
    with Pool() as pool:
        pid = pool.predict("frozen", {"action": "echo"})["pid"]
        os.kill(pid, signal.SIGSTOP)  # alive, but answering nothing
        try:
            wait_until(lambda: not pid_alive(pid), timeout=30, message="the frozen worker to be stopped")
        finally:
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
        wait_until(lambda: "liveness" in (pool.status()["providers"]["frozen"]["last_error"] or ""), timeout=10,
                   message="the last error to be recorded")
    reliability_row('idle worker stops answering (SIGSTOP)', 'stopped by the liveness ping; last error recorded')


def test_sigterm_to_the_pool_lets_a_leased_request_finish_then_stops_every_worker(pool_dir, isolated_dirs, reliability_row):
    write_provider(pool_dir, "steady", "")
    results = []
    with Pool() as pool:
        pid = pool.predict("steady", {"action": "echo"})["pid"]
        pool_pid = _pool_pid(isolated_dirs)
        thread = threading.Thread(target=lambda: results.append(
            pool.predict("steady", {"action": "sleep", "seconds": 3})))
        thread.start()
        wait_until(lambda: _transcript_has("steady", "action sleep"), timeout=10, message="the request to start")
        os.kill(pool_pid, signal.SIGTERM)
        thread.join(timeout=60)
    assert results and results[0]["slept"] == 3
    wait_until(lambda: not pid_alive(pool_pid), timeout=30, message="the pool to exit")
    assert not pid_alive(pid)
    reliability_row('SIGTERM to the pool mid-request', 'the leased request finished; then every worker stopped and the pool exited')


def test_a_client_of_another_version_is_told_both_versions_and_the_fix(pool_dir, monkeypatch, reliability_row):
    import resident_pool.client as client_module

    write_provider(pool_dir, "busy", "")
    with Pool() as pool, pool.session("busy") as held:
        held.predict({"action": "echo"})
        monkeypatch.setattr(client_module, "__version__", "0.0.0-other")
        with Pool() as stranger, pytest.raises(Exception, match=r"0\.0\.0-other") as info:
            stranger.predict("busy", {"action": "echo"})
        assert "resident-pool stop --all" in str(info.value)
    reliability_row('client of another version, pool busy', 'error naming both versions and `resident-pool stop --all`')


def test_a_subprocess_mode_worker_serves_one_lease_and_is_never_handed_out_again(pool_dir, reliability_row):
    write_provider(pool_dir, "oneshot", 'mode = "subprocess"\nmode_reason = "cannot be held between requests"\n')
    with Pool() as pool:
        pids = [pool.predict("oneshot", {"action": "echo"})["pid"] for _ in range(4)]
    assert len(set(pids)) == 4, f"a worker served {4 - len(set(pids)) + 1} back-to-back requests: {pids}"
    reliability_row("subprocess-mode requests back to back", "a fresh worker for each one")
