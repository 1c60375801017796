"""One resident worker: start it on first use, reuse it, retire it when idle."""

from __future__ import annotations

import itertools
import logging
import os
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

from . import paths
from .errors import WorkerRequestError, WorkerStartError
from .exits import describe_exit, exit_hint
from .procs import terminate_group, wait_exit
from .protocol import (
    CONNECT_TIMEOUT_S,
    DEFAULT_REQUEST_TIMEOUT_S,
    ProtocolError,
    check_socket_path,
    connect,
    recv_line,
    send_line,
)
from .states import WorkerState

__all__ = ["Admitter", "ResidentWorker", "child_env", "read_tail"]

log = logging.getLogger("resident_pool.supervisor")

PROTOCOL_PATH = str(Path(__file__).with_name("protocol.py"))
WORKER_BASE_PATH = str(Path(__file__).with_name("worker_base.py"))
TAIL_LINES = 20
# After a broken socket, how long to wait for the process to become reapable
# before deciding it is alive (the request outran its timeout) rather than dead.
_DEATH_WAIT_S = 2.0
_ids = itertools.count(1)

BuildCommand = Callable[["ResidentWorker"], tuple[list[str], Mapping[str, str | None]]]


class Admitter(Protocol):
    """What the supervisor asks before it starts a worker that declares a budget."""

    def admit(self, worker: ResidentWorker) -> Mapping[str, str | None]:
        """Block until ``worker`` fits; return environment for it (CUDA_VISIBLE_DEVICES)."""

    def release(self, worker: ResidentWorker) -> None:
        """``worker``'s process is gone; give its budget back."""


