"""One resident worker without a host pool: start it on first use, reuse it, retire it when idle.

``ResidentWorker`` is a ``WorkerProcess`` plus the policy a standalone worker needs: a lock
so callers queue, requests over one held connection, and its own keeper thread (heartbeat
and idle retirement). Under the host pool none of this runs: the pool owns its workers.
"""

from __future__ import annotations

import itertools
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

from ..errors import RequestTimeout, WorkerRequestError
from ..host.procs import Spawner, child_env
from ..protocol import CONNECT_TIMEOUT_S, DEFAULT_REQUEST_TIMEOUT_S, ProtocolError, connect, recv_line, send_line
from .transcripts import read_tail, render_tail
from .worker_process import HEARTBEAT_INTERVAL_S, PROTOCOL_PATH, WORKER_BASE_PATH, Launch, WorkerProcess
from .worker_states import WorkerState

__all__ = ["PROTOCOL_PATH", "WORKER_BASE_PATH", "Admitter", "ResidentWorker", "child_env", "read_tail"]

log = logging.getLogger("resident_pool.supervisor")
_ids = itertools.count(1)

BuildCommand = Callable[["ResidentWorker"], "Launch | tuple[list[str], Mapping[str, str | None]]"]


class Admitter(Protocol):
    """What asks before a worker that declares a budget starts, and hears when it is gone."""

    def admit(self, worker: Any) -> Mapping[str, str | None]:
        """Block until ``worker`` fits; return environment for it (CUDA_VISIBLE_DEVICES)."""

    def release(self, worker: Any) -> None:
        """``worker``'s process is gone; give its budget back."""


