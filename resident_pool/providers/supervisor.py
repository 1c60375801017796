"""One resident worker without a host pool: start it on first use, reuse it, retire it when idle.

``ResidentWorker`` is a ``WorkerProcess`` plus the policy a standalone worker needs: a lock
so callers queue, requests over one held connection, and its own keeper thread (heartbeat
and idle retirement). Under the host pool none of this runs: the pool owns its workers.

It is also the original design's caller API: a public ``lock``, ``request(message)``
returning the whole reply, ``child_env``, ``CommandBuilder``, the two errors (both
``RuntimeError``s), ``EXIT_HINTS`` and ``exit_hint`` in the original's shape.
"""

from __future__ import annotations

import itertools
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol

from .. import exits
from ..admission import Admission, Ledger, read_devices
from ..errors import RequestTimeout, WorkerRequestError, WorkerStartError
from ..exits import EXIT_HINTS
from ..host.paths import Paths
from ..host.procs import Spawner, child_env
from ..protocol import CONNECT_TIMEOUT_S, DEFAULT_REQUEST_TIMEOUT_S, ProtocolError, connect, recv_line, send_line
from ..settings import Settings, settings
from .transcripts import read_tail, render_tail
from .worker_process import HEARTBEAT_INTERVAL_S, PROTOCOL_PATH, WORKER_BASE_PATH, Launch, WorkerProcess
from .worker_states import WORKER_EDGES, WorkerState

__all__ = ["EXIT_HINTS", "PROTOCOL_PATH", "WORKER_BASE_PATH", "Admitter", "BuildCommand", "CommandBuilder", "CpuOnly",
           "ResidentWorker", "WorkerRequestError", "WorkerStartError", "WorkerState", "WorkerTransitionError",
           "child_env", "exit_hint", "read_tail"]

log = logging.getLogger("resident_pool.supervisor")
_ids = itertools.count(1)

BuildCommand = Callable[["ResidentWorker"], "Launch | tuple[list[str], Mapping[str, str | None]]"]
CommandBuilder = BuildCommand  # the original design's name


def exit_hint(rc: int | None) -> str:
    """`` — <words>`` for a return code the exit table names (a signal included), else ``""``.

    The original design's shape, for appending to a message; the words are the one table's
    (``resident_pool.exits``), so the two shapes never disagree on what a code means.
    """
    words = exits.exit_hint(rc) if isinstance(rc, int) and not isinstance(rc, bool) else None
    return f" \u2014 {words}" if words else ""


class WorkerTransitionError(RuntimeError):
    """A move the worker state table does not allow: a bug, raised rather than let happen."""


class Admitter(Protocol):
    """What asks before a worker that declares a budget starts, and hears when it is gone."""

    def admit(self, worker: Any) -> Mapping[str, str | None]:
        """Block until ``worker`` fits; return environment for it (CUDA_VISIBLE_DEVICES)."""

    def release(self, worker: Any) -> None:
        """``worker``'s process is gone; give its budget back."""


class CpuOnly:
    """Admission for a "recommended" GPU provider on a host with no GPU: it runs on the CPU."""

    def admit(self, worker: Any, **_: Any) -> dict[str, str]:
        return {"CUDA_VISIBLE_DEVICES": ""}

    def release(self, worker: Any) -> None:
        pass


_host_admissions: dict[tuple[Any, ...], Admission] = {}
_host_admissions_lock = threading.Lock()


