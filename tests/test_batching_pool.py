"""A batching provider through the host pool, with real processes: its callers share one replica, and taking one
caller's lease back, one caller's death or the worker's death never loses or mixes up another's answer."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from helpers import wait_until
from providers import write_provider

from resident_pool import Pool
from resident_pool.errors import RequestTimeout, WorkerRequestError
from resident_pool.host.procs import pid_alive

pytestmark = pytest.mark.reliability


def batching_provider(pool_dir, slug="batch", callers=8, extra=""):
    return write_provider(pool_dir, slug, f'[env]\npassthrough = ["BATCHWORKER_CALLS"]\n'
                                         f"[batching]\nmax_batch_size = {callers}\n{extra}",
                          worker="batchworker.py")


def _calls(path):
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_callers_share_one_replica_and_ten_thousand_mixed_calls_each_get_their_own_answer(pool_dir, tmp_path,
                                                                                         monkeypatch, reliability_row):
    calls = tmp_path / "calls.jsonl"
    monkeypatch.setenv("BATCHWORKER_CALLS", str(calls))
    batching_provider(pool_dir)
    wrong: list[str] = []
    pids: set[int] = set()
    lock = threading.Lock()

    def caller(n: int) -> None:
        with Pool() as pool:
            for i in range(1250):
                tag = f"{n}-{i}"
                answer = pool.predict("batch", {"tag": tag})
                with lock:
                    pids.add(answer["pid"])
                    if answer["tag"] != tag:
                        wrong.append(f"{tag} got {answer['tag']}")

    threads = [threading.Thread(target=caller, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    with Pool() as watcher:
        row = wait_until(lambda: next((w for w in watcher.status()["workers"] if w["callers"] >= 4), None),
                         timeout=60, message="several callers on one replica")
        for thread in threads:
            thread.join(timeout=120)
    assert not wrong and len(pids) == 1, (wrong[:3], pids)
    assert row["max_callers"] == 8 and row["replica"] == 0
    sizes = [call["size"] for call in _calls(calls)]
    assert sum(sizes) >= 10_000 and max(sizes) > 1  # model calls took several callers' items at once
    reliability_row("8 callers sharing a batching worker, 10,000 mixed calls", "each answer its own input; one "
                    "replica", calls=10_000, model_calls=len(sizes))


def test_a_worker_killed_mid_batch_fails_each_caller_with_its_exit_in_words_and_none_hangs(pool_dir, tmp_path):
    """Each caller whose request had reached the killed worker hears SIGKILL in words; one whose request was not
    sent yet is served by the next worker; none hangs."""
    batching_provider(pool_dir)
    hold = tmp_path / "hold"
    errors: list[BaseException] = []
    answered: list[int] = []

    def caller(n: int) -> None:
        with Pool() as pool:
            try:
                answered.append(pool.predict("batch", {"tag": n, "hold": str(hold)})["pid"])
            except BaseException as exc:  # every kind is what the test counts
                errors.append(exc)

    with Pool() as pool:
        pid = pool.predict("batch", {"tag": "warm"})["pid"]
        threads = [threading.Thread(target=caller, args=(n,)) for n in range(4)]
        for thread in threads:
            thread.start()
        wait_until(lambda: (pool.status()["workers"][0]["in_flight_s"] or 0) > 0, timeout=30,
                   message="a model call in flight")
        os.kill(pid, signal.SIGKILL)
        hold.touch()  # the next worker's calls go through
        for thread in threads:
            thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in threads)
    assert len(errors) + len(answered) == 4 and errors, (errors, answered)
    assert all(isinstance(e, WorkerRequestError) and "SIGKILL" in str(e) for e in errors), [str(e)[:200] for e in errors]
    assert pid not in answered


def test_one_callers_recall_never_disturbs_anothers_item_in_flight(pool_dir, tmp_path):
    """One replica, two slots, both held by kept leases: a third client's wait takes back the one used least recently
    (idle) while the other's item runs in the model. The worker answers the recall once that model call is over (it
    makes one at a time); the running item is answered, the third is seated then, and the first acquires again."""
    batching_provider(pool_dir, callers=2, extra="[lifecycle]\nmax_replicas = 1\n")
    hold = tmp_path / "hold"
    answers: dict[str, object] = {}

    def call(name: str, payload: dict) -> None:
        with Pool() as pool:
            answers[name] = pool.predict("batch", payload)["tag"]

    with Pool() as first, Pool() as watcher:
        first.predict("batch", {"tag": "first"})  # a kept lease, idle from now on
        busy = threading.Thread(target=call, args=("held", {"tag": "held", "hold": str(hold)}))
        busy.start()
        wait_until(lambda: (watcher.status()["workers"][0]["in_flight_s"] or 0) > 0, timeout=30,
                   message="the second caller's item in the model")
        third = threading.Thread(target=call, args=("third", {"tag": "third"}))
        third.start()
        recalled = wait_until(lambda: [lease for lease in watcher.status()["workers"][0]["leases"]
                                       if lease["recalling"]], timeout=30,
                              message="one kept lease recalled while the other's item runs")
        assert len(recalled) == 1 and watcher.status()["workers"][0]["in_flight_s"] is not None
        hold.touch()
        busy.join(timeout=60)
        third.join(timeout=60)
        assert first.predict("batch", {"tag": "again"})["tag"] == "again"  # its lease was taken back: acquired again
    assert answers == {"held": "held", "third": "third"}


def test_a_new_version_drains_a_shared_replica_with_callers_in_flight_and_loses_nothing(pool_dir, tmp_path):
    manifest = batching_provider(pool_dir)
    hold = tmp_path / "hold"
    results: list[object] = []

    def caller(n: int) -> None:
        with Pool() as pool:
            try:
                results.append(pool.predict("batch", {"tag": n, "hold": str(hold)})["tag"])
            except WorkerRequestError as exc:
                results.append(exc)

    with Pool() as pool:
        old = pool.predict("batch", {"tag": "warm"})["pid"]
        threads = [threading.Thread(target=caller, args=(n,)) for n in range(3)]
        for thread in threads:
            thread.start()
        wait_until(lambda: (pool.status()["workers"][0]["in_flight_s"] or 0) > 0, timeout=30,
                   message="items in the model")
        manifest.write_text(manifest.read_text() + "# a new version\n")
        (manifest.parent / "worker.py").write_text((manifest.parent / "worker.py").read_text() + "\n# v2\n")
        wait_until(lambda: any(not w["current"] for w in pool.status()["workers"]), timeout=15,
                   message="the pool to see the new version while the items still run")
        hold.touch()
        for thread in threads:
            thread.join(timeout=60)
        assert sorted(results) == [0, 1, 2]
        assert wait_until(lambda: pool.predict("batch", {"tag": "new"})["pid"] != old, timeout=15,
                          message="the new version serving")
    assert not pid_alive(old) or wait_until(lambda: not pid_alive(old), timeout=30, message="the old worker gone")


def test_a_caller_killed_mid_batch_loses_only_its_own_item_and_the_worker_serves_on(pool_dir, tmp_path):
    """A client process SIGKILLed while its item waits in the shared worker: the other caller's item in the same
    worker is answered, the worker is not drained or stopped for it, and its slot is free again."""
    batching_provider(pool_dir)
    hold = tmp_path / "hold"
    script = ("import sys; from resident_pool import Pool\n"
              "Pool().predict('batch', {'tag': 'doomed', 'hold': sys.argv[1]})\n")
    answers: list[object] = []
    with Pool() as pool:
        pid = pool.predict("batch", {"tag": "warm"})["pid"]

        def kept() -> None:
            with Pool() as own:
                answers.append(own.predict("batch", {"tag": "kept", "hold": str(hold)}))

        other = threading.Thread(target=kept)
        other.start()
        doomed = subprocess.Popen([sys.executable, "-c", script, str(hold)])
        try:
            wait_until(lambda: pool.status()["workers"][0]["callers"] == 3, timeout=30,
                       message="the doomed client and the other caller seated on the one replica")
            doomed.kill()
        finally:
            doomed.kill()
            doomed.wait(timeout=30)
        wait_until(lambda: pool.status()["workers"][0]["callers"] == 2, timeout=30,
                   message="the killed client's slot freed")
        hold.touch()
        other.join(timeout=60)
        assert [answer["tag"] for answer in answers] == ["kept"] and answers[0]["pid"] == pid
        assert pool.predict("batch", {"tag": "after"})["pid"] == pid  # neither drained nor stopped
        assert all(w["state"] != "draining" for w in pool.status()["workers"])


def test_one_callers_timeout_in_a_shared_queue_fails_its_item_alone_and_says_the_worker_serves_on(
        pool_dir, tmp_path, monkeypatch):
    """request_timeout_s cut to 4 s so a queue wait can outrun it quickly. The caller whose item waited behind
    another's model call gets RequestTimeout; no model call outran the limit, so the worker is not stopped, the
    other caller is answered, and the error does not claim the worker was stopped."""
    calls = tmp_path / "calls.jsonl"
    batching_provider(pool_dir, extra="[lifecycle]\nrequest_timeout_s = 4\n")
    monkeypatch.setenv("BATCHWORKER_CALLS", str(calls))
    first, second = tmp_path / "first", tmp_path / "second"
    outcome: dict[str, object] = {}
    ready, go, sending = threading.Event(), threading.Event(), threading.Event()

    def running() -> None:
        with Pool() as pool:
            outcome["running"] = pool.predict("batch", {"tag": "running", "hold": str(first)})["tag"]

    def queued() -> None:
        with Pool() as pool:
            pool.predict("batch", {"tag": "prepared"})  # its lease and worker connection, ready before the scene
            ready.set()
            go.wait(30)
            sending.set()
            try:
                outcome["queued"] = pool.predict("batch", {"tag": "queued", "hold": str(second)})["tag"]
            except RequestTimeout as exc:
                outcome["queued"] = exc

    with Pool() as pool:
        pid = pool.predict("batch", {"tag": "warm"})["pid"]
        threads = [threading.Thread(target=queued), threading.Thread(target=running)]
        threads[0].start()
        assert ready.wait(30)
        threads[1].start()
        wait_until(lambda: (pool.status()["workers"][0]["in_flight_s"] or 0) > 0, timeout=30,
                   message="the running caller's model call")
        go.set()
        assert sending.wait(30)
        time.sleep(1.5)  # the scene: the queued item waits 1.5 s of its 4 behind the running model call
        first.touch()
        wait_until(lambda: any(c["tags"] == ["queued"] for c in _calls(calls)), timeout=30,
                   message="the queued item's own model call")
        threads[0].join(timeout=30)
        second.touch()  # its model call ends inside the limit
        threads[1].join(timeout=30)
        assert outcome["running"] == "running"
        error = outcome["queued"]
        assert isinstance(error, RequestTimeout), error
        assert "was stopped" not in str(error) and "serves on" in str(error), str(error)
        assert pool.predict("batch", {"tag": "after"})["pid"] == pid
