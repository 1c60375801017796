"""The model side, spoken to over its raw socket."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time

import pytest
from helpers import TEST_WORKER, state_dir, wait_until

from resident_pool import protocol, worker_base
from resident_pool.protocol import recv_line, send_line
from resident_pool.providers.supervisor import PROTOCOL_PATH, WORKER_BASE_PATH


def _start_raw(socket_path, stdout=subprocess.DEVNULL, **extra_env):
    env = {**os.environ, "RESIDENT_POOL_PROTOCOL": PROTOCOL_PATH, "RESIDENT_POOL_WORKER_BASE": WORKER_BASE_PATH,
           **extra_env}
    proc = subprocess.Popen([sys.executable, str(TEST_WORKER), socket_path], env=env,
                            stdout=stdout, stderr=subprocess.STDOUT if stdout is not subprocess.DEVNULL else stdout)
    # The socket file exists from bind() on, a moment before listen(): wait for an answer, not the file.
    try:
        wait_until(lambda: _answers(socket_path), message="the worker to answer")
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return proc


def _answers(socket_path):
    try:
        return _ask(socket_path, {"op": "ping", "id": 0})["ok"]
    except OSError:
        return False


@pytest.fixture
def raw_worker():
    """The test worker started by hand, so the test owns every connection to it."""
    socket_path = str(state_dir() / "raw.sock")
    with _start_raw(socket_path) as proc:
        yield socket_path, proc
        proc.kill()


def _ask(socket_path, message):
    with protocol.connect(socket_path) as conn:
        send_line(conn, message)
        return recv_line(conn, bytearray())


@pytest.mark.parametrize("bad", [b"this is not json\n", b"[1, 2, 3]\n", b"\xff\xfe\xfd\n", b"{\"op\": \n"])
def test_bad_lines_get_an_error_reply_and_the_connection_serves_on(raw_worker, bad):
    socket_path, proc = raw_worker
    with protocol.connect(socket_path) as conn:
        conn.sendall(bad)
        buf = bytearray()
        reply = recv_line(conn, buf)
        assert reply["ok"] is False and reply["reason"] == "bad_request"
        send_line(conn, {"op": "ping", "id": 1})
        assert recv_line(conn, buf)["ok"] is True
    assert proc.poll() is None


def test_a_line_over_the_cap_closes_that_connection_and_the_worker_serves_the_next_client(raw_worker, monkeypatch):
    socket_path, proc = raw_worker
    conn = protocol.connect(socket_path)
    conn.settimeout(60)
    over = b"x" * (protocol.MAX_LINE_BYTES + protocol.RECV_CHUNK * 2)
    sender = threading.Thread(target=lambda: _send_ignoring_reset(conn, over))
    sender.start()
    buf = bytearray()
    reply = recv_line(conn, buf)
    assert reply["reason"] == "bad_request" and "over the cap" in reply["error"]
    sender.join(timeout=60)
    conn.close()
    assert _ask(socket_path, {"op": "ping", "id": 2})["ok"] is True
    assert proc.poll() is None


def _send_ignoring_reset(conn, data):
    try:
        conn.sendall(data)
    except OSError:
        pass  # the worker closed the stream once the cap was passed: expected


def test_unknown_op_and_a_silent_client_do_not_block_others(raw_worker):
    socket_path, _ = raw_worker
    silent = protocol.connect(socket_path)
    silent.sendall(b'{"op": "ping"')  # half a line, then nothing
    try:
        reply = _ask(socket_path, {"op": "fly", "id": 3})
        assert reply["reason"] == "unknown_op" and "ping" in reply["error"]
        assert _ask(socket_path, {"op": "predict", "id": 4, "payload": {"action": "echo", "value": 9}})["result"]["echo"] == 9
    finally:
        silent.close()


def test_unsendable_results_are_named_errors_and_the_worker_stays_up(raw_worker):
    socket_path, proc = raw_worker
    nan = _ask(socket_path, {"op": "predict", "id": 5, "payload": {"action": "nan"}})
    assert nan["ok"] is False and "cannot be sent" in nan["error"]
    assert _ask(socket_path, {"op": "ping", "id": 6})["ok"] is True
    assert proc.poll() is None


def test_shutdown_is_acknowledged_and_the_socket_removed(raw_worker):
    socket_path, proc = raw_worker
    assert _ask(socket_path, {"op": "shutdown", "id": 7})["stopping"] is True
    assert proc.wait(timeout=10) == 0
    assert not os.path.exists(socket_path)


def test_release_cublas_workspaces_is_zero_without_cuda():
    assert worker_base.release_cublas_workspaces() == 0


def test_a_worker_counts_each_leases_answers_and_forgets_the_least_recently_answered_first(monkeypatch):
    # What a recall's answer says the lease served ("served"), kept for a bounded number of leases.
    monkeypatch.setattr(worker_base, "_RECALLED_KEPT", 3)
    leases = worker_base._Leases()
    for lease in ["a", "b", "a", "c", "a", None, "", 7]:
        leases.answered(lease)
    assert [leases.served(lease) for lease in ("a", "b", "c", None, 7)] == [3, 1, 1, 0, 0]
    leases.answered("b")  # now "c" is the least recently answered
    leases.answered("d")
    assert [leases.served(lease) for lease in ("a", "b", "c", "d")] == [3, 2, 0, 1]


def test_exit_code_rules_for_a_last_reply():
    code = worker_base._exit_code
    assert code(SystemExit(5)) == 5
    assert code(SystemExit()) == 0
    assert code(SystemExit("refused: no fa3")) == 1
    assert code(KeyboardInterrupt()) is None

    class Refusal(BaseException):
        reason = "kernel census refused: fa3 required"

    assert worker_base._readable(Refusal("opaque")) == "kernel census refused: fa3 required"
    line = type("Line", (BaseException,), {"line": "KERNELS route=sdpa"})
    assert worker_base._readable(line()) == "KERNELS route=sdpa"
    assert worker_base._readable(SystemExit("refused: no fa3")) == "refused: no fa3"


def test_connecting_where_no_worker_listens_fails_clearly(tmp_path):
    with pytest.raises(FileNotFoundError):
        protocol.connect(str(tmp_path / "nothing.sock"), timeout=1)
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(tmp_path / "stale.sock"))
    stale.close()  # a socket file nobody listens on, as a killed worker leaves it
    with pytest.raises(ConnectionRefusedError):
        protocol.connect(str(tmp_path / "stale.sock"), timeout=1)


def test_stats_counts_requests_failures_and_latency_in_the_fixed_buckets(raw_worker):
    socket_path, _ = raw_worker
    for n in range(3):
        _ask(socket_path, {"op": "predict", "id": n, "payload": {"action": "echo", "value": n}})
    assert _ask(socket_path, {"op": "predict", "id": 3, "payload": {"action": "raise"}})["ok"] is False
    _ask(socket_path, {"op": "predict", "id": 4, "payload": {"action": "sleep", "seconds": 0.3}})
    stats = _ask(socket_path, {"op": "stats", "id": 5})
    assert stats["ok"] is True and stats["requests"] == 5 and stats["failures"] == {"request_failed": 1}
    latency = stats["latency"]
    assert latency["bounds_s"] == list(worker_base.LATENCY_BUCKETS_S)
    assert len(latency["counts"]) == len(latency["bounds_s"]) + 1 and sum(latency["counts"]) == 5
    slow_bucket = latency["bounds_s"].index(0.5)  # 0.3 s lands in (0.25, 0.5]
    assert latency["counts"][slow_bucket] == 1 and latency["sum_s"] >= 0.3
    assert stats["pid"] != os.getpid() and stats["served"] == 5


def test_the_request_in_flight_is_visible_while_the_worker_answers_nothing(tmp_path):
    """A busy worker serves one request at a time; its start time is readable from the run folder."""
    import struct

    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    (run / "heartbeat").touch()
    socket_path = str(state_dir() / "busy.sock")
    board = run / worker_base.IN_FLIGHT_FILE

    def started_at():
        return struct.unpack("d", board.read_bytes()[:8])[0] if board.exists() else None

    with _start_raw(socket_path, RESIDENT_POOL_HEARTBEAT=str(run / "heartbeat")) as proc:
        assert started_at() == 0.0  # idle
        sleeper = threading.Thread(target=_ask, args=(socket_path, {"op": "predict", "id": 1, "payload": {
            "action": "sleep", "seconds": 2}}))
        sleeper.start()
        began = wait_until(started_at, message="the worker to mark its request")
        assert abs(began - time.time()) < 2.5
        sleeper.join()
        assert started_at() == 0.0  # done
        proc.kill()


def test_a_worker_told_to_shut_down_answers_every_request_already_sent_before_it_closes(tmp_path):
    """Issue 31, finding 1. The pool stops a worker on a connection of its own, which the worker reads before its
    clients' (new connections first); at d3993d0 it then closed every connection with the requests still unread
    in them, and each client got ECONNRESET: a request that never ran looked like one that died with its worker.
    Here the shutdown and two requests arrive while the worker is busy, so they are read in one batch."""
    socket_path = str(state_dir() / "raw.sock")
    log = tmp_path / "worker.log"
    with open(log, "w") as out, _start_raw(socket_path, stdout=out) as proc:
        try:
            kept, session = protocol.connect(socket_path), protocol.connect(socket_path)
            for conn, lease in ((kept, "pool-1"), (session, "pool-2")):
                send_line(conn, {"op": "predict", "id": 1, "lease": lease, "payload": {"action": "echo"}})
                assert recv_line(conn, bytearray())["ok"]
            assert _ask(socket_path, {"op": "recall", "id": 0, "lease": "pool-1"})["ok"]
            busy = protocol.connect(socket_path)
            send_line(busy, {"op": "predict", "id": 1, "payload": {"action": "sleep", "seconds": 1.0}})
            wait_until(lambda: "action sleep" in log.read_text(), message="the worker to be busy")
            send_line(kept, {"op": "predict", "id": 7, "lease": "pool-1", "payload": {"action": "echo"}})
            send_line(session, {"op": "predict", "id": 8, "lease": "pool-2", "payload": {"action": "echo"}})
            stop = protocol.connect(socket_path)
            send_line(stop, {"op": "shutdown", "id": 0})
            assert recv_line(busy, bytearray())["ok"]
            assert recv_line(stop, bytearray())["stopping"]
            recalled = recv_line(kept, bytearray())
            unrun = recv_line(session, bytearray())
            assert (recalled["id"], recalled["ok"], recalled["reason"]) == (7, False, "lease_recalled")
            assert (unrun["id"], unrun["ok"], unrun["reason"]) == (8, False, "worker_stopping")
            assert "did not run" in unrun["error"]
            with pytest.raises(BrokenPipeError):  # a request sent from now on is refused as unsent, never reset
                send_line(kept, {"op": "predict", "id": 9, "lease": "pool-1", "payload": {}})
            assert proc.wait(timeout=30) == 0
        finally:
            for conn in (kept, session, busy, stop):
                conn.close()
            proc.kill()