def host_admission(config: Settings, paths: Paths) -> Admission:
    """The host's admission over the pool's own ledger: what a worker with a budget and no admitter goes through.

    One per ledger file (and settings) in this process, so its standalone workers queue in
    order; the ledger is the file the host pool keeps, so each sees what the other holds.
    """
    key = (paths.ledger_path(), config.gpu_headroom_gb, config.ledger_audit, config.fake_nvml, config.gpu_capacity_gb)
    with _host_admissions_lock:
        admission = _host_admissions.get(key)
        if admission is None:
            admission = Admission(Ledger(key[0], audit=config.ledger_audit), devices=lambda: read_devices(config),
                                  headroom_gb=config.gpu_headroom_gb)
            _host_admissions[key] = admission
        return admission


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
        config: Settings | None = None,
        paths: Paths | None = None,
    ) -> None:
        """``admit`` with a ``vram_budget_gb`` and no ``admitter``: the host's admission (``host_admission``), or
        the CPU for a manifest whose GPU is only recommended, on a host with none (as under the pool).
        ``spawner``: a zygote to fork each start from (``zygote.Zygote``); None spawns every start.

        A standalone worker is an edge, as a ``Pool`` is: ``config`` (its folders, ledger, kill grace) is the
        settings as the environment gives them now unless given; ``paths``, the folders ``config`` names;
        ``state_dir`` overrides the state folder alone."""
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
        self.config = config if config is not None else settings()
        self.paths = paths if paths is not None else Paths.of(self.config)
        if state_dir:
            self.paths = replace(self.paths, state=Path(state_dir))

        self.state = WorkerState.STOPPED
        self.last_error: Exception | None = None
        self.starts = 0
        self.served = 0
        self.last_used = time.monotonic()

        # Held for a whole request: callers queue on it (and may hold it across several requests).
        self.lock = threading.RLock()
        self._state_lock = threading.Lock()
        self._stopping = threading.Lock()  # held for a whole stop; a start waits for one in progress
        self._handle: WorkerProcess | None = None
        self._conn: socket.socket | None = None
        self._buf = bytearray()
        self._admitted_by: Admitter | None = None
        self._keeper: threading.Thread | None = None
        self._keeper_stop = threading.Event()

    @property
    def _process(self) -> WorkerProcess:
        """The current (or the next) worker process; made when first needed, so a bad path fails at start."""
        if self._handle is None:
            self._handle = self._new_process()
        return self._handle

    def _new_process(self) -> WorkerProcess:
        return WorkerProcess(self.slug, self.replica, paths=self.paths, kill_grace_s=self.config.kill_grace_s,
                             log_path=self.log_path, start_timeout_s=self.start_timeout_s,
                             connect_timeout_s=self.connect_timeout_s)

    def transition(self, new: WorkerState, why: str = "", only_from: tuple[WorkerState, ...] | None = None) -> bool:
        """Move to ``new`` if the state table allows it from here; raise otherwise. True when it moved.

        ``only_from``: move only from one of these states (checked and moved in one step, as a
        stop from another thread may move it meanwhile); from any other, nothing happens.
        """
        with self._state_lock:
            old = self.state
            if (only_from is not None and old not in only_from) or new is old:
                return False
            if new not in WORKER_EDGES[old]:
                raise WorkerTransitionError(
                    f"{self.slug}[{self.replica}]: {old} -> {new} is not an allowed move ({why})")
            log.debug("%s[%d]: %s -> %s %s", self.slug, self.replica, old, new, why)
            self.state = new
            return True

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
        with self.lock:
            if self.is_running():
                if os.path.exists(self.socket_path):
                    return
                self._process.note(f"worker pid {self.pid} is alive without its socket; restarting it")
                self._end(self._process.kill())
            elif self._process.returncode is not None or self._process.proc is not None:
                self._end(self._process.poll())
            self._start()

    def _start(self) -> None:
        with self._stopping:  # a stop from another thread finishes before this start begins
            self.transition(WorkerState.STARTING)
        if self._process.proc is not None:  # a WorkerProcess starts once; this is a restart
            self._handle = self._new_process()
        admitter = self.admitter
        if admitter is None and self.admit and self.vram_budget_gb:
            admitter = self._host_admitter()
        admission_env: Mapping[str, str | None] = {}
        try:
            if self.admit and self.vram_budget_gb and admitter is not None:
                admission_env = admitter.admit(self)
                self._admitted_by = admitter
            self._process.device = admission_env.get("CUDA_VISIBLE_DEVICES")
            self.starts += 1
            self._start_keeper()  # the heartbeat must stay fresh while the model loads, however long
            # The ledger names the loading worker from its spawn on: its budget stays held if this process dies.
            started = getattr(self._admitted_by, "started", None)
            self._process.start(Launch.of(self.build_command(self)), admission_env, spawner=self.spawner,
                                on_spawn=(lambda pid: started(self)) if started is not None else None)
        except BaseException as exc:
            self._keeper_stop.set()
            self.transition(WorkerState.FAILED, str(exc), only_from=(WorkerState.STARTING,))
            self.last_error = exc if isinstance(exc, Exception) else None
            if self._process.proc is not None and self._process.returncode is None:
                self._process.kill()
            self._release_admission()
            raise
        loaded = getattr(self._admitted_by, "loaded", None)
        if loaded is not None:
            loaded(self)  # its model is loaded: NVML's free memory shows its budget from now on
        self.transition(WorkerState.READY, "answered its first ping", only_from=(WorkerState.STARTING,))
        self.last_used = time.monotonic()

    def _host_admitter(self) -> Admitter:
        """The host's admission; the CPU for a manifest whose GPU is only recommended, on a host with none."""
        gpu = getattr(self.manifest, "gpu", None)
        if getattr(gpu, "policy", None) == "recommended" and not read_devices(self.config)[0]:
            return CpuOnly()
        return host_admission(self.config, self.paths)

    # -- requests ----------------------------------------------------------
    def request(self, message: Any, timeout: float | None = None) -> dict[str, Any]:
        """Send ``message`` and return the worker's whole reply (``{"ok": true, "result": ..., ...}``).

        The original design's call: a dict with an ``op`` is sent as it is; anything else is
        the payload of a ``predict``. A reply with ``ok: false`` raises ``WorkerRequestError``
        (its ``.reason`` the worker's). Callers queue on ``lock``.
        """
        if not (isinstance(message, Mapping) and "op" in message):
            message = {"op": "predict", "payload": message}
        return self._call(dict(message), timeout)

    def predict(self, payload: Any, timeout: float | None = None) -> Any:
        """Run one prediction and return its result; callers queue on the worker."""
        return self._call({"op": "predict", "payload": payload, "id": next(_ids)}, timeout).get("result")

    def _call(self, message: dict[str, Any], timeout: float | None) -> dict[str, Any]:
        timeout = timeout or self.request_timeout_s
        with self.lock:
            self.ensure_started()
            if not self.transition(WorkerState.BUSY, str(message.get("op")), only_from=(WorkerState.READY,)):
                raise WorkerRequestError(
                    f"{self.slug}: the worker was stopped (by another thread) before this request could run",
                    "worker_stopped", slug=self.slug, transcript=self._process.transcript_path)
            try:
                reply = self._roundtrip(message, timeout)
            except TimeoutError as exc:
                raise self._timed_out(timeout) from exc
            except (OSError, ProtocolError) as exc:
                self._broken(exc)
                raise
            finally:
                self.last_used = time.monotonic()
                self.transition(WorkerState.READY, "answered", only_from=(WorkerState.BUSY,))
            if message.get("op") == "predict":
                self.served += 1
            if reply.get("ok"):
                return reply
            raise self._reply_error(reply)

    def ping(self) -> dict[str, Any] | None:
        """The worker's own answer to ``ping``, or None when it is not answering."""
        if not self.lock.acquire(timeout=self.connect_timeout_s):
            return None
        try:
            if not self.is_running():
                return None
            return self._roundtrip({"op": "ping", "id": next(_ids)}, timeout=self.connect_timeout_s)
        except (OSError, ProtocolError):
            return None
        finally:
            self.lock.release()

    def _roundtrip(self, message: dict[str, Any], timeout: float) -> dict[str, Any]:
        """One message and its reply over the held connection; sent as given (an ``id`` is checked if it has one)."""
        try:
            if self._conn is None:
                self._conn = connect(self.socket_path, timeout=self.connect_timeout_s)
                self._buf = bytearray()
            self._conn.settimeout(timeout)
            send_line(self._conn, message)
            reply = recv_line(self._conn, self._buf)
        except BaseException:
            # Whatever cut the exchange short (a timeout, Ctrl-C), its reply may still come on this
            # connection: never let the next request read it as its own.
            self._drop_connection()
            raise
        if reply is None:
            raise ConnectionResetError(f"{self.slug}: the worker closed the connection without a reply")
        if "id" in message and reply.get("id") != message["id"]:
            self._drop_connection()
            raise ProtocolError(
                f"{self.slug}: reply id {reply.get('id')!r} does not match request id {message['id']!r}")
        return reply

    def _timed_out(self, timeout: float) -> RequestTimeout:
        """The request outran its timeout: the worker, which answers serially, is replaced."""
        self._drop_connection()
        self._process.note(f"a request outran request_timeout_s = {timeout:g} s; terminating the worker")
        self._end(self._process.kill())
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
        self._end(self._process.kill())

    def _reply_error(self, reply: dict[str, Any]) -> WorkerRequestError:
        """The error for a reply with ``ok: false``; a worker_exiting one is reaped first."""
        reason = str(reply.get("reason") or "request_failed")
        if reason != "worker_exiting":
            error = reply.get("error") or "no message"
            return WorkerRequestError(
                f"{self.slug}: request failed: {error}", reason, slug=self.slug,
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
        with self._stopping:
            if self._handle is None or self._handle.proc is None:
                return None
            if self.state is WorkerState.STOPPED:
                return self._handle.returncode
            self.transition(WorkerState.STOPPING, "asked to stop")
            # A caller mid-request holds the lock; do not wait behind it to stop.
            if self.lock.acquire(blocking=False):
                try:
                    self._drop_connection()
                finally:
                    self.lock.release()
            rc = self._process.stop(grace_s)
            self._end(rc)
            self.transition(WorkerState.STOPPED, f"rc {rc}")
            return rc

    def close(self) -> None:
        """Stop the worker and its keeper thread."""
        self.stop()

    def _end(self, rc: int | None) -> None:
        """The process is gone (or given up on): give back its budget, end its keeper."""
        self._keeper_stop.set()
        self._drop_connection()
        self.transition(WorkerState.EXITED, f"rc {rc}", only_from=(WorkerState.READY, WorkerState.BUSY))
        self._release_admission()

    def _release_admission(self) -> None:
        admitter, self._admitted_by = self._admitted_by, None
        if admitter is not None:
            admitter.release(self)

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
            if not self.lock.acquire(blocking=False):  # a request in flight holds the lock: busy is never idle
                continue
            try:
                if process is self._process and process.alive() and self.idle_s() >= self.idle_timeout_s:
                    process.note(f"idle for {self.idle_s():.1f} s (idle_timeout_s = {self.idle_timeout_s:g}); "
                                 "retiring")
                    self.stop()
                    return
            finally:
                self.lock.release()
