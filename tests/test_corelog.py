"""The decision core's event log: every event and action survives JSON, a replay finds the first decision that
differs, and a real run's log replayed into a fresh core decides the same actions."""

from __future__ import annotations

import json
import os
import signal
import threading
import typing

import pytest
from helpers import wait_until
from providers import lifecycle, write_provider
from test_pool import gpu_provider

from resident_pool import Pool
from resident_pool.errors import AdmissionTimeout, WorkerStartError
from resident_pool.host.procs import pid_alive
from resident_pool.server import actions as c
from resident_pool.server import events as ev
from resident_pool.server.corelog import CoreLog, decode, encode, replay
from resident_pool.server.replica import Spec
from resident_pool.server.states import StopCause

SAMPLES: list[object] = [
    ev.ManifestRead("k~stock", "k", "v2", "f2", Spec(budget_gb=7.5, max_replicas=2, evict="hibernate"), True),
    ev.ClientAsked("k", 3, {"flow_run": "nimble-fox", "task_run": "predict-0"}, "interactive", True),
    ev.TicketGone(4), ev.LeaseReleased(5, 3, "died", 2, -9), ev.LeaseUsed(5, 3, 40),
    ev.LeaseRecalled(5, 0.25, 12, None), ev.LeaseRecalled(5, failure="OSError: EMFILE"), ev.ConnectionClosed(3),
    ev.StartPrepared(1, 8.0, 1, False), ev.StartPrepared(1, None), ev.BudgetPlaced(1, 0, True),
    ev.BudgetNotPlaced(1, {0: 1.5, 1: 0.0}), ev.MemoryFreed(), ev.HostRecall(1, "another pool"),
    ev.WorkerSpawned(1, 4242), ev.RestoreFailed(1, "cuda-checkpoint failed"), ev.WorkerStarted(1, None, True),
    ev.StartFailed(1, WorkerStartError("k: exited 3", slug="k", exit_code=3, transcript="/t.log",
                                       transcript_tail=["REFUSED: no"], details={"breaker": {"failures": 1}})),
    ev.Pinged(1, "abandon", False, -9, None, 3), ev.WorkerExited(1, 0), ev.HibernationEnded(1, False, "no driver"),
    ev.WorkerStopped(1, "still ran"), ev.RetireAsked(1, StopCause.OVER_BUDGET, "9 GB > 8"),
    ev.StopAsked(None, True, "stop --all", StopCause.POOL_STOPPING), ev.ShutdownAsked("SIGTERM", True),
    ev.WarmAsked("k", 2, False), ev.Tick(3, {1: 0.25, 7: 12.5}), ev.Tick(),
    c.Start(1, 2, True, False), c.Place(1, 8.0, None, "batch", 1.5, True, False), c.Withdraw(1, "no_room", 3.0),
    c.Spawn(1), c.Stop(1, StopCause.EVICTED, "made room", True), c.Ping(1, "liveness", 10.0, 5),
    c.Hibernate(1, "evicted"), c.Grant(2, 5, 1, True, True), c.Recall(1, 5, "waits", True, False),
    c.Refuse(2, AdmissionTimeout("k: waited", slug="k", details={"held": ["a[0] leased"]})), c.Note(1, "x"),
    c.ReleaseBudget(1), c.Gone(1, None, None, 0), c.Announce("request.aged", "k", (("ticket", 2), ("waited_s", 1.5))),
    c.Exit("quiet"), c.Forget("k~stock"), ev.Decision([c.Spawn(1)], 3, (1, 2), None),
]


def test_every_kind_of_event_and_action_is_sampled():
    kinds = {*typing.get_args(ev.Event), *typing.get_args(c.Action)}
    assert kinds <= {type(sample) for sample in SAMPLES}


@pytest.mark.parametrize("sample", SAMPLES, ids=lambda sample: type(sample).__name__)
def test_each_record_comes_back_from_its_json_line_as_it_was(sample):
    again = decode(json.loads(json.dumps(encode(sample))))
    assert encode(again) == encode(sample)
    if not any(isinstance(getattr(sample, f, None), Exception) for f in ("error",)):
        assert again == sample


def _logged(tmp_path, steps):
    from resident_pool.server.actions import Policy, Timings
    from resident_pool.server.core import PoolState

    state, path = PoolState(Timings(), 1000.0, Policy()), tmp_path / "core.jsonl"
    log = CoreLog(path, Timings(), Policy(), 1000.0)
    for now, event in steps:
        log.write(now, event, state.handle(now, event))
    log.close()
    return path.read_text().splitlines()


