"""The supervisor against real worker processes on real sockets."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from helpers import TEST_WORKER, both_ways, configured, wait_until, worker_command
from providers import write_provider

from resident_pool import AdmissionRefused, RequestTimeout, WorkerRequestError, WorkerStartError, child_env, exit_hint
from resident_pool.host.procs import pid_alive
from resident_pool.providers.launch import worker_for
from resident_pool.providers.manifest import load_manifest
from resident_pool.providers.worker_states import WorkerState


@both_ways
def test_first_request_starts_the_worker_and_later_ones_reuse_it(workers):
    worker = workers(build_command=worker_command())
    assert not worker.is_running()
    first = worker.predict({"action": "echo", "value": 1})
    assert first == {"echo": 1, "pid": worker.pid}
    pids = {worker.predict({"action": "echo", "value": n})["pid"] for n in range(5)}
    assert pids == {first["pid"]}
    assert worker.starts == 1
    pong = worker.ping()
    assert pong["ok"] and pong["model"] == "testworker" and pong["pid"] == first["pid"]
    assert pong["uptime_s"] >= 0 and pong["ready"] is True
    assert worker.state is WorkerState.READY


def test_worker_base_runs_without_this_package_on_the_path(workers):
    """-S: no site-packages, so the worker sees only what the env vars point at."""
    worker = workers(build_command=worker_command(python=sys.executable, env={}))
    worker.build_command = lambda w: ([sys.executable, "-S", str(TEST_WORKER), w.socket_path], {})
    assert worker.predict({"action": "echo", "value": "x"})["echo"] == "x"


@both_ways
def test_child_env_removes_names_mapped_to_none_in_the_real_child(workers, monkeypatch):
    monkeypatch.setenv("SECRET_TOKEN", "do-not-pass")
    monkeypatch.setenv("KEEP_ME", "kept")
    worker = workers(build_command=worker_command(env={"SECRET_TOKEN": None, "ADDED": "yes"}))
    env = worker.predict({"action": "env"})["env"]
    assert "SECRET_TOKEN" not in env
    assert env["ADDED"] == "yes"
    assert env["KEEP_ME"] == "kept"
    assert env["RESIDENT_POOL_PROTOCOL"].endswith("protocol.py") and os.path.isabs(env["RESIDENT_POOL_PROTOCOL"])
    assert env["RESIDENT_POOL_WORKER_BASE"].endswith("worker_base.py")
    assert "PYTORCH_NVML_BASED_CUDA_CHECK" not in env  # set for a zygote alone, never for its workers


def test_child_env_function():
    assert child_env({"A": None, "B": "2"}, {"A": "1", "C": "3"}) == {"B": "2", "C": "3"}
    with pytest.raises(TypeError, match="PORT"):
        child_env({"PORT": 8080}, {})


@both_ways
@pytest.mark.parametrize("code", [3, 5])
def test_exit_before_bind_is_a_start_error_with_code_hint_and_transcript(workers, code):
    worker = workers(build_command=worker_command("--exit-before-bind", str(code)))
    with pytest.raises(WorkerStartError) as info:
        worker.predict({"action": "echo"})
    error = info.value
    assert error.exit_code == code
    assert f"exit code {code}" in str(error)
    assert exit_hint(code) in str(error)
    assert str(worker.transcript) in str(error) and error.transcript == str(worker.transcript)
    assert any("REFUSED" in line for line in error.transcript_tail)
    assert worker.state is WorkerState.FAILED


@both_ways
def test_start_timeout_terminates_the_child_and_names_the_transcript(workers):
    worker = workers(build_command=worker_command("--hang-at-start"), start_timeout_s=1.0)
    with pytest.raises(WorkerStartError, match="did not answer") as info:
        worker.ensure_started()
    assert info.value.reason == "start_timeout"
    assert str(worker.transcript) in str(info.value)
    assert not pid_alive(worker.pid)


def test_each_way_a_standalone_worker_is_stopped_waits_the_kill_grace_set_shorter_than_its_default(workers,
                                                                                                 monkeypatch):
    """Issue 32: the kill grace (RESIDENT_POOL_KILL_GRACE_S) reached the pool's own stops only; a timed-out request,
    a start that never answered and a stop each waited a grace written out where it happened (5 s, or 10 s)."""
    from resident_pool.providers import worker_process

    monkeypatch.setenv("RESIDENT_POOL_KILL_GRACE_S", "0.7")  # read where the worker is made, as a Pool reads it
    graces = []
    terminate = worker_process.terminate_group

    def recorded(proc, grace_s, *rest):
        graces.append(grace_s)
        return terminate(proc, grace_s, *rest)

    monkeypatch.setattr(worker_process, "terminate_group", recorded)
    timed_out = workers(build_command=worker_command("--ignore-term"), request_timeout_s=0.5)
    with pytest.raises(RequestTimeout):
        timed_out.predict({"action": "sleep", "seconds": 30})
    hung = workers(slug="hung", build_command=worker_command("--hang-at-start", "--ignore-term"), start_timeout_s=0.5)
    with pytest.raises(WorkerStartError, match="did not answer"):
        hung.ensure_started()
    stopped = workers(slug="stopped", build_command=worker_command())
    stopped.ensure_started()
    stopped.stop()
    assert graces == [0.7, 0.7, 0.7]
    assert not pid_alive(timed_out.pid) and not pid_alive(hung.pid) and not pid_alive(stopped.pid)


@both_ways
def test_an_exception_fails_the_request_and_the_same_process_answers_next(workers):
    worker = workers(build_command=worker_command())
    pid = worker.predict({"action": "echo"})["pid"]
    with pytest.raises(WorkerRequestError) as info:
        worker.predict({"action": "raise", "message": "sequence has a digit"})
    assert info.value.reason == "request_failed"
    assert "ValueError: sequence has a digit" in str(info.value)
    assert "Traceback" in info.value.details["traceback"]
    assert worker.predict({"action": "echo"})["pid"] == pid


@both_ways
@pytest.mark.parametrize(
    ("payload", "readable"),
    [({"action": "exit", "code": 5}, "5"),
     ({"action": "refuse", "reason": "KERNELS: route fa3 required, sdpa loaded"}, "KERNELS: route fa3 required")],
)
def test_system_exit_or_refusal_in_a_prediction_is_worker_exiting(workers, payload, readable):
    worker = workers(build_command=worker_command())
    pid = worker.predict({"action": "echo"})["pid"]
    with pytest.raises(WorkerRequestError) as info:
        worker.predict(payload)
    error = info.value
    assert error.reason == "worker_exiting"
    assert readable in str(error)
    assert str(worker.transcript) in str(error)
    if payload["action"] == "exit":
        assert error.exit_code == 5 and exit_hint(5) in str(error)
        assert worker.returncode == 5  # the process really exited with it
    else:  # not a SystemExit: the code is the one the interpreter exited with, reaped
        assert error.exit_code == worker.returncode == 1
    assert not pid_alive(pid)


@both_ways
@pytest.mark.parametrize(
    ("action", "named"),
    [({"action": "os_exit", "code": 7}, "exit code 7"),
     ({"action": "sigkill"}, "SIGKILL"),
     ({"action": "abort"}, "SIGABRT")],
)
def test_abrupt_death_mid_request_is_worker_died_and_the_next_request_restarts(workers, action, named):
    worker = workers(build_command=worker_command())
    first_pid = worker.predict({"action": "echo"})["pid"]
    with pytest.raises(WorkerRequestError) as info:
        worker.predict(action)
    assert info.value.reason == "worker_died"
    assert named in str(info.value)
    assert str(worker.transcript) in str(info.value)
    second = worker.predict({"action": "echo", "value": "again"})
    assert second["echo"] == "again" and second["pid"] != first_pid
    assert worker.starts == 2


@both_ways
def test_a_request_past_a_half_second_timeout_is_a_request_timeout_naming_slug_timeout_transcript(workers):
    worker = workers(build_command=worker_command(), request_timeout_s=0.5)
    pid = worker.predict({"action": "echo"})["pid"]
    with pytest.raises(RequestTimeout) as info:
        worker.predict({"action": "sleep", "seconds": 30})
    assert isinstance(info.value, TimeoutError) and isinstance(info.value, WorkerRequestError)
    assert info.value.reason == "request_timeout" and info.value.slug == "testworker"
    assert "request_timeout_s = 0.5 s" in str(info.value) and str(worker.transcript) in str(info.value)
    # The hung worker cannot serve anyone else; it is replaced.
    assert not pid_alive(pid)
    assert worker.predict({"action": "echo"})["pid"] != pid


@both_ways
def test_idle_worker_is_retired_after_a_half_second_idle_timeout_and_a_busy_one_is_not(workers):
    worker = workers(build_command=worker_command(), idle_timeout_s=0.5)
    busy_pid = worker.predict({"action": "sleep", "seconds": 1.5})["pid"]  # busy 3x the idle timeout
    assert worker.served == 1  # it answered: not retired while busy
    wait_until(lambda: worker.state is WorkerState.STOPPED, timeout=10, message="idle retirement")
    assert not worker.is_running()
    assert not pid_alive(busy_pid)
    assert "retiring" in worker.transcript.read_text()


@both_ways
def test_stop_kills_a_worker_that_ignores_sigterm(workers):
    worker = workers(build_command=worker_command("--ignore-term"))
    pid = worker.predict({"action": "echo"})["pid"]
    outcome = []

    def hang():
        try:
            worker.predict({"action": "sleep", "seconds": 60})
        except WorkerRequestError as exc:
            outcome.append(exc)

    hung = threading.Thread(target=hang)
    hung.start()
    # In flight in the worker, not only BUSY here: a stop before the worker read the request dropped the connection,
    # and the worker, idle, took the shutdown and exited 0 (seen under load).
    wait_until(lambda: "action sleep" in worker.transcript.read_text(), message="the worker to be sleeping")
    started = time.monotonic()
    rc = worker.stop(grace_s=1.0)
    hung.join(timeout=10)
    assert outcome and outcome[0].reason in {"worker_died", "worker_stopped"}
    assert rc == -signal.SIGKILL
    assert time.monotonic() - started >= 1.0  # SIGTERM was tried and waited on first
    assert not pid_alive(pid)


@both_ways
def test_stop_takes_the_workers_children_with_it(workers):
    worker = workers(build_command=worker_command())
    child = worker.predict({"action": "spawn_child"})["child"]
    assert pid_alive(child)
    worker.stop(grace_s=5.0)
    wait_until(lambda: not pid_alive(child), timeout=10, message="the worker's child to die")
    assert not os.path.exists(worker.socket_path)


SUPERVISOR_SCRIPT = textwrap.dedent(
    """
    import json, sys, threading
    sys.path.insert(0, {tests!r})
    from helpers import configured, worker_command
    from resident_pool import ResidentWorker
    from resident_pool.providers.zygote import Zygote
    config, paths = configured()
    zygote = Zygote("orphan", "k", sys.executable, {{}}, {worker!r}, ["json"], paths=paths,
                    kill_grace_s=config.kill_grace_s) if {forked!r} else None
    worker = ResidentWorker("orphan", worker_command(), spawner=zygote)
    worker.ensure_started()
    print(json.dumps({{"pid": worker.pid}}), flush=True)
    worker.predict({{"action": "sleep", "seconds": 2.0, "marker": {marker!r}}})
    """
)


@both_ways
def test_orphan_watchdog_lets_an_in_flight_prediction_finish_then_exits(tmp_path, monkeypatch, way):
    """A one-second grace and a two-second heartbeat, so the orphan retires within the test."""
    monkeypatch.setenv("RESIDENT_POOL_ORPHAN_GRACE_S", "1")
    monkeypatch.setenv("RESIDENT_POOL_HEARTBEAT_STALE_S", "2")
    marker = tmp_path / "finished"
    script = SUPERVISOR_SCRIPT.format(tests=os.path.dirname(__file__), marker=str(marker), worker=str(TEST_WORKER),
                                      forked=way == "zygote")
    with subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True) as supervisor:
        try:
            worker_pid = json.loads(supervisor.stdout.readline())["pid"]
            wait_until(lambda: "action sleep" in _transcript_text(), timeout=10, message="the request to reach the worker")
        finally:
            supervisor.kill()
    wait_until(marker.exists, timeout=10, message="the in-flight prediction to finish")
    wait_until(lambda: not pid_alive(worker_pid), timeout=10, message="the orphaned worker to exit")
    assert "the pool is gone (heartbeat" in _transcript_text() and "exiting" in _transcript_text()
    assert ("from zygote" in _transcript_text()) == (way == "zygote")


def _transcript_text() -> str:
    logs = os.environ["RESIDENT_POOL_LOG_DIR"]
    return "".join(Path(logs, name).read_text() for name in os.listdir(logs))


def test_thirty_two_threads_are_served_without_crossing_or_overlap(workers):
    worker = workers(build_command=worker_command())
    results: dict[int, object] = {}
    errors = []

    def call(n):
        try:
            results[n] = worker.predict({"action": "echo", "value": n})["echo"]
        except Exception as exc:  # recorded, then asserted on below
            errors.append(exc)

    threads = [threading.Thread(target=call, args=(n,)) for n in range(32)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert not errors
    assert results == {n: n for n in range(32)}
    assert worker.ping()["max_in_flight"] == 1
    assert worker.starts == 1


def test_cublas_release_runs_after_every_prediction_even_a_failed_one(workers):
    worker = workers(build_command=worker_command())
    worker.predict({"action": "echo"})
    with pytest.raises(WorkerRequestError):
        worker.predict({"action": "raise"})
    worker.predict({"action": "echo"})
    assert worker.ping()["releases"] == 3


@pytest.mark.parametrize(("options", "env"), [(("--no-release",), {}), ((), {"RESIDENT_POOL_NO_CUBLAS_RELEASE": "1"})])
def test_cublas_release_can_be_turned_off(workers, options, env):
    worker = workers(build_command=worker_command(*options, env=env))
    worker.predict({"action": "echo"})
    worker.predict({"action": "echo"})
    assert worker.ping()["releases"] == 0


def test_unwritable_log_dir_is_a_clear_start_error(workers, tmp_path, monkeypatch):
    blocked = tmp_path / "file-not-dir"
    blocked.write_text("")
    worker = workers(build_command=worker_command(), log_path=blocked / "w.log")
    with pytest.raises(WorkerStartError, match="cannot open the transcript") as info:
        worker.ensure_started()
    assert "RESIDENT_POOL_LOG_DIR" in str(info.value)
    assert worker.pid is None


@pytest.mark.parametrize("policy", ["recommended", "required"])
def test_a_standalone_gpu_provider_where_no_gpu_is_known_runs_on_the_cpu_only_if_recommended(
        tmp_path, monkeypatch, policy):
    """Fake NVML readings with no device: the host admission's answer, as the pool gives it."""
    readings = tmp_path / "nvml.json"
    readings.write_text(json.dumps({"devices": []}))
    monkeypatch.setenv("RESIDENT_POOL_FAKE_NVML", str(readings))
    manifest = load_manifest(write_provider(tmp_path / "manifests", "gpuish",
                                            f'[gpu]\npolicy = "{policy}"\nvram_budget_gb = 2\n'))
    worker = worker_for(manifest, config=configured()[0])
    try:
        if policy == "recommended":
            assert worker.predict({"action": "env"})["env"]["CUDA_VISIBLE_DEVICES"] == ""
        else:
            with pytest.raises(AdmissionRefused, match="no GPU capacity is known"):
                worker.ensure_started()
            assert worker.pid is None
    finally:
        worker.close()
