"""The decision core's event log: every event and action survives JSON, a replay finds the first decision that
differs, and a real run's log replayed into a fresh core decides the same actions."""

from __future__ import annotations

import json
import os
import signal
import stat
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


# -- the log file: never the pool's end, never an earlier pool's evidence overwritten, private -----------------
def _opened(path, **kw):
    from resident_pool.server.actions import Policy, Timings

    return CoreLog(path, Timings(), Policy(), 1000.0, **kw)


class _FullDisk:
    def write(self, text):
        raise OSError(28, "No space left on device")

    def close(self):
        pass


def test_a_log_that_cannot_be_written_ends_said_once_and_the_pool_serves_on(tmp_path, caplog):
    log = _opened(tmp_path / "core.jsonl")
    log._out.close()
    log._out = _FullDisk()  # the disk filled up under it
    event, decision = ev.Tick(), ev.Decision([c.Spawn(1)])
    with caplog.at_level("ERROR", logger="resident_pool.pool"):
        for _ in range(3):
            log.write(1001.0, event, decision)  # no exception: the decision stands, only its record ends
    said = [r.getMessage() for r in caplog.records if "core event log" in r.getMessage()]
    assert len(said) == 1 and "No space left on device" in said[0] and "serves on" in said[0]
    assert log.stopped is not None
    log.close()


def test_a_log_stops_at_its_cap_with_a_last_line_replay_reads(tmp_path):
    path = tmp_path / "core.jsonl"
    log = _opened(path, max_bytes=4096)
    from resident_pool.server.actions import Policy, Timings
    from resident_pool.server.core import PoolState

    state = PoolState(Timings(), 1000.0, Policy())
    steps = [ev.ManifestRead("m", "m", "v", "f", Spec())] + [ev.Tick() for _ in range(200)]
    for n, event in enumerate(steps):
        log.write(1000.0 + n, event, state.handle(1000.0 + n, event))
    log.close()
    text = path.read_text()
    assert len(text.encode()) <= 4096 + 200 and "RESIDENT_POOL_CORE_LOG_MAX_MB" in text.splitlines()[-1]
    notes: list[str] = []
    count, divergence = replay(text.splitlines(), notes)
    assert divergence is None and 0 < count < len(steps) and "stopped logging" in notes[0]


def test_a_new_pool_keeps_the_last_pools_log_beside_its_own(tmp_path):
    path = tmp_path / "core.jsonl"
    path.write_text("the dead pool's last events\n")
    os.chmod(path, 0o600)
    for _ in range(5):
        _opened(path).close()
    assert (tmp_path / "core.jsonl.1").read_text().startswith('{"format"')
    assert not (tmp_path / "core.jsonl.4").exists()  # KEPT = 3 earlier ones at most
    fresh = _opened(tmp_path / "other.jsonl")
    fresh.close()
    path.unlink()
    (tmp_path / "core.jsonl.3").rename(tmp_path / "keep.jsonl")
    path.write_text("evidence\n")
    os.chmod(path, 0o600)
    _opened(path).close()
    assert (tmp_path / "core.jsonl.1").read_text() == "evidence\n"  # moved aside, never truncated


def test_a_replay_leaves_out_a_last_line_cut_short_and_only_the_last(tmp_path):
    lines = _logged(tmp_path, [(1000.0, ev.ManifestRead("m", "m", "v", "f", Spec())),
                               (1000.5, ev.ClientAsked("m", 1, {})), (1001.0, ev.WorkerStarted(1, 77))])
    cut = [*lines[:-1], lines[-1][: len(lines[-1]) // 2]]  # the pool was killed mid-write
    notes: list[str] = []
    assert replay(cut, notes) == (2, None) and "line 4, the last, was cut short" in notes[0]
    middle = [lines[0], lines[1][:20], *lines[2:]]
    with pytest.raises(ValueError, match=r"line 2 is not JSON"):
        replay(middle)


def test_the_log_is_0600_and_refused_in_a_folder_another_user_can_reach(tmp_path):
    from resident_pool.server.corelog import CoreLogError

    private = tmp_path / "private"
    log = _opened(private / "core.jsonl")  # made 0700 where missing
    log.close()
    assert stat.S_IMODE((private / "core.jsonl").stat().st_mode) == 0o600
    assert stat.S_IMODE(private.stat().st_mode) == 0o700
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    os.chmod(shared, 0o755)
    with pytest.raises(CoreLogError, match=r"RESIDENT_POOL_CORE_LOG=.*mode 0755, open to group or others"):
        _opened(shared / "core.jsonl")
    (private / "link.jsonl").symlink_to(private / "core.jsonl")
    with pytest.raises(CoreLogError, match="a link"):
        _opened(private / "link.jsonl")


def test_a_relative_core_log_is_a_settings_error_naming_the_variable(monkeypatch):
    from resident_pool.errors import ResidentPoolError
    from resident_pool.settings import settings

    monkeypatch.setenv("RESIDENT_POOL_CORE_LOG", "core.jsonl")
    with pytest.raises(ResidentPoolError, match=r"RESIDENT_POOL_CORE_LOG='core\.jsonl'.*absolute path") as found:
        settings()
    assert found.value.reason == "bad_setting"


@pytest.mark.parametrize(("where", "said"), [("shared/core.jsonl", "chmod 700"),
                                             ("a-file/core.jsonl", "its folder cannot be made")],
                         ids=["open-to-others", "cannot-be-made"])
def test_a_pool_whose_core_log_cannot_be_kept_fails_its_clients_start_at_once(pool_dir, monkeypatch, tmp_path,
                                                                                where, said):
    import time

    from resident_pool.errors import ResidentPoolError

    (tmp_path / "shared").mkdir()
    os.chmod(tmp_path / "shared", 0o755)
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("RESIDENT_POOL_CORE_LOG", str(tmp_path / where))
    write_provider(pool_dir, "m", lifecycle())
    began = time.monotonic()
    with pytest.raises(ResidentPoolError, match=rf"RESIDENT_POOL_CORE_LOG=.*{said}") as found, Pool() as pool:
        pool.predict("m", {"action": "echo"})
    assert found.value.reason == "pool_start_failed" and time.monotonic() - began < 30  # not the 60 s start wait
