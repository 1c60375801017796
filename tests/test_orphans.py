"""A dead pool's workers, as the next pool finds them: run folders with a real socket and a real in-flight board."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

from helpers import wait_until

from resident_pool.admission import Admission, Ledger, declared
from resident_pool.admission.orphans import Orphans
from resident_pool.settings import settings
from resident_pool.worker_base import IN_FLIGHT_FILE

ROOT = Path(__file__).resolve().parents[1]


STAND_IN = """
import sys
sys.path.insert(0, sys.argv[2])
from resident_pool.protocol import bind_unix, recv_line, send_line
listener = bind_unix(sys.argv[1] + "/worker.sock")
print("up", flush=True)
while True:
    conn, _ = listener.accept()
    message = recv_line(conn, bytearray())
    if message is not None and message.get("op") == "shutdown":
        send_line(conn, {"ok": True, "id": message.get("id")})
        sys.exit(0)
    conn.close()
"""


class StandIn:
    """A dead pool's worker: a process of its own session with a run folder, a socket that answers a shutdown by
    exiting (as worker_base does), and an in-flight board the test sets."""

    def __init__(self, folder: Path, busy: bool) -> None:
        folder.mkdir(mode=0o700)
        self.board = folder / IN_FLIGHT_FILE
        self.mark(time.time() if busy else 0.0)
        self.proc = subprocess.Popen([sys.executable, "-c", STAND_IN, str(folder), str(ROOT)], stdout=subprocess.PIPE,
                                     text=True, start_new_session=True)
        assert self.proc.stdout.readline().strip() == "up"

    def mark(self, started: float) -> None:
        self.board.write_bytes(struct.pack("d", started))

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.communicate()


def test_an_idle_orphan_is_asked_to_exit_and_a_busy_one_only_once_its_request_ended(short_tmp):
    idle, busy = StandIn(short_tmp / "g8-0-aaa", busy=False), StandIn(short_tmp / "g8-1-bbb", busy=True)
    try:
        orphans = Orphans(short_tmp, settings().kill_grace_s)
        orphans.start()
        assert idle.proc.wait(timeout=10) == 0  # it answered the shutdown and left
        wait_until(lambda: "busy" in orphans.says(busy.proc.pid), timeout=10, message="the busy one to be seen busy")
        assert busy.proc.poll() is None  # its request (sent before its pool died) is not cut short
        assert orphans.says(idle.proc.pid).startswith("its pool is gone: asked to exit")
        busy.mark(0.0)
        assert busy.proc.wait(timeout=10) == 0  # asked once idle
        assert orphans.finished.wait(10)
    finally:
        idle.close()
        busy.close()


def test_a_wait_for_memory_a_dead_pools_worker_holds_says_what_it_waits_for(tmp_path, short_tmp):
    """Issue 31 finding 13: the wait said only who held the memory, as if a live holder would let go."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a pool that is gone
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        ledger = Ledger(tmp_path / "ledger.json")
        (tmp_path / "ledger.json").write_text(json.dumps([{
            "slug": "g8", "replica": 0, "device": 0, "budget_gb": 8, "pid": worker.pid, "owner": dead.pid,
            "since": time.time(), "loaded": True}]))
        gate = Admission(ledger, devices=lambda: (declared("10"), "test"), headroom_gb=0.0,
                         orphans=Orphans(short_tmp, settings().kill_grace_s))
        (held,) = gate.describe("g8", 8, 1.0)["holders"]
        assert f"g8[0] 8 GB on GPU 0 (pid {worker.pid}), a worker of pool {dead.pid}, which is gone: it exits once " \
               "idle for its orphan_grace_s" in held
    finally:
        worker.kill()
        worker.wait()


def test_a_pool_finds_no_orphan_in_a_folder_of_its_own_making(short_tmp):
    orphans = Orphans(short_tmp, settings().kill_grace_s)
    orphans.start()
    assert orphans.finished.is_set() and orphans.folders == []
    assert not [t for t in threading.enumerate() if t.name == "orphans"]


HELD = """
import sys, time
sys.path.insert(0, sys.argv[2])
from resident_pool.protocol import bind_unix, recv_line, send_line
listener = bind_unix(sys.argv[1] + "/worker.sock")
print("up", flush=True)
while True:
    conn, _ = listener.accept()
    message = recv_line(conn, bytearray())
    if message is not None:
        send_line(conn, {"ok": True, "id": message.get("id")})
        time.sleep(3600)  # answered, but a leftover thread holds the interpreter
"""


def test_an_orphan_that_answers_but_does_not_exit_is_ended_with_its_group_as_a_stop_would(short_tmp):
    """A worker whose model left a non-daemon thread answers the shutdown and stays: without the escalation it
    would outlive its orphan watchdog (which ended with serve())."""
    folder = short_tmp / "loader-0-ccc"
    folder.mkdir(mode=0o700)
    held = subprocess.Popen([sys.executable, "-c", HELD, str(folder), str(ROOT)],
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert held.stdout.readline().strip() == "up"
        orphans = Orphans(short_tmp, settings().kill_grace_s)
        orphans.start()
        assert held.wait(timeout=30) == -15  # SIGTERM to its group, after the shutdown's 3 s
        assert orphans.finished.wait(10)
    finally:
        if held.poll() is None:
            held.kill()
        held.communicate()