def test_a_replay_names_the_first_event_whose_decision_differs(tmp_path):
    lines = _logged(tmp_path, [(1000.0, ev.ManifestRead("m", "m", "v", "f", Spec())),
                               (1000.5, ev.ClientAsked("m", 1, {})), (1001.0, ev.WorkerStarted(1, 77))])
    assert replay(lines) == (3, None)
    tampered = json.loads(lines[3])
    tampered["decision"]["actions"] = []  # as if the recorded core had granted nothing
    lines[3] = json.dumps(tampered)
    count, divergence = replay(lines)
    assert count == 3 and divergence.line == 4 and divergence.event["type"] == "WorkerStarted"
    assert divergence.replayed["actions"][0]["type"] == "Grant"


def test_a_real_runs_log_replayed_into_a_fresh_core_decides_the_same_actions(pool_dir, monkeypatch, tmp_path):
    """A pool recording its core's log through an eviction (a 6 GB provider evicts another's idle worker on a 10
    GB card), a liveness failure (a worker stopped with SIGSTOP) and a recall (a client waits for the one replica
    another holds as a kept lease); the log, fed to a fresh core, gives the same decisions event by event."""
    log_path = tmp_path / "core.jsonl"
    monkeypatch.setenv("RESIDENT_POOL_CORE_LOG", str(log_path))
    monkeypatch.setenv("RESIDENT_POOL_GPU_CAPACITY_GB", "10")
    monkeypatch.setenv("RESIDENT_POOL_LIVENESS_TIMEOUT_S", "1")  # the liveness failure ends within the test
    gpu_provider(pool_dir, "a", 6)
    gpu_provider(pool_dir, "b", 6)
    write_provider(pool_dir, "frozen", lifecycle(ping_interval_s=1))
    with Pool() as first, Pool() as second:
        first.predict("a", {"action": "echo"})  # a's one replica, held by first as a kept lease
        answered = threading.Event()
        waiter = threading.Thread(target=lambda: (second.predict("a", {"action": "echo"}), answered.set()))
        waiter.start()  # second waits for a's replica: first's kept lease is recalled
        waiter.join(timeout=60)
        assert answered.is_set()
        first.close()
        second.close()
        with Pool() as third:
            third.predict("b", {"action": "echo"})  # 6 + 6 > 10: a's idle worker is evicted
            pid = third.predict("frozen", {"action": "echo"})["pid"]
            os.kill(pid, signal.SIGSTOP)  # alive, answering nothing: the liveness ping fails
            try:
                wait_until(lambda: not pid_alive(pid), timeout=30, message="the frozen worker to be stopped")
            finally:
                if pid_alive(pid):
                    os.kill(pid, signal.SIGKILL)
            third.shutdown()  # the log is whole once the pool has stopped
    lines = log_path.read_text().splitlines()
    decided = [json.loads(line)["decision"]["actions"] for line in lines[1:]]
    kinds = [(a["type"], a.get("cause")) for actions in decided for a in actions]
    assert ("Recall", None) in kinds and ("Stop", "evicted") in kinds and ("Stop", "unresponsive") in kinds
    count, divergence = replay(lines)
    assert divergence is None, f"line {divergence.line}: {divergence.event}\nrecorded {divergence.recorded}\n" \
                               f"replayed {divergence.replayed}"
    assert count == len(lines) - 1 > 50


def test_resident_pool_replay_says_whether_a_log_replays_and_where_it_does_not(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    cli = str(Path(sys.executable).parent / "resident-pool")
    lines = _logged(tmp_path, [(1000.0, ev.ManifestRead("m", "m", "v", "f", Spec())),
                               (1000.5, ev.ClientAsked("m", 1, {})), (1001.0, ev.WorkerStarted(1, 77))])
    good = tmp_path / "good.jsonl"
    good.write_text("\n".join(lines) + "\n")
    ran = subprocess.run([cli, "replay", str(good)], capture_output=True, text=True, check=False)
    assert ran.returncode == 0 and "3 events replayed" in ran.stdout
    entry = json.loads(lines[2])
    entry["event"]["priority"] = "interactive"  # edited by hand: the ticket now waits in another class
    entry["decision"]["actions"] = []
    lines[2] = json.dumps(entry)
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(lines) + "\n")
    ran = subprocess.run([cli, "replay", "--json", str(bad)], capture_output=True, text=True, check=False)
    assert ran.returncode == 1 and json.loads(ran.stdout)["divergence"]["line"] == 3
    (tmp_path / "not.jsonl").write_text('{"what": "else"}\n')
    ran = subprocess.run([cli, "replay", str(tmp_path / "not.jsonl")], capture_output=True, text=True, check=False)
    assert ran.returncode == 2 and "not a core event log" in ran.stderr