def child_env(extra_env: Mapping[str, str | None], environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """``environ`` with ``extra_env`` layered over it: a str sets, None removes."""
    env = dict(os.environ if environ is None else environ)
    for name, value in extra_env.items():
        if value is None:
            env.pop(name, None)
        elif isinstance(value, str):
            env[name] = value
        else:
            raise TypeError(f"environment value for {name} must be a str or None, not {type(value).__name__}")
    return env


def read_tail(path: str | os.PathLike[str] | None, lines: int = TAIL_LINES) -> list[str]:
    """The last ``lines`` lines of a transcript, read from its end."""
    if not path:
        return []
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            size = handle.tell()
            handle.seek(max(0, size - 64 * 1024))
            data = handle.read()
    except OSError:
        return []
    return data.decode("utf-8", "replace").splitlines()[-lines:]


class ResidentWorker:
    """Supervises one worker process of one provider (one replica)."""

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
    ) -> None:
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
        self._state_dir = Path(state_dir) if state_dir else None
        self._socket_path: str | None = None

        self.state = WorkerState.STOPPED
        self.last_error: Exception | None = None
        self.starts = 0
        self.served = 0
        self.returncode: int | None = None
        self.transcript: Path | None = None
        self.started_at: float | None = None  # wall clock, for display
        self.last_used = time.monotonic()
        self.device: str | None = None

        self._lock = threading.RLock()  # held for a whole request: callers queue
        self._proc: subprocess.Popen | None = None
        self._conn: socket.socket | None = None
        self._buf = bytearray()
        self._transcript_file = None
        self._admitted = False
        self._started_mono: float | None = None
        self._closed = threading.Event()
        self._reaper: threading.Thread | None = None

    # -- state -------------------------------------------------------------
    def _transition(self, new: WorkerState, why: str = "") -> None:
        if new is not self.state:
            log.debug("%s[%d]: %s -> %s %s", self.slug, self.replica, self.state.value, new.value, why)
            self.state = new

    @property
    def socket_path(self) -> str:
        if self._socket_path is None:
            directory = self._state_dir or paths.state_dir()
            self._socket_path = check_socket_path(directory / f"{self.slug}-{self.replica}.sock")
        return self._socket_path

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def is_running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def idle_s(self) -> float:
        return time.monotonic() - self.last_used

    def uptime_s(self) -> float | None:
        return time.monotonic() - self._started_mono if self.is_running() and self._started_mono else None

    # -- start -------------------------------------------------------------
    def ensure_started(self) -> None:
        """Start the worker unless it is running with its socket in place."""
        with self._lock:
            if self.is_running():
                if os.path.exists(self.socket_path):
                    return
                self._note(f"worker pid {self.pid} is alive without its socket; restarting it")
                self._kill(grace_s=5.0)
            elif self._proc is not None:
                self._reap_exited()
            self._start()

    def _start(self) -> None:
        self._transition(WorkerState.STARTING)
        socket_path = self.socket_path
        admission_env: Mapping[str, str | None] = {}
        if self.admit and self.vram_budget_gb and self.admitter is not None:
            admission_env = self.admitter.admit(self)
            self._admitted = True
        try:
            self._spawn(socket_path, admission_env)
            self._wait_ready(socket_path)
        except BaseException as exc:
            self._transition(WorkerState.FAILED, str(exc))
            self.last_error = exc if isinstance(exc, Exception) else None
            self._release_admission()
            raise
        self._transition(WorkerState.READY)
        self.last_used = time.monotonic()
        self._start_reaper()

    def _spawn(self, socket_path: str, admission_env: Mapping[str, str | None]) -> None:
        try:
            os.unlink(socket_path)
        except FileNotFoundError:
            pass
        self.device = admission_env.get("CUDA_VISIBLE_DEVICES")
        argv, extra_env = self.build_command(self)
        env = child_env(
            {
                "RESIDENT_POOL_PROTOCOL": PROTOCOL_PATH,
                "RESIDENT_POOL_WORKER_BASE": WORKER_BASE_PATH,
                **extra_env,
                **admission_env,
            }
        )
        self._open_transcript(argv)
        self.starts += 1
        try:
            self._proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=self._transcript_file,
                stderr=subprocess.STDOUT,
                env=env,
                # A Ctrl-C to the orchestrator is not the model's, and the
                # worker's children share its group so a stop reaches them.
                start_new_session=True,
                close_fds=True,
            )
        except OSError as exc:
            self._close_transcript()
            raise WorkerStartError(
                f"{self.slug}: cannot execute {argv[0]}: {exc.strerror}; check the provider's interpreter "
                f"and worker script (transcript {self.transcript})",
                slug=self.slug,
                transcript=str(self.transcript),
            ) from exc
        self.returncode = None
        self.started_at = time.time()
        self._started_mono = time.monotonic()
        self._note(f"started pid {self._proc.pid}: {' '.join(argv)}")

    def _open_transcript(self, argv: list[str]) -> None:
        if self.log_path is not None:
            path = self.log_path
        else:
            stamp = time.strftime("%Y%m%d-%H%M%S")
            path = paths.log_dir() / f"{self.slug}-{self.replica}-{stamp}-{os.getpid()}-{self.starts + 1}.log"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._transcript_file = open(path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115 - lives as long as the worker
        except OSError as exc:
            raise WorkerStartError(
                f"{self.slug}: cannot open the transcript {path}: {exc.strerror}; "
                "set RESIDENT_POOL_LOG_DIR to a writable directory with free space",
                slug=self.slug,
                transcript=str(path),
            ) from exc
        self.transcript = path

    def _wait_ready(self, socket_path: str) -> None:
        """Wait until the worker answers a ping: alive means running AND answering."""
        deadline = time.monotonic() + self.start_timeout_s
        delay = 0.005
        while True:
            rc = self._proc.poll()
            if rc is not None:
                self._on_exited(rc)
                raise self._start_error(f"exited before it answered: {describe_exit(rc)}", rc)
            if os.path.exists(socket_path):
                try:
                    self._connect(socket_path)
                    self._roundtrip({"op": "ping"}, timeout=max(1.0, deadline - time.monotonic()))
                    return
                except (OSError, ProtocolError):
                    self._drop_connection()
            if time.monotonic() >= deadline:
                self._note(f"no answer within start_timeout_s={self.start_timeout_s:g}; terminating")
                rc = self._kill(grace_s=5.0)
                raise self._start_error(
                    f"did not answer on {socket_path} within {self.start_timeout_s:g} s "
                    "(start_timeout_s); it was terminated",
                    rc,
                    reason="start_timeout",
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.1)

    def _start_error(self, what: str, rc: int | None, reason: str = "start_failed") -> WorkerStartError:
        tail = read_tail(self.transcript)
        message = f"{self.slug}: worker {what}; transcript {self.transcript}"
        if tail:
            message += "\n  last lines:\n    " + "\n    ".join(tail[-5:])
        return WorkerStartError(
            message, slug=self.slug, reason=reason, exit_code=rc, hint=exit_hint(rc),
            transcript=str(self.transcript), transcript_tail=tail,
        )

    # -- requests ----------------------------------------------------------
    def request(self, payload: Any, timeout: float | None = None) -> Any:
        """Run one prediction and return its result; callers queue on the worker."""
        with self._lock:
            self.ensure_started()
            self._transition(WorkerState.BUSY)
            try:
                reply = self._roundtrip({"op": "predict", "payload": payload}, timeout or self.request_timeout_s)
            except (OSError, ProtocolError) as exc:
                self._on_broken_socket(exc)
                raise
            finally:
                self.last_used = time.monotonic()
                if self.state is WorkerState.BUSY:
                    self._transition(WorkerState.READY)
            self.served += 1
            if reply.get("ok"):
                return reply.get("result")
            raise self.reply_error(reply)

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

    def _connect(self, socket_path: str) -> None:
        self._drop_connection()
        self._conn = connect(socket_path, timeout=self.connect_timeout_s)
        self._buf = bytearray()

    def _roundtrip(self, message: dict[str, Any], timeout: float) -> dict[str, Any]:
        if self._conn is None:
            self._connect(self.socket_path)
        request_id = next(_ids)
        self._conn.settimeout(timeout)
        send_line(self._conn, {**message, "id": request_id})
        reply = recv_line(self._conn, self._buf)
        if reply is None:
            raise ConnectionResetError(f"{self.slug}: the worker closed the connection without a reply")
        if reply.get("id") != request_id:
            raise ProtocolError(f"{self.slug}: reply id {reply.get('id')!r} does not match request id {request_id}")
        return reply

    def _on_broken_socket(self, exc: BaseException) -> None:
        """Tell a dead worker from a slow one; raise worker_died for the former."""
        error = self.broken_error(exc)
        if error is not None:
            raise error from exc

    def broken_error(self, exc: BaseException | str) -> WorkerRequestError | None:
        """After a request's socket broke: the error if the worker died, else None (it is then replaced)."""
        self._drop_connection()
        stopping = self.state in (WorkerState.STOPPING, WorkerState.STOPPED)
        rc = wait_exit(self._proc, _DEATH_WAIT_S) if self._proc is not None else None
        if rc is not None:
            self._on_exited(rc)
            tail = read_tail(self.transcript)
            what = "was stopped while this request ran" if stopping else "died mid-request"
            message = f"{self.slug}: the worker {what}: {describe_exit(rc)}; transcript {self.transcript}"
            if tail:
                message += "\n  last lines:\n    " + "\n    ".join(tail[-5:])
            return WorkerRequestError(
                message, slug=self.slug, reason="worker_stopped" if stopping else "worker_died", exit_code=rc,
                transcript=str(self.transcript), transcript_tail=tail,
            )
        # Alive: the request outran its timeout. A worker answers serially, so
        # it cannot serve anyone until that request ends; replace it.
        self._note(f"request failed on a live worker ({exc}); terminating it")
        self._kill(grace_s=5.0)
        return None

    def reply_error(self, reply: dict[str, Any]) -> WorkerRequestError:
        """The error for a reply with ``ok: false``; a worker_exiting one is reaped first."""
        reason = str(reply.get("reason") or "request_failed")
        error = reply.get("error") or "no message"
        if reason != "worker_exiting":
            return WorkerRequestError(
                f"{self.slug}: request failed: {error}", slug=self.slug, reason=reason,
                transcript=str(self.transcript), details={"traceback": reply.get("traceback")},
            )
        # The worker answered, then re-raised: reap it so its code is known.
        self._drop_connection()
        rc = wait_exit(self._proc, 10.0)
        if rc is not None:
            self._on_exited(rc)
        code = reply.get("exit_code", rc)
        tail = read_tail(self.transcript)
        return WorkerRequestError(
            f"{self.slug}: the worker is exiting: {error}; {describe_exit(code)}; transcript {self.transcript}",
            slug=self.slug, reason="worker_exiting", exit_code=code,
            transcript=str(self.transcript), transcript_tail=tail,
        )

    # -- stop --------------------------------------------------------------
    def stop(self, grace_s: float = 30.0) -> int | None:
        """Ask the worker to shut down, then SIGTERM and SIGKILL its group; frees the device."""
        if self._proc is None:
            return None
        self._transition(WorkerState.STOPPING)
        # A caller mid-request holds the lock; do not wait behind it to stop.
        if self._lock.acquire(blocking=False):
            try:
                if self.is_running() and self._conn is not None:
                    try:
                        self._roundtrip({"op": "shutdown"}, timeout=min(grace_s, 5.0))
                    except (OSError, ProtocolError):
                        pass  # escalation below handles a worker that did not answer
                    wait_exit(self._proc, grace_s)
            finally:
                self._lock.release()
        rc = self._kill(grace_s=min(grace_s, 10.0))
        self._transition(WorkerState.STOPPED)
        return rc

    def close(self) -> None:
        """Stop the worker and its idle reaper."""
        self._closed.set()
        self.stop()

    def _kill(self, grace_s: float) -> int | None:
        proc = self._proc
        if proc is None:
            return None
        self._drop_connection()
        rc = terminate_group(proc, grace_s)
        self._on_exited(rc)
        return rc

    def _reap_exited(self) -> None:
        rc = self._proc.poll()
        if rc is not None:
            self._on_exited(rc)

    def _on_exited(self, rc: int) -> None:
        """The process is gone: record it, give back its budget, clean up its socket."""
        if self.returncode is None:
            self._note(f"pid {self._proc.pid} ended: {describe_exit(rc)}")
        self.returncode = rc
        self._drop_connection()
        if self.state not in (WorkerState.STOPPING, WorkerState.STOPPED, WorkerState.FAILED):
            self._transition(WorkerState.EXITED)
        self._release_admission()
        try:
            os.unlink(self.socket_path)
        except (FileNotFoundError, ValueError):
            pass
        self._close_transcript()

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

    def _note(self, message: str) -> None:
        """A line in the transcript (and the log) from the supervisor's side."""
        log.info("%s[%d]: %s", self.slug, self.replica, message)
        if self._transcript_file is not None and not self._transcript_file.closed:
            try:
                self._transcript_file.write(f"--- resident-pool {time.strftime('%H:%M:%S')}: {message}\n")
            except OSError:
                pass  # a full disk must not turn a stop into a crash

    def _close_transcript(self) -> None:
        if self._transcript_file is not None:
            try:
                self._transcript_file.close()
            except OSError:
                pass
            self._transcript_file = None

    # -- idle retirement ---------------------------------------------------
    def _start_reaper(self) -> None:
        if self.idle_timeout_s <= 0 or (self._reaper is not None and self._reaper.is_alive()):
            return
        self._reaper = threading.Thread(target=self._reap_idle, name=f"reaper-{self.slug}-{self.replica}", daemon=True)
        self._reaper.start()

    def _reap_idle(self) -> None:
        interval = min(1.0, max(0.05, self.idle_timeout_s / 4))
        while not self._closed.wait(interval):
            if not self.is_running() or self.idle_s() < self.idle_timeout_s:
                continue
            # A request in flight holds the lock: busy is never idle.
            if not self._lock.acquire(blocking=False):
                continue
            try:
                if self.is_running() and self.idle_s() >= self.idle_timeout_s:
                    self._note(f"idle for {self.idle_s():.1f} s (idle_timeout_s={self.idle_timeout_s:g}); retiring")
                    self.stop()
            finally:
                self._lock.release()
