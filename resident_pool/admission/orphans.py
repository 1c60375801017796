"""A dead pool's workers: the next pool of the same user asks each idle one to exit, and says what the rest wait for.

A pool killed with SIGKILL leaves its workers running, each holding its GPU budget (the ledger
names its pid, alive) until its orphan watchdog retires it: once its pool's heartbeat is stale
and it has been idle for its ``orphan_grace_s`` (120 s by default). The next pool of the same
user (one per state folder) has no use for them: its clients reach workers only through it. So
at its start it looks at the run folders the dead pool left, and asks each worker found idle
there to shut down, as a stop would (and, as a stop escalates, ends its process group if a
leftover thread holds it after it answered); one busy with a request its client sent before
the pool died finishes it first (it is asked again once idle). A worker that does not answer (still
loading its model, or hung) is left to its watchdog. What became of each is said in a wait's
report, so a request waiting for that memory says what it waits for.
"""

from __future__ import annotations

import logging
import os
import signal
import stat
import struct
import threading
import time
from pathlib import Path

from ..host.lines import peer_credentials
from ..host.procs import KILL_WAIT_S, pid_alive, process_start, signal_group
from ..protocol import ProtocolError, connect, recv_line, send_line
from ..worker_base import IN_FLIGHT_FILE

__all__ = ["Orphans"]

log = logging.getLogger("resident_pool.admission")
ASK_TIMEOUT_S = 5.0  # a worker answers a shutdown between requests; a stuck one is its watchdog's
SHUTDOWN_EXIT_S = 3.0  # after it answered, as a stop: a thread its model left running must not hold the exit long
AGAIN_S = 2.0  # how often a busy orphan is looked at again
WAITS = "it exits once idle for its orphan_grace_s (120 s by default) with its pool gone"


class Orphans:
    """The run folders a previous pool of this user left, listed when this pool starts, and what became of each."""

    def __init__(self, workers_dir: Path, kill_grace_s: float) -> None:
        """Lists ``workers_dir`` now: every folder there is a dead pool's (this pool has started none yet).
        ``kill_grace_s``: between SIGTERM and SIGKILL when one must be ended, as for the pool's own workers."""
        self.kill_grace_s = kill_grace_s
        self.folders = sorted(p for p in workers_dir.iterdir() if p.is_dir() and not p.is_symlink())
        self._said: dict[int, str] = {}  # pid: what became of it, in words
        self._lock = threading.Lock()
        self.finished = threading.Event()

    def start(self) -> None:
        """Ask the idle ones to exit, on a thread of its own that ends once none is left to ask."""
        if self.folders:
            threading.Thread(target=self._run, name="orphans", daemon=True).start()
        else:
            self.finished.set()

    def says(self, pid: int) -> str:
        """What the orphan with ``pid`` is doing, for a wait's report."""
        with self._lock:
            return self._said.get(pid, WAITS)

    def _run(self) -> None:
        pending = list(self.folders)
        try:
            while pending:
                pending = [folder for folder in pending if not self.retire(folder)]
                if pending and self.finished.wait(AGAIN_S):
                    return
        except Exception:  # one odd folder must not end the pool; said in full
            log.exception("retiring a previous pool's workers failed")
        finally:
            self.finished.set()

    def retire(self, folder: Path) -> bool:
        """Ask the worker of ``folder`` to exit if it is idle; True once nothing is left to do there."""
        sock_path = folder / "worker.sock"
        try:
            conn = connect(sock_path, timeout=1.0)  # served by this user, or refused unasked
        except (OSError, ValueError):
            return True  # gone, loading (no socket yet) or not ours: its watchdog's
        with conn:
            pid = peer_credentials(conn)[0]
            started = process_start(pid)
            if _busy(folder):
                self._say(pid, "busy with a request sent before its pool died: asked to exit once it is idle")
                return False
            try:
                conn.settimeout(ASK_TIMEOUT_S)
                send_line(conn, {"op": "shutdown", "id": 0})
                answered = recv_line(conn, bytearray()) is not None
            except (OSError, ProtocolError):
                answered = False
        if answered:
            log.info("asked pid %d, an idle worker of a pool that is gone (%s), to exit", pid, folder.name)
            self._say(pid, "its pool is gone: asked to exit, its memory comes back as it ends")
            self._see_out(pid, started)
        else:
            self._say(pid, f"did not answer a shutdown: {WAITS}")
        return True

    def _see_out(self, pid: int, started: int | None) -> None:
        """As a stop escalates: a worker whose interpreter a leftover thread holds after it answered is ended with
        its process group (its own session, as the pool started it), never another process given its pid."""
        if _gone_within(pid, SHUTDOWN_EXIT_S):
            return
        for signum in (signal.SIGTERM, signal.SIGKILL):
            if process_start(pid) != started or _group(pid) != pid:
                return  # not the worker any more, or not the leader of its own group: nothing of ours to end
            log.info("pid %d, a worker of a pool that is gone, still runs after its shutdown: %s to its group",
                     pid, signal.Signals(signum).name)
            signal_group(pid, signum)
            if _gone_within(pid, self.kill_grace_s if signum is signal.SIGTERM else KILL_WAIT_S):
                return
        self._say(pid, "did not end after SIGKILL (uninterruptible sleep in a driver?); its memory may stay held")

    def _say(self, pid: int, words: str) -> None:
        with self._lock:
            self._said[pid] = words


def _gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while pid_alive(pid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def _group(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


def _busy(folder: Path) -> bool:
    """Whether the worker's in-flight board (``worker_base``) names a request running now."""
    try:
        fd = os.open(folder / IN_FLIGHT_FILE, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False  # no board (an older worker, or none written yet): it answers the shutdown between requests
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        (started,) = struct.unpack("d", os.read(fd, 8))
    except (OSError, struct.error):
        return False
    finally:
        os.close(fd)
    return started > 0
