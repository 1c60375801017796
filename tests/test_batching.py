"""A batching worker (``serve(on_predict_batch=...)``), spoken to over raw sockets by several callers at once.

The purpose-built worker (tests/workers/batchworker.py) records every model call it makes; a call that holds on a
file (``hold``) keeps the model busy while the test queues requests behind it, so what the next call takes is
known. Requests of one pass are read in the kernel's order, so a call's requests are compared as sets.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from helpers import TEST_WORKER, WORKERS, state_dir, wait_until

from resident_pool import arrays, protocol, worker_base
from resident_pool.protocol import Inbox, recv_line, send_line
from resident_pool.providers.supervisor import PROTOCOL_PATH, WORKER_BASE_PATH

BATCH_WORKER = WORKERS / "batchworker.py"


class Worker:
    """A batching worker process the test started, and what its model calls were."""

    def __init__(self, socket_path: str, proc: subprocess.Popen, calls_path: Path, log_path: Path) -> None:
        self.socket_path, self.proc, self.calls_path, self.log_path = socket_path, proc, calls_path, log_path
        self.gates = 0
        self.callers: list[Caller] = []

    def caller(self) -> Caller:
        """A new client connection, closed when the test ends."""
        self.callers.append(Caller(self.socket_path))
        return self.callers[-1]

    def calls(self) -> list[dict]:
        text = self.calls_path.read_text() if self.calls_path.exists() else ""
        return [json.loads(line) for line in text.splitlines()]

    def log(self) -> str:
        return self.log_path.read_text()

    def ask(self, message: dict) -> dict:
        with protocol.connect(self.socket_path) as conn:
            conn.settimeout(60)
            send_line(conn, message)
            return recv_line(conn, bytearray())

    def hold(self, caller: Caller, wait: bool = True, **fields) -> Path:
        """Keep the model busy with ``caller``'s request until the returned file exists (``wait``: until the model
        has taken it; else it may be queued behind another)."""
        self.gates += 1
        gate = self.calls_path.with_name(f"gate-{self.gates}")
        made = len(self.calls())
        caller.send(f"hold-{self.gates}", {"tag": f"hold-{self.gates}", "hold": str(gate)}, **fields)
        if wait:
            wait_until(lambda: len(self.calls()) > made, message="the model to be held")
        return gate


class Caller:
    """One client connection to the worker."""

    def __init__(self, socket_path: str) -> None:
        self.conn = protocol.connect(socket_path)
        self.conn.settimeout(60)
        self.buf = bytearray()

    def send(self, request_id, payload, **fields) -> None:
        send_line(self.conn, {"op": "predict", "id": request_id, "payload": payload, **fields})

    def reply(self) -> dict:
        return recv_line(self.conn, self.buf)

    def ask(self, request_id, payload, **fields) -> dict:
        self.send(request_id, payload, **fields)
        return self.reply()

    def close(self) -> None:
        self.conn.close()


@contextmanager
def batching_worker(tmp_path: Path, *options: str, script: Path = BATCH_WORKER, **env: str):
    socket_path = str(state_dir() / "batch.sock")
    calls, log = tmp_path / "calls.jsonl", tmp_path / "worker.log"
    environ = {**os.environ, "RESIDENT_POOL_PROTOCOL": PROTOCOL_PATH, "RESIDENT_POOL_WORKER_BASE": WORKER_BASE_PATH,
               "BATCHWORKER_CALLS": str(calls), **env}
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, str(script), socket_path, *options], env=environ, stdout=out,
                                stderr=subprocess.STDOUT)
        worker = Worker(socket_path, proc, calls, log)
        try:
            wait_until(lambda: proc.poll() is not None or _answers(socket_path), message="the worker to answer")
            assert proc.poll() is None, log.read_text()
            yield worker
        finally:
            for caller in worker.callers:
                caller.close()
            for gate in range(1, worker.gates + 1):  # a model still held lets go
                calls.with_name(f"gate-{gate}").touch()
            proc.kill()
            proc.wait()


def _answers(socket_path: str) -> bool:
    try:
        with protocol.connect(socket_path, timeout=1) as conn:
            send_line(conn, {"op": "ping", "id": 0})
            return bool(recv_line(conn, bytearray())["ok"])
    except OSError:
        return False


def test_a_lone_caller_is_answered_by_a_call_of_its_own_at_once_and_each_call_resets_and_releases(tmp_path):
    with batching_worker(tmp_path) as worker:
        caller = worker.caller()
        for n in range(3):
            reply = caller.ask(n, {"tag": n})
            assert reply["ok"] and reply["id"] == n, reply
            assert reply["result"] == {"tag": n, "batch": 1, "pid": worker.proc.pid}
            assert reply["batch_size"] == 1 and reply["queued"] == 0 and reply["queue_wait_s"] >= 0
        assert [call["size"] for call in worker.calls()] == [1, 1, 1]
        ping = worker.ask({"op": "ping", "id": "p"})
        assert ping["batching"] == {"max_batch_size": worker_base.DEFAULT_MAX_BATCH_SIZE, "max_wait_ms": 0,
                                    "max_batch_work": None}
        assert (ping["queued"], ping["queue_wait_s"], ping["served"]) == (0, 0, 3)
        assert (ping["calls"], ping["resets"], ping["releases"]) == (3, 3, 3)  # on_reset and the release per call


def test_requests_queued_by_several_callers_go_to_the_model_in_one_call(tmp_path):
    with batching_worker(tmp_path) as worker:
        holder = worker.caller()
        gate = worker.hold(holder)
        callers = [worker.caller() for _ in range(5)]
        for n, caller in enumerate(callers):
            caller.send(n, {"tag": n})
        gate.touch()
        assert holder.reply()["ok"]
        replies = [caller.reply() for caller in callers]
        assert [reply["result"]["tag"] for reply in replies] == list(range(5))  # each caller its own answer
        assert all(reply["result"]["batch"] == 5 and reply["batch_size"] == 5 for reply in replies), replies
        assert all(reply["queue_wait_s"] > 0 for reply in replies)
        assert [call["size"] for call in worker.calls()] == [1, 5]
        stats = worker.ask({"op": "stats", "id": "s"})
        assert stats["requests"] == 6 and stats["served"] == 6 and stats["failures"] == {}
        batches = stats["batches"]
        assert (batches["calls"], batches["items"]) == (2, 6)
        sizes = dict(zip(batches["size"]["bounds"], batches["size"]["counts"], strict=False))
        assert sizes[1] == 1 and sizes[8] == 1 and sum(batches["size"]["counts"]) == 2  # one call of 1, one of 5
        assert sum(stats["queue_wait"]["counts"]) == 6


def test_interactive_requests_go_first_and_no_call_takes_more_than_max_batch_size(tmp_path):
    with batching_worker(tmp_path, RESIDENT_POOL_MAX_BATCH_SIZE="2") as worker:
        holder = worker.caller()
        gate = worker.hold(holder)
        order = [("b1", "batch"), ("b2", "batch"), ("n1", "normal"), ("n2", "normal"), ("i1", "interactive"),
                 ("i2", "interactive")]
        callers = {}
        for tag, priority in order:  # the interactive ones last
            callers[tag] = worker.caller()
            callers[tag].send(tag, {"tag": tag}, priority=priority)
        gate.touch()
        replies = {tag: caller.reply() for tag, caller in callers.items()}
        assert all(reply["ok"] and reply["result"]["tag"] == tag for tag, reply in replies.items())
        assert [set(call["tags"]) for call in worker.calls()[1:]] == [{"i1", "i2"}, {"n1", "n2"}, {"b1", "b2"}]
        assert replies["i1"]["queued"] == 4 and replies["b1"]["queued"] == 0
        refused = worker.caller().ask("x", {"tag": "x"}, priority="urgent")
        assert refused["reason"] == "bad_request" and "interactive, normal, batch" in refused["error"]


def test_a_queued_request_rises_a_class_as_it_waits_so_none_starves_with_aging_shortened_to_50_ms(tmp_path):
    with batching_worker(tmp_path, RESIDENT_POOL_MAX_BATCH_SIZE="1", RESIDENT_POOL_AGING_S="0.05") as worker:
        first, second = worker.caller(), worker.caller()
        gate = worker.hold(first, priority="interactive")
        waiting = worker.caller()
        waiting.send("old", {"tag": "old"}, priority="batch")
        gate2 = worker.hold(second, wait=False, priority="interactive")  # taken before "old", which waits
        gate.touch()
        wait_until(lambda: len(worker.calls()) == 2, message="the second hold to take the model")
        held_at = time.monotonic()
        newer = worker.caller()
        newer.send("new", {"tag": "new"}, priority="interactive")
        wait_until(lambda: time.monotonic() - held_at > 0.2, message="the old request to age two classes")
        gate2.touch()
        assert waiting.reply()["ok"] and newer.reply()["ok"]
        # Aged to interactive, and there first: without ageing the interactive one would have gone first.
        assert [call["tags"] for call in worker.calls()[2:]] == [["old"], ["new"]]


def test_a_call_takes_no_more_work_than_max_batch_work_and_a_bad_size_fails_its_request_alone(tmp_path):
    with batching_worker(tmp_path, "--size-of", RESIDENT_POOL_MAX_BATCH_SIZE="4",
                         RESIDENT_POOL_MAX_BATCH_WORK="10") as worker:
        holder = worker.caller()
        gate = worker.hold(holder)
        works = {f"w{n}": work for n, work in enumerate([3, 3, 3, 3, 3, 1, 1, 1, 12, 2])}
        callers = {tag: worker.caller() for tag in [*works, "bad"]}
        for tag, work in works.items():
            callers[tag].send(tag, {"tag": tag, "work": work})
        callers["bad"].send("bad", {"tag": "bad", "work": "lots"})
        gate.touch()
        refused = callers["bad"].reply()
        assert refused["reason"] == "request_failed" and "size_of returned 'lots'" in refused["error"], refused
        assert "'tag': 'bad'" in refused["input"]
        for tag, caller in callers.items():
            if tag != "bad":
                assert caller.reply()["result"]["tag"] == tag
        calls = worker.calls()[1:]
        assert sorted(tag for call in calls for tag in call["tags"]) == sorted(works)  # each exactly once
        for call in calls:
            assert call["size"] <= 4 and (call["work"] <= 10 or call["size"] == 1), calls
        assert ["w8"] in [call["tags"] for call in calls]  # over the bound alone: it runs by itself


def test_max_wait_ms_holds_a_call_only_for_the_last_calls_callers_and_never_a_lone_caller_with_the_wait_at_1_s(
        tmp_path):
    """The rule itself is tested with a fake clock in test_batching_hold.py; this is the worker's loop keeping it.
    The worker reads nothing while its model runs (a ping then waited for the held call's 30-s cap): the two requests
    sent during the held call are read together once it ends, and their replies say they were queued together."""
    with batching_worker(tmp_path, RESIDENT_POOL_MAX_BATCH_SIZE="3", RESIDENT_POOL_MAX_WAIT_MS="1000") as worker:
        assert worker.ask({"op": "ping", "id": "p"})["batching"]["max_wait_ms"] == 1000
        lone = worker.caller()
        for n in range(2):  # nobody else was answered in its last call: it never waits
            reply = lone.ask(n, {"tag": n})
            assert reply["batch_size"] == 1 and reply["queue_wait_s"] < 1.0, reply
        gate = worker.hold(lone)
        first, second = worker.caller(), worker.caller()
        first.send(1, {"tag": 1})
        second.send(2, {"tag": 2})
        gate.touch()
        assert lone.reply()["ok"]
        replies = [first.reply(), second.reply()]
        assert [reply["batch_size"] for reply in replies] == [2, 2]
        # held the whole second for the held caller, answered in the last call, which did not ask again
        assert min(reply["queue_wait_s"] for reply in replies) >= 1.0, replies
        first.send(3, {"tag": 3})
        second.send(4, {"tag": 4})
        replies = [first.reply(), second.reply()]
        assert [reply["batch_size"] for reply in replies] == [2, 2]  # the first's call waited for the second
        assert max(reply["queue_wait_s"] for reply in replies) < 1.0, replies  # and went once it came


def test_one_poisoned_request_among_64_is_isolated_by_splitting_and_the_other_63_are_answered(tmp_path):
    with batching_worker(tmp_path) as worker:
        holder = worker.caller()
        callers = [worker.caller() for _ in range(64)]
        gate = worker.hold(holder)
        for n, caller in enumerate(callers):
            caller.send(n, {"tag": n, "poison": n == 17})
        gate.touch()
        replies = [caller.reply() for caller in callers]
        failed = [reply for reply in replies if not reply["ok"]]
        assert [reply["id"] for reply in failed] == [17]
        assert failed[0]["reason"] == "request_failed" and failed[0]["type"] == "ValueError"
        assert "poisoned input 17" in failed[0]["error"] and "'tag': 17" in failed[0]["error"]
        assert all(reply["result"]["tag"] == n for n, reply in enumerate(replies) if n != 17)
        calls = worker.calls()[1:]
        assert len(calls) == 13  # 1 + 2 * log2(64): each half of each failing call tried once
        wait_until(lambda: "isolated 1 failing request(s) among 64 in 13 model calls" in worker.log(),
                   message="the worker to log how many calls isolating it took")
        assert worker.ask({"op": "stats", "id": "s"})["failures"] == {"request_failed": 1}
        assert worker.proc.poll() is None


def test_a_result_returned_as_an_exception_fails_that_request_alone_in_one_call(tmp_path):
    with batching_worker(tmp_path) as worker:
        holder = worker.caller()
        gate = worker.hold(holder)
        callers = [worker.caller() for _ in range(3)]
        for n, caller in enumerate(callers):
            caller.send(n, {"tag": n, "fail_alone": n == 1})
        gate.touch()
        replies = [caller.reply() for caller in callers]
        assert [reply["ok"] for reply in replies] == [True, False, True]
        assert replies[1]["error"].startswith("ValueError: input 1 cannot be embedded (input: ")
        assert replies[1]["type"] == "ValueError" and replies[1]["batch_size"] == 3
        assert [call["size"] for call in worker.calls()] == [1, 3]  # no split: the call itself succeeded


def test_a_system_exit_mid_call_answers_every_caller_of_that_call_and_the_worker_exits_with_its_code(tmp_path):
    with batching_worker(tmp_path, RESIDENT_POOL_MAX_BATCH_SIZE="3") as worker:
        holder = worker.caller()
        gate = worker.hold(holder)
        in_call = [worker.caller() for _ in range(3)]
        for n, caller in enumerate(in_call):
            caller.send(n, {"tag": n, **({"exit": 3} if n == 1 else {})}, priority="interactive")
        queued = worker.caller()
        queued.send("later", {"tag": "later"}, priority="batch")
        gate.touch()
        replies = [caller.reply() for caller in in_call]
        assert [(reply["id"], reply["reason"], reply["exit_code"]) for reply in replies] == [
            (0, "worker_exiting", 3), (1, "worker_exiting", 3), (2, "worker_exiting", 3)]
        assert len({reply["error"] for reply in replies}) == 1
        unrun = queued.reply()
        assert unrun["reason"] == "worker_stopping" and "did not run" in unrun["error"]
        assert worker.proc.wait(timeout=30) == 3
        assert "later" not in {tag for call in worker.calls() for tag in call["tags"]}


def test_a_caller_that_goes_while_its_request_is_queued_is_dropped_and_one_gone_mid_call_costs_its_answer_only(
        tmp_path):
    with batching_worker(tmp_path, RESIDENT_POOL_MAX_BATCH_SIZE="2") as worker:
        holder, second = worker.caller(), worker.caller()
        gate = worker.hold(holder)
        gone, stays = worker.caller(), worker.caller()
        gone.send("gone", {"tag": "gone"}, priority="batch")
        stays.send("stays", {"tag": "stays"}, priority="batch")
        filler = worker.caller()
        filler.send("filler", {"tag": "filler"}, priority="interactive")
        gate2 = worker.hold(second, wait=False, priority="interactive")  # taken with the filler: they wait
        gate.touch()
        wait_until(lambda: len(worker.calls()) == 2, message="the second hold to take the model")
        assert set(worker.calls()[1]["tags"]) == {"hold-2", "filler"}
        gone.close()
        gate2.touch()
        assert stays.reply()["result"] == {"tag": "stays", "batch": 1, "pid": worker.proc.pid}
        assert [call["tags"] for call in worker.calls()[2:]] == [["stays"]]  # the gone one's request never ran
        assert holder.reply()["ok"] and second.reply()["ok"] and filler.reply()["ok"]
        # Gone while its request is in the model: the other request of that call is answered, the worker serves on.
        leaving, other = worker.caller(), worker.caller()
        gate3 = worker.hold(holder)
        mid = gate3.with_name("gate-mid")
        leaving.send("leaving", {"tag": "leaving", "hold": str(mid)})
        other.send("other", {"tag": "other"})
        gate3.touch()
        wait_until(lambda: len(worker.calls()) == 5, message="the shared call to start")
        assert set(worker.calls()[4]["tags"]) == {"leaving", "other"}
        leaving.close()
        mid.touch()
        assert other.reply()["result"]["batch"] == 2
        assert holder.reply()["ok"] and holder.ask("after", {"tag": "after"})["ok"]
        assert worker.proc.poll() is None


def test_a_caller_that_shuts_its_sending_side_still_gets_the_answer_to_its_queued_request(tmp_path):
    with batching_worker(tmp_path, RESIDENT_POOL_MAX_BATCH_SIZE="1") as worker:
        holder, second = worker.caller(), worker.caller()
        gate = worker.hold(holder)
        half = worker.caller()
        half.send("half", {"tag": "half"}, priority="batch")
        half.conn.shutdown(socket.SHUT_WR)  # `nc -N` does this once its input ends
        gate2 = worker.hold(second, wait=False, priority="interactive")
        gate.touch()
        wait_until(lambda: len(worker.calls()) == 2, message="the second hold to take the model")
        gate2.touch()  # the half-closed stream's end is read while its request waits
        assert half.reply()["result"]["tag"] == "half"


def test_a_recall_during_a_call_is_answered_after_its_leases_queued_request_which_still_runs(tmp_path):
    with batching_worker(tmp_path, RESIDENT_POOL_MAX_BATCH_SIZE="1") as worker:
        holder, second, kept = worker.caller(), worker.caller(), worker.caller()
        gate = worker.hold(holder)
        kept.send(1, {"tag": "kept"}, lease="pool-1", priority="batch")
        gate2 = worker.hold(second, wait=False, lease="pool-2", priority="interactive")
        gate.touch()
        wait_until(lambda: len(worker.calls()) == 2, message="the second hold to take the model")
        recall = worker.caller()
        send_line(recall.conn, {"op": "recall", "id": "r", "lease": "pool-1"})
        gate2.touch()
        assert kept.reply()["ok"]
        answer = recall.reply()
        assert answer["ok"] and answer["served"] == 1  # answered after the lease's request read before it
        refused = kept.ask(2, {"tag": "kept-again"}, lease="pool-1")
        assert refused["reason"] == "lease_recalled"
        assert second.reply()["ok"] and second.ask(3, {"tag": "other"}, lease="pool-2")["ok"]


def test_a_shutdown_during_a_call_answers_the_call_and_the_queued_request_unrun_then_exits_0(tmp_path):
    with batching_worker(tmp_path, RESIDENT_POOL_MAX_BATCH_SIZE="1") as worker:
        holder, second = worker.caller(), worker.caller()
        gate = worker.hold(holder)
        queued = worker.caller()
        queued.send("queued", {"tag": "queued"}, lease="pool-3", priority="batch")
        gate2 = worker.hold(second, wait=False, priority="interactive")
        gate.touch()
        wait_until(lambda: len(worker.calls()) == 2, message="the second hold to take the model")
        stop = worker.caller()
        send_line(stop.conn, {"op": "shutdown", "id": "stop"})
        gate2.touch()
        assert holder.reply()["ok"] and second.reply()["ok"]
        assert stop.reply()["stopping"] is True
        unrun = queued.reply()
        assert (unrun["id"], unrun["reason"]) == ("queued", "worker_stopping") and "did not run" in unrun["error"]
        assert worker.proc.wait(timeout=30) == 0
        assert len(worker.calls()) == 2


def test_a_call_in_flight_is_on_the_board_and_a_worker_whose_pool_is_gone_exits_once_idle_with_the_grace_at_1_s(
        tmp_path):
    import struct

    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    heartbeat = run / "heartbeat"
    heartbeat.touch()
    board = run / worker_base.IN_FLIGHT_FILE

    def started_at() -> float:
        return struct.unpack("d", board.read_bytes()[:8])[0]

    with batching_worker(tmp_path, RESIDENT_POOL_HEARTBEAT=str(heartbeat), RESIDENT_POOL_ORPHAN_GRACE_S="1") as worker:
        assert started_at() == 0.0
        holder, other = worker.caller(), worker.caller()
        gate = worker.hold(holder)
        other.send(1, {"tag": 1})
        assert abs(started_at() - time.time()) < 30  # the held call's start, on the wall clock
        gate.touch()
        assert holder.reply()["ok"] and other.reply()["ok"]
        wait_until(lambda: started_at() == 0.0, message="the board to clear")
        heartbeat.unlink()  # the pool is gone
        assert worker.proc.wait(timeout=30) == 0
        assert "the pool is gone" in worker.log()


def _array_caller(socket_path: str) -> tuple[socket.socket, Inbox]:
    conn = protocol.connect(socket_path)
    conn.settimeout(60)
    inbox = Inbox(reused=protocol.COPY)  # as a session does: the worker's buffers are copied out
    arrays.negotiate(conn, inbox)
    inbox.slabs = arrays.Slabs()
    return conn, inbox


def test_arrays_go_in_and_out_of_one_call_and_each_caller_gets_its_own_back_bit_exact_with_the_wait_set_to_10_s(
        tmp_path):
    """The four requests meet in one call (it waits up to 10 s for the fourth: the first time for the held caller,
    which never asks again, the second for the four answered together), each array beside its own line, each answer in
    its own caller's reply buffers; twice, so the buffers are reused. The callers agree on arrays before the model is
    held: the worker answers nothing while its model runs (their offers waited for the held call's 30-s cap)."""
    with batching_worker(tmp_path, RESIDENT_POOL_MAX_BATCH_SIZE="4", RESIDENT_POOL_MAX_WAIT_MS="10000") as worker:
        connections = [_array_caller(worker.socket_path) for _ in range(4)]
        gate = worker.hold(worker.caller())
        try:
            for round_ in range(2):
                sent = [np.random.default_rng(10 * round_ + n).standard_normal(2**18, dtype=np.float32)
                        for n in range(4)]
                replies: list = [None] * 4

                def call(n: int, sent=sent, replies=replies, round_=round_) -> None:
                    conn, inbox = connections[n]
                    replies[n] = arrays.exchange(conn, inbox, {"op": "predict", "id": round_ * 10 + n,
                                                               "payload": {"tag": n, "array": sent[n]}})

                threads = [threading.Thread(target=call, args=(n,)) for n in range(4)]
                for thread in threads:
                    thread.start()
                if round_ == 0:
                    gate.touch()  # the held caller, answered, does not ask again: the next call waits for 4
                for thread in threads:
                    thread.join(60)
                for n, reply in enumerate(replies):
                    assert reply["ok"] and reply["batch_size"] == 4, reply
                    assert reply["result"]["tag"] == n
                    assert reply["result"]["array"].tobytes() == sent[n].tobytes()
                    assert reply["result"]["reversed"].tobytes() == sent[n][::-1].tobytes()
                del replies
        finally:
            for conn, inbox in connections:
                conn.close()
                inbox.close()
        assert [call["size"] for call in worker.calls()] == [1, 4, 4]


def test_ten_thousand_mixed_calls_from_eight_callers_each_answer_belongs_to_its_own_input(tmp_path):
    """Echoes, requests that fail alone and poisoned ones that fail their whole call, with every class of
    priority, tagged by index; each caller sends its next request as soon as it has its answer."""
    total, callers = 10_000, 8
    classes = ("interactive", "normal", "batch")
    with batching_worker(tmp_path) as worker:
        wrong: list[str] = []

        def stream(first: int) -> None:
            try:
                check(first)
            except Exception as exc:  # any failure of a stream fails the test, named
                wrong.append(f"stream {first}: {type(exc).__name__}: {exc}")

        def check(first: int) -> None:
            with protocol.connect(worker.socket_path) as conn:
                conn.settimeout(60)
                buf = bytearray()
                for index in range(first, total, callers):
                    payload = {"tag": index, "fail_alone": index % 97 == 0, "poison": index % 1009 == 0}
                    send_line(conn, {"op": "predict", "id": index, "payload": payload,
                                     "priority": classes[index % 3]})
                    reply = recv_line(conn, buf)
                    if reply["id"] != index:
                        wrong.append(f"{index}: reply to {reply['id']}")
                    elif payload["poison"]:
                        if f"poisoned input {index}" not in reply.get("error", ""):
                            wrong.append(f"{index}: {reply}")
                    elif payload["fail_alone"]:
                        if f"input {index} cannot be embedded" not in reply.get("error", ""):
                            wrong.append(f"{index}: {reply}")
                    elif not reply["ok"] or reply["result"]["tag"] != index:
                        wrong.append(f"{index}: {reply}")

        threads = [threading.Thread(target=stream, args=(n,)) for n in range(callers)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(300)
        assert not any(thread.is_alive() for thread in threads)
        assert wrong == []
        stats = worker.ask({"op": "stats", "id": "s"})
        assert stats["requests"] == total
        expected_failures = sum(1 for i in range(total) if i % 97 == 0 or i % 1009 == 0)
        assert stats["failures"] == {"request_failed": expected_failures}
        assert stats["batches"]["calls"] < total  # some calls took several callers' requests


def test_serve_takes_exactly_one_predict_function_and_shaping_only_with_the_batch_one(short_tmp):
    socket_path = str(short_tmp / "never.sock")
    with pytest.raises(TypeError, match=r"exactly one of on_predict= .* or on_predict_batch="):
        worker_base.serve(slug="both", socket_path=socket_path, on_predict=len, on_predict_batch=list)
    with pytest.raises(TypeError, match="exactly one of"):
        worker_base.serve(slug="neither", socket_path=socket_path)
    with pytest.raises(TypeError, match="max_batch_size shape the model calls of on_predict_batch"):
        worker_base.serve(slug="serial", socket_path=socket_path, on_predict=len, max_batch_size=8)
    with pytest.raises(ValueError, match=r"max_batch_work \(100\) bounds the work size_of measures"):
        worker_base.serve(slug="work", socket_path=socket_path, on_predict_batch=list, max_batch_work=100)
    with pytest.raises(ValueError, match=r"serve\(max_batch_size=0\) is not a whole number of at least 1"):
        worker_base.serve(slug="zero", socket_path=socket_path, on_predict_batch=list, max_batch_size=0)
    assert not os.path.exists(socket_path)  # refused before binding


def test_the_pools_variables_win_over_serves_arguments_and_a_bad_one_stops_the_start_naming_it(tmp_path):
    with batching_worker(tmp_path, "--by-argument", "2", "250") as worker:
        assert worker.ask({"op": "ping", "id": 1})["batching"] == {"max_batch_size": 2, "max_wait_ms": 250,
                                                                   "max_batch_work": None}
    with batching_worker(tmp_path, "--by-argument", "2", "250", RESIDENT_POOL_MAX_BATCH_SIZE="5",
                         RESIDENT_POOL_MAX_WAIT_MS="0") as worker:
        assert worker.ask({"op": "ping", "id": 1})["batching"]["max_batch_size"] == 5
    bad = subprocess.run([sys.executable, str(BATCH_WORKER), str(state_dir() / "bad.sock")], check=False,
                         env={**os.environ, "RESIDENT_POOL_WORKER_BASE": WORKER_BASE_PATH,
                              "RESIDENT_POOL_PROTOCOL": PROTOCOL_PATH, "RESIDENT_POOL_MAX_BATCH_SIZE": "lots"},
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0
    assert "RESIDENT_POOL_MAX_BATCH_SIZE='lots' (the manifest's [batching] max_batch_size) is not a whole number" \
        in bad.stderr


def test_a_serial_worker_given_the_batching_variables_says_so_and_answers_one_request_per_call(tmp_path):
    with batching_worker(tmp_path, script=TEST_WORKER, RESIDENT_POOL_MAX_BATCH_SIZE="8") as worker:
        wait_until(lambda: "RESIDENT_POOL_MAX_BATCH_SIZE set" in worker.log(), message="the worker's warning")
        assert "give it on_predict_batch= to batch" in worker.log()
        ping = worker.ask({"op": "ping", "id": 1})
        assert "batching" not in ping and "queued" not in ping
        reply = worker.caller().ask(1, {"action": "echo", "value": 5}, priority="interactive")
        assert reply["result"]["echo"] == 5 and "batch_size" not in reply


def test_the_standalone_resident_worker_stays_serial_with_a_batching_worker_each_call_one_request(workers):
    """ResidentWorker sends one request at a time (its lock): a batching worker under it answers each in a call of
    its own, at once (nothing else is ever queued)."""
    worker = workers(build_command=lambda w: ([sys.executable, str(BATCH_WORKER), w.socket_path], {}),
                     request_timeout_s=60)
    replies = []
    threads = [threading.Thread(target=lambda n=n: replies.append(worker.request({"tag": n}))) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert sorted(reply["result"]["tag"] for reply in replies) == [0, 1, 2, 3]
    assert {reply["batch_size"] for reply in replies} == {1}
