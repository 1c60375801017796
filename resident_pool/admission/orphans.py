"""A dead pool's workers: the next pool of the same user asks each idle one to exit, and says what the rest wait for.

A pool killed with SIGKILL leaves its workers running, each holding its GPU budget (the ledger
names its pid, alive) until its orphan watchdog retires it: once its pool's heartbeat is stale
and it has been idle for its ``orphan_grace_s`` (120 s by default). The next pool of the same
user (one per state folder) has no use for them: its clients reach workers only through it. So
at its start it looks at the run folders the dead pool left, and asks each worker found idle
there to shut down, as a stop would; one busy with a request its client sent before the pool
died finishes it first (it is asked again once idle). A worker that does not answer (still
loading its model, or hung) is left to its watchdog. What became of each is said in a wait's
report, so a request waiting for that memory says what it waits for.
"""

from __future__ import annotations

import logging
import os
import stat
import struct
import threading
from pathlib import Path

from ..host.lines import peer_credentials
from ..protocol import ProtocolError, connect, recv_line, send_line
from ..worker_base import IN_FLIGHT_FILE

__all__ = ["Orphans"]

log = logging.getLogger("resident_pool.admission")
ASK_TIMEOUT_S = 5.0  # a worker answers a shutdown between requests; a stuck one is its watchdog's
AGAIN_S = 2.0  # how often a busy orphan is looked at again
WAITS = "it exits once idle for its orphan_grace_s (120 s by default) with its pool gone"


class Orphans:
    """The run folders a previous pool of this user left, listed when this pool starts, and what became of each."""

    def __init__(self, workers_dir: Path) -> None:
        """Lists ``workers_dir`` now: every folder there is a dead pool's (this pool has started none yet)."""
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
        else:
            self._say(pid, f"did not answer a shutdown: {WAITS}")
        return True

    def _say(self, pid: int, words: str) -> None:
        with self._lock:
            self._said[pid] = words


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