class ResidentWorker:
    """Supervises one worker process of one provider (one replica), standalone."""

    def __init__(
        self,
        slug: str,
        build_command: BuildCommand,
        start_timeout_s: float = 900.0,
        request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
        idle_timeout_s: float = 0.0,
        vram_budget_gb: float | None = None,
        admit: bool = True,
        log_path: str | os.PathLike[str] | None = None,
        manifest: Any = None,
        *,
        replica: int = 0,
        admitter: Admitter | None = None,
        state_dir: str | os.PathLike[str] | None = None,
        connect_timeout_s: float = CONNECT_TIMEOUT_S,
        spawner: Spawner | None = None,
    ) -> None:
        """``spawner``: a zygote to fork each start from (``zygote.Zygote``); None spawns every start."""
        self.slug = slug
        self.build_command = build_command
        self.start_timeout_s = start_timeout_s
        self.request_timeout_s = request_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.vram_budget_gb = vram_budget_gb
        self.admit = admit
        self.log_path = Path(log_path) if log_path else None
        self.manifest = manifest
        self.replica = replica
        self.admitter = admitter
        self.connect_timeout_s = connect_timeout_s
        self.spawner = spawner
        self._state_dir = Path(state_dir) if state_dir else None

        self.state = WorkerState.STOPPED
        self.last_error: Exception | None = None
        self.starts = 0
        self.served = 0
        self.last_used = time.monotonic()

        self._lock = threading.RLock()  # held for a whole request: callers queue
        self._handle: WorkerProcess | None = None
        self._conn: socket.socket | None = None
        self._buf = bytearray()
        self._admitted = False
        self._keeper: threading.Thread | None = None
        self._keeper_stop = threading.Event()

    @property
    def _process(self) -> WorkerProcess:
        """The current (or the next) worker process; made when first needed, so a bad path fails at start."""
        if self._handle is None:
            self._handle = self._new_process()
        return self._handle

    def _new_process(self) -> WorkerProcess:
        return WorkerProcess(self.slug, self.replica, state_dir=self._state_dir, log_path=self.log_path,
                             start_timeout_s=self.start_timeout_s, connect_timeout_s=self.connect_timeout_s)

    def _transition(self, new: WorkerState, why: str = "") -> None:
        if new is not self.state:
            log.debug("%s[%d]: %s -> %s %s", self.slug, self.replica, self.state.value, new.value, why)
            self.state = new

    # -- facts -------------------------------------------------------------
    @property
    def socket_path(self) -> str:
        """Where the current (or the next) worker process listens."""
        return self._process.socket_path

    @property
    def heartbeat_path(self) -> Path:
        return self._process.heartbeat_path

    @property
    def device(self) -> str | None:
        return self._handle.device if self._handle else None

    @property
    def pid(self) -> int | None:
        return self._handle.pid if self._handle else None

    @property
    def returncode(self) -> int | None:
        return self._handle.returncode if self._handle else None

    @property
    def transcript(self) -> Path | None:
        path = self._handle.transcript_path if self._handle else None
        return Path(path) if path else None

    @property
    def started_at(self) -> float | None:
        return self._handle.started_at if self._handle else None

    def is_running(self) -> bool:
        return self._handle is not None and self._handle.alive()

    def idle_s(self) -> float:
        return time.monotonic() - self.last_used

    def uptime_s(self) -> float | None:
        return self._handle.uptime_s() if self._handle else None

    # -- start -------------------------------------------------------------
    def ensure_started(self) -> None:
        """Start the worker unless it is running with its socket in place."""
        with self._lock:
            if self.is_running():
                if os.path.exists(self.socket_path):
                    return
                self._process.note(f"worker pid {self.pid} is alive without its socket; restarting it")
                self._end(self._process.kill(grace_s=5.0))
            elif self._process.returncode is not None or self._process.proc is not None:
                self._end(self._process.poll())
            self._start()

    def _start(self) -> None:
        self._transition(WorkerState.STARTING)
        if self._process.proc is not None:  # a WorkerProcess starts once; this is a restart
            self._handle = self._new_process()
        admission_env: Mapping[str, str | None] = {}
        try:
            if self.admit and self.vram_budget_gb and self.admitter is not None:
                admission_env = self.admitter.admit(self)
                self._admitted = True
            self._process.device = admission_env.get("CUDA_VISIBLE_DEVICES")
            self.starts += 1
            self._start_keeper()  # the heartbeat must stay fresh while the model loads, however long
            self._process.start(Launch.of(self.build_command(self)), admission_env, spawner=self.spawner)
        except BaseException as exc:
            self._keeper_stop.set()
            self._transition(WorkerState.FAILED, str(exc))
            self.last_error = exc if isinstance(exc, Exception) else None
            if self._process.proc is not None and self._process.returncode is None:
                self._process.kill(grace_s=5.0)
            self._release_admission()
            raise
        self._transition(WorkerState.READY)
        self.last_used = time.monotonic()

    # -- requests ----------------------------------------------------------
    def request(self, payload: Any, timeout: float | None = None) -> Any:
        """Run one prediction and return its result; callers queue on the worker."""
        timeout = timeout or self.request_timeout_s
        with self._lock:
            self.ensure_started()
            self._transition(WorkerState.BUSY)
            try:
                reply = self._roundtrip({"op": "predict", "payload": payload}, timeout)
            except TimeoutError as exc:
                raise self._timed_out(timeout) from exc
            except (OSError, ProtocolError) as exc:
                self._broken(exc)
                raise
            finally:
                self.last_used = time.monotonic()
                if self.state is WorkerState.BUSY:
                    self._transition(WorkerState.READY)
            self.served += 1
            if reply.get("ok"):
                return reply.get("result")
            raise self._reply_error(reply)

    def ping(self) -> dict[str, Any] | None:
        """The worker's own answer to ``ping``, or None when it is not answering."""
        if not self._lock.acquire(timeout=self.connect_timeout_s):
            return None
        try:
            if not self.is_running():
                return None
            return self._roundtrip({"op": "ping"}, timeout=self.connect_timeout_s)
        except (OSError, ProtocolError):
            self._drop_connection()
            return None
        finally:
            self._lock.release()

    def _roundtrip(self, message: dict[str, Any], timeout: float) -> dict[str, Any]:
        if self._conn is None:
            self._conn = connect(self.socket_path, timeout=self.connect_timeout_s)
            self._buf = bytearray()
        request_id = next(_ids)
        self._conn.settimeout(timeout)
        send_line(self._conn, {**message, "id": request_id})
        reply = recv_line(self._conn, self._buf)
        if reply is None:
            raise ConnectionResetError(f"{self.slug}: the worker closed the connection without a reply")
        if reply.get("id") != request_id:
            raise ProtocolError(f"{self.slug}: reply id {reply.get('id')!r} does not match request id {request_id}")
        return reply

    def _timed_out(self, timeout: float) -> RequestTimeout:
        """The request outran its timeout: the worker, which answers serially, is replaced."""
        self._drop_connection()
        self._process.note(f"a request outran request_timeout_s = {timeout:g} s; terminating the worker")
        self._end(self._process.kill(grace_s=5.0))
        tail = read_tail(self._process.transcript_path)
        headline = (f"{self.slug}: a request outran request_timeout_s = {timeout:g} s; the worker was stopped "
                    f"and the next request starts a fresh one; transcript {self._process.transcript_path}")
        return RequestTimeout(headline + render_tail(tail), slug=self.slug, transcript=self._process.transcript_path,
                              transcript_tail=tail, headline=headline, details={"timeout_s": timeout})

    def _broken(self, exc: BaseException) -> None:
        """A request's socket broke: raise worker_died if the process ended; a live one is replaced."""
        self._drop_connection()
        stopping = self.state in (WorkerState.STOPPING, WorkerState.STOPPED)
        rc = self._process.wait_dead()
        if rc is not None:
            self._end(rc)
            raise self._process.died_error(rc, stopping) from exc
        self._process.note(f"request failed on a live worker ({exc}); terminating it")
        self._end(self._process.kill(grace_s=5.0))

    def _reply_error(self, reply: dict[str, Any]) -> WorkerRequestError:
        """The error for a reply with ``ok: false``; a worker_exiting one is reaped first."""
        reason = str(reply.get("reason") or "request_failed")
        if reason != "worker_exiting":
            error = reply.get("error") or "no message"
            return WorkerRequestError(
                f"{self.slug}: request failed: {error}", slug=self.slug, reason=reason,
                transcript=self._process.transcript_path, details={"traceback": reply.get("traceback")},
            )
        self._drop_connection()
        error = self._process.exiting_error(reply)
        self._end(self._process.returncode)
        return error

    # -- stop --------------------------------------------------------------
    def stop(self, grace_s: float = 30.0) -> int | None:
        """Ask the worker to shut down, then SIGTERM and SIGKILL its group; frees the device."""
        self._keeper_stop.set()
        if self._handle is None or self._handle.proc is None:
            return None
        self._transition(WorkerState.STOPPING)
        # A caller mid-request holds the lock; do not wait behind it to stop.
        if self._lock.acquire(blocking=False):
            try:
                self._drop_connection()
            finally:
                self._lock.release()
        rc = self._process.stop(grace_s)
        self._end(rc)
        self._transition(WorkerState.STOPPED)
        return rc

    def close(self) -> None:
        """Stop the worker and its keeper thread."""
        self.stop()

    def _end(self, rc: int | None) -> None:
        """The process is gone (or given up on): give back its budget, end its keeper."""
        self._keeper_stop.set()
        self._drop_connection()
        if self.state not in (WorkerState.STOPPING, WorkerState.STOPPED, WorkerState.FAILED):
            self._transition(WorkerState.EXITED, f"rc {rc}")
        self._release_admission()

    def _release_admission(self) -> None:
        if self._admitted and self.admitter is not None:
            self._admitted = False
            self.admitter.release(self)

    def _drop_connection(self) -> None:
        if self._conn is not None:
            try:
                self._conn.close()
            finally:
                self._conn = None
                self._buf = bytearray()

    # -- the keeper: heartbeat and idle retirement -------------------------
    def _start_keeper(self) -> None:
        self._keeper_stop = threading.Event()
        self._keeper = threading.Thread(target=self._keep, args=(self._process, self._keeper_stop),
                                        name=f"keeper-{self.slug}-{self.replica}", daemon=True)
        self._keeper.start()

    def _keep(self, process: WorkerProcess, stop: threading.Event) -> None:
        """Beat the heartbeat while this process lives; retire it once idle (never mid-request)."""
        interval = HEARTBEAT_INTERVAL_S
        if self.idle_timeout_s > 0:
            interval = min(interval, max(0.05, self.idle_timeout_s / 4))
        while not stop.wait(interval):
            if process.returncode is not None:
                return
            process.beat()  # from before the spawn: a long model load must not look like a dead supervisor
            if process.proc is None or self.state is not WorkerState.READY:
                continue
            if not process.alive():
                return
            if self.idle_timeout_s <= 0 or self.idle_s() < self.idle_timeout_s:
                continue
            if not self._lock.acquire(blocking=False):  # a request in flight holds the lock: busy is never idle
                continue
            try:
                if process is self._process and process.alive() and self.idle_s() >= self.idle_timeout_s:
                    process.note(f"idle for {self.idle_s():.1f} s (idle_timeout_s = {self.idle_timeout_s:g}); "
                                 "retiring")
                    self.stop()
                    return
            finally:
                self._lock.release()
