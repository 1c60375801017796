"""One worker OS process: spawn it, wait for its first answer, stop its group, say how it ended.

No lock and no timer here: whoever owns the process (a standalone ``ResidentWorker``,
or the pool's replica record) decides when each of these happens, one at a time.
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import shutil
import stat
import struct
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ResidentPoolError, SocketPathTooLong, StateDirError, WorkerRequestError, WorkerStartError
from ..exits import describe_exit, exit_hint
from ..host.paths import Paths
from ..host.procs import ForkRefused, ProcessHandle, Spawner, child_env, terminate_group, wait_exit
from ..protocol import (
    CONNECT_TIMEOUT_S,
    ProtocolError,
    SocketPathError,
    check_socket_path,
    connect,
    recv_line,
    send_line,
)
from ..worker_base import IN_FLIGHT_FILE
from .transcripts import Transcript, read_tail, render_tail

__all__ = ["ARRAYS_PATH", "HEARTBEAT_INTERVAL_S", "PROTOCOL_PATH", "WORKER_BASE_PATH", "Launch", "WorkerProcess",
           "env_for", "shared_files_env"]

log = logging.getLogger("resident_pool.worker_process")

PROTOCOL_PATH = str(Path(__file__).parent.parent / "protocol.py")
WORKER_BASE_PATH = str(Path(__file__).parent.parent / "worker_base.py")
ARRAYS_PATH = str(Path(__file__).parent.parent / "arrays.py")  # found beside protocol.py by the worker
# How often the owner refreshes a worker's heartbeat; workers judge it stale after
# RESIDENT_POOL_HEARTBEAT_STALE_S (30 s by default), so a busy owner may miss a few.
HEARTBEAT_INTERVAL_S = 2.0
# After a request's socket broke, how long to wait for the process to become reapable
# before deciding it is alive rather than dead.
DEATH_WAIT_S = 2.0
_ENGINE_TIMEOUT_S = 30.0
# After a worker acknowledged `shutdown`, how long its interpreter may take to exit before SIGTERM:
# a thread a model library left running would otherwise hold the exit for the whole grace.
SHUTDOWN_EXIT_S = 3.0
# The asker's own failures (out of descriptors, of memory): never a worker that did not answer.
OWN_FAILURES = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})
# After a worker answered `worker_exiting`, how long it may take to exit before it is stopped.
EXITING_GRACE_S = 5.0


@dataclass(frozen=True)
class Launch:
    """How to run one worker: its argv, the environment changes (None removes), and its engine's stop."""

    argv: list[str]
    env: Mapping[str, str | None] = field(default_factory=dict)
    stop: list[str] | None = None  # asks a container engine to stop it (`docker stop NAME`)
    kill: list[str] | None = None  # makes the engine kill it (`docker kill NAME`)
    kit: dict[str, Any] | None = None  # what the kit it runs under said of itself, for provenance
    # Where it runs (its work_root); never the folder of whoever started the pool, where a planted module
    # would shadow the worker's imports (`python -m` puts the working folder first on sys.path).
    # None: its own run folder.
    cwd: str | None = None

    def __post_init__(self) -> None:
        # A builder may give path objects (or bytes), as Popen takes them: each item is text from here on, so
        # every place that joins or passes an argv (the transcript's note, a fork) takes it as Popen would.
        for name in ("argv", "stop", "kill"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, [_argument(item, name, at) for at, item in enumerate(value)])

    def __iter__(self):
        """``argv, extra_env = launch``: the original design's ``(argv, extra_env)`` pair."""
        return iter((self.argv, self.env))

    @classmethod
    def of(cls, built: Launch | tuple[list[str], Mapping[str, str | None]]) -> Launch:
        """A build_command's answer: a Launch, or the spec's ``(argv, extra_env)``."""
        if isinstance(built, Launch):
            return built
        argv, env = built
        return cls(list(argv), dict(env))


def _argument(item: Any, name: str, at: int) -> str:
    """One argv item as text: a str, bytes or os.PathLike (a pathlib.Path), as Popen takes them."""
    try:
        return os.fsdecode(item)
    except TypeError:
        raise TypeError(f"the worker's {name}[{at}] is {item!r} ({type(item).__name__}): give a str, bytes or "
                        "path, as Popen takes them (str(value) for a number)") from None


class WorkerProcess:
    """The OS side of one worker start: its run folder (socket, heartbeat), process group and transcript."""

    def __init__(
        self,
        slug: str,
        replica: int,
        *,
        paths: Paths,
        kill_grace_s: float,
        log_path: Path | None = None,
        start_timeout_s: float = 900.0,
        connect_timeout_s: float = CONNECT_TIMEOUT_S,
    ) -> None:
        """``paths``: where its run folder and transcript go; ``kill_grace_s``: between SIGTERM and SIGKILL whenever
        it is stopped (RESIDENT_POOL_KILL_GRACE_S, handed down)."""
        self.slug = slug
        self.replica = replica
        self.start_timeout_s = start_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.kill_grace_s = kill_grace_s
        self.log_path = log_path
        self.paths = paths
        self.run_dir = paths.workers_dir() / f"{slug}-{replica}-{secrets.token_hex(3)}"
        try:
            self.socket_path = check_socket_path(self.run_dir / "worker.sock")
        except SocketPathError as exc:
            raise SocketPathTooLong(f"{slug}: {exc}", slug=slug) from None
        self.heartbeat_path = self.run_dir / "heartbeat"
        self.device: str | None = None  # set by the owner from admission, before the command is built
        self.transcript: Transcript | None = None
        self.proc: ProcessHandle | None = None  # a Popen, or a ForkedProcess when a zygote forked it
        self.started_by: str | None = None  # "spawn", or "zygote <pid>"
        self.launch: Launch | None = None
        self.returncode: int | None = None
        self.started_at: float | None = None  # wall clock, for display
        self._started_mono: float | None = None

    # -- facts -----------------------------------------------------------------
    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def transcript_path(self) -> str | None:
        return str(self.transcript.path) if self.transcript is not None else None

    def poll(self) -> int | None:
        """The return code once the process has ended (it is then reaped and cleaned up), else None."""
        if self.proc is None:
            return self.returncode
        rc = self.proc.poll()
        if rc is not None:
            self._ended(rc)
        return rc

    def alive(self) -> bool:
        return self.proc is not None and self.poll() is None

    def uptime_s(self) -> float | None:
        return time.monotonic() - self._started_mono if self._started_mono is not None and self.alive() else None

    def tail(self) -> list[str]:
        return read_tail(self.transcript_path)

    def note(self, message: str) -> None:
        log.info("%s[%d]: %s", self.slug, self.replica, message)
        if self.transcript is not None:
            self.transcript.note(message)

    # -- start -----------------------------------------------------------------
    def start(
        self,
        launch: Launch,
        extra_env: Mapping[str, str | None] | None = None,
        *,
        spawner: Spawner | None = None,
        on_spawn: Callable[[int], None] | None = None,
        cancelled: Callable[[], str | None] | None = None,
    ) -> dict[str, Any]:
        """Start the worker and wait until it answers a ping; returns that first answer.

        With a ``spawner`` (a zygote) the worker is forked from it; where it refuses, the
        worker is spawned as usual and the transcript says why. ``on_spawn(pid)`` runs as
        soon as the process exists (the ledger then names it, so a pool that dies during a
        long model load leaves its budget held by the loading worker, not by a dead pid).
        ``cancelled()`` returning a reason ends the wait: the worker is stopped and the start
        fails with ``start_cancelled``.
        """
        if self.proc is not None:
            raise RuntimeError(f"{self.slug}[{self.replica}]: a WorkerProcess starts once; make a new one")
        self.launch = launch
        self.run_dir.mkdir(mode=0o700)
        self.beat()
        try:
            self.transcript = (Transcript.append_to(self.log_path) if self.log_path is not None
                               else Transcript.create(self.paths.log_dir(), self.slug, self.replica))
        except StateDirError as exc:  # the log folder itself is unusable: its own words name it and the fix
            self._cleanup()
            raise WorkerStartError(f"{self.slug}: {exc}", slug=self.slug) from exc
        except OSError as exc:
            self._cleanup()
            where = self.log_path or self.paths.logs
            raise WorkerStartError(
                f"{self.slug}: cannot open the transcript under {where}: {exc.strerror}; set RESIDENT_POOL_LOG_DIR "
                "to a writable directory with free space", slug=self.slug) from exc
        env = child_env({**env_for(self), **launch.env, **(extra_env or {})})
        cwd = launch.cwd or str(self.run_dir)
        if spawner is not None:
            try:
                self.proc = spawner.fork(launch.argv, env, self.transcript.fileno(), cwd)
            except ForkRefused as exc:
                self.note(f"not forked from a zygote: {exc}; spawning it instead")
            else:
                self.started_by = f"zygote {getattr(spawner, 'pid', '?')}"
                return self._started(launch, f"forked pid {self.proc.pid} from zygote {getattr(spawner, 'pid', '?')}",
                                     on_spawn, cancelled)
        try:
            self.proc = subprocess.Popen(
                launch.argv,
                stdin=subprocess.DEVNULL,
                stdout=self.transcript.fileno(),
                stderr=subprocess.STDOUT,
                env=env,
                cwd=cwd,
                # A Ctrl-C to the orchestrator is not the model's, and the worker's
                # children share its group so a stop reaches them.
                start_new_session=True,
                close_fds=True,
            )
        except OSError as exc:
            self._cleanup()
            headline = (f"{self.slug}: cannot execute {launch.argv[0]}: {exc.strerror}; check the provider's "
                        f"interpreter and worker script (transcript {self.transcript_path})")
            raise WorkerStartError(headline, slug=self.slug, transcript=self.transcript_path) from exc
        self.started_by = "spawn"
        return self._started(launch, f"started pid {self.proc.pid}", on_spawn, cancelled)

    def _started(self, launch: Launch, how: str, on_spawn: Callable[[int], None] | None,
                 cancelled: Callable[[], str | None] | None) -> dict[str, Any]:
        self.started_at = time.time()
        self._started_mono = time.monotonic()
        self.note(f"{how}: {' '.join(launch.argv)}")
        if on_spawn is not None:
            on_spawn(self.proc.pid)
        return self._wait_ready(cancelled)

    def _wait_ready(self, cancelled: Callable[[], str | None] | None = None) -> dict[str, Any]:
        """Alive means running AND answering: wait for the first ping's answer."""
        deadline = time.monotonic() + self.start_timeout_s
        delay = 0.005
        while True:
            rc = self.poll()
            if rc is not None:
                raise self.error(WorkerStartError, "exited before it answered", rc, "start_failed")
            why = cancelled() if cancelled is not None else None
            if why:
                self.note(f"start cancelled ({why}); stopping it")
                rc = self.kill()
                raise self.error(WorkerStartError, f"was stopped while it started: {why}", rc, "start_cancelled",
                                 describe=False)
            if os.path.exists(self.socket_path):
                answer = self.ping(timeout=max(1.0, deadline - time.monotonic()))
                if answer is not None:
                    return answer
            if time.monotonic() >= deadline:
                self.note(f"no answer within start_timeout_s = {self.start_timeout_s:g} s; terminating")
                rc = self.kill()
                raise self.error(
                    WorkerStartError,
                    f"did not answer on {self.socket_path} within start_timeout_s = {self.start_timeout_s:g} s "
                    "and was terminated", rc, "start_timeout", describe=False)
            time.sleep(delay)
            delay = min(delay * 2, 0.1)

    # -- talking to it ---------------------------------------------------------------
    def ping(self, timeout: float | None = None, raise_own: bool = False) -> dict[str, Any] | None:
        """The worker's answer to ``ping`` on a connection of its own, or None when it gives none in time.

        ``raise_own``: an ``OSError`` of the asker's own (out of descriptors or memory) is raised, not taken
        for a worker that did not answer.
        """
        return self._ask("ping", timeout, raise_own)

    def stats(self, timeout: float | None = None) -> dict[str, Any] | None:
        """The worker's own counts (requests, failures, latency histogram), or None when it gives none in time."""
        return self._ask("stats", timeout)

    def recall(self, lease: str, timeout: float) -> dict[str, Any] | None:
        """Take back the kept lease ``lease``: the worker refuses later requests naming it, and answers once any
        request in flight is over (``idle_s``: how long it has been idle since; ``served``: requests it served on
        that lease); None when it gives no answer. An OSError of the asker's own (EMFILE) is raised."""
        return self._ask("recall", timeout, raise_own=True, lease=lease)

    def _ask(self, op: str, timeout: float | None, raise_own: bool = False, **fields: Any) -> dict[str, Any] | None:
        timeout = self.connect_timeout_s if timeout is None else timeout
        try:
            with connect(self.socket_path, timeout=min(timeout, self.connect_timeout_s)) as conn:
                conn.settimeout(timeout)
                send_line(conn, {"op": op, "id": 0, **fields})
                answer = recv_line(conn, bytearray())
        except OSError as exc:
            if raise_own and exc.errno in OWN_FAILURES:
                raise
            return None
        except (ProtocolError, ValueError):
            return None
        return answer if answer is not None and answer.get("ok") else None

    def in_flight_s(self) -> float | None:
        """How long the worker's current request has run (it writes its start time), or None when idle."""
        # The worker owns this file: a FIFO or a link there must not hang or redirect the pool's read.
        try:
            fd = os.open(self.run_dir / IN_FLIGHT_FILE, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return None
            (started,) = struct.unpack("d", os.read(fd, 8))
        except (OSError, struct.error):
            return None
        finally:
            os.close(fd)
        now = time.time()
        return now - started if 0 < started <= now else None

    def beat(self) -> None:
        """Refresh the heartbeat the worker watches; a worker that sees it go stale retires itself.

        The worker can write its run folder (from inside a container too): whatever it left under the
        heartbeat's name that is not a regular file of ours (a link to a host file, a FIFO) is removed
        and a new file made in its place, never followed.
        """
        try:
            fd = os.open(self.heartbeat_path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            self._new_heartbeat()
            return
        except OSError:  # a symlink (ELOOP) or a socket (ENXIO)
            self._new_heartbeat(replace=True)
            return
        try:
            found = os.fstat(fd)
            ours = stat.S_ISREG(found.st_mode) and found.st_uid == os.getuid() and found.st_nlink == 1
            if ours:
                os.utime(fd)
        finally:
            os.close(fd)
        if not ours:
            self._new_heartbeat(replace=True)

    def _new_heartbeat(self, replace: bool = False) -> None:
        if replace:
            try:
                os.unlink(self.heartbeat_path)
            except IsADirectoryError:
                shutil.rmtree(self.heartbeat_path, ignore_errors=True)  # fd-based on Linux: links inside stay put
            except FileNotFoundError:
                pass
        try:
            os.close(os.open(self.heartbeat_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                             0o600))
        except FileExistsError:
            pass  # the worker planted something again in between: the next beat looks again
        except FileNotFoundError:
            pass  # the run folder is gone: the worker has ended

    # -- how it ended ----------------------------------------------------------------
    def error(self, cls: type[ResidentPoolError], what: str, rc: int | None, reason: str,
              describe: bool = True) -> ResidentPoolError:
        """An error naming what happened, the exit in words, the transcript and its last lines."""
        tail = self.tail()
        exit_words = f": {describe_exit(rc)}" if describe else ""
        headline = f"{self.slug}: the worker {what}{exit_words}; transcript {self.transcript_path}"
        return cls(headline + render_tail(tail), slug=self.slug, reason=reason, exit_code=rc, hint=exit_hint(rc),
                   transcript=self.transcript_path, transcript_tail=tail, headline=headline)

    def wait_dead(self, timeout: float = DEATH_WAIT_S) -> int | None:
        """Its return code if it ends within ``timeout`` (a socket just broke), else None: it lives."""
        if self.proc is None:
            return self.returncode
        rc = wait_exit(self.proc, timeout)
        if rc is not None:
            self._ended(rc)
        return rc

    def died_error(self, rc: int, stopping: bool = False) -> WorkerRequestError:
        what = "was stopped while this request ran" if stopping else "died mid-request"
        return self.error(WorkerRequestError, what, rc, "worker_stopped" if stopping else "worker_died")

    def exiting_error(self, reply: dict[str, Any]) -> WorkerRequestError:
        """The worker answered ``worker_exiting`` and is leaving: reap it (stop it if it stays), then name its code.

        The reply is the worker's word: an ``exit_code`` that is not an int counts as none, and a process
        still running ``EXITING_GRACE_S`` after it said it was leaving is stopped, not forgotten.
        """
        rc = self.wait_dead(EXITING_GRACE_S)
        if rc is None and self.proc is not None:
            self.note(f"said it was exiting but still ran {EXITING_GRACE_S:g} s later; stopping it")
            rc = self.kill()
        code = reply.get("exit_code")
        if not isinstance(code, int) or isinstance(code, bool):  # None: a KeyboardInterrupt; its signal is the truth
            code = rc
        message = str(reply.get("error") or "no message")
        tail = self.tail()
        headline = (f"{self.slug}: the worker is exiting: {message}; {describe_exit(code)}; "
                    f"transcript {self.transcript_path}")
        return WorkerRequestError(
            headline + render_tail(tail), slug=self.slug, reason="worker_exiting", exit_code=code,
            transcript=self.transcript_path, transcript_tail=tail, headline=headline,
            details={"type": reply.get("type"), "traceback": reply.get("traceback")})

    # -- stop --------------------------------------------------------------------------
    def stop(self, grace_s: float = 30.0) -> int | None:
        """Ask it to shut down, wait, then SIGTERM and SIGKILL its group; frees the device.

        ``grace_s`` bounds the whole ask; the SIGTERM's grace is the kill grace, or less when ``grace_s`` is.
        """
        if self.proc is None:
            return self.returncode
        if self.alive():
            try:
                with connect(self.socket_path, timeout=min(grace_s, self.connect_timeout_s)) as conn:
                    conn.settimeout(min(grace_s, 5.0))
                    send_line(conn, {"op": "shutdown", "id": 0})
                    acknowledged = recv_line(conn, bytearray()) is not None
            except (OSError, ProtocolError, ValueError):
                acknowledged = False  # busy, hung or unreachable: the escalation below ends it
            if acknowledged:  # serve() has returned; a leftover non-daemon thread must not hold the exit long
                self.wait_dead(min(grace_s, SHUTDOWN_EXIT_S))
        return self.kill(grace_s=min(grace_s, self.kill_grace_s))

    def kill(self, grace_s: float | None = None) -> int | None:
        """SIGTERM the group (through the container engine where there is one), then SIGKILL after ``grace_s``
        (the kill grace by default)."""
        if self.proc is None:
            return self.returncode
        grace_s = self.kill_grace_s if grace_s is None else grace_s
        if self.launch is not None and self.launch.stop and self.proc.poll() is None:
            self._engine(self.launch.stop, grace_s + 5.0)
        # Even when the leader has exited, its children (DataLoader workers) may not have: the group goes.
        rc = terminate_group(self.proc, grace_s)
        if self.launch is not None and self.launch.kill:
            self._engine(self.launch.kill, _ENGINE_TIMEOUT_S)  # the engine's client may be gone; its container not
        if rc is None:
            self.note(f"pid {self.proc.pid} did not end after SIGKILL (uninterruptible sleep in a driver?); "
                      "its memory may stay held until it does")
            return None
        self._ended(rc)
        return rc

    def _engine(self, argv: list[str], timeout: float) -> None:
        try:
            subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           timeout=timeout, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            self.note(f"{' '.join(argv)} failed: {exc}")

    def _ended(self, rc: int) -> None:
        """The process is gone: record how, remove its run folder, close its transcript."""
        if self.returncode is not None:
            return
        self.returncode = rc
        self.note(f"pid {self.proc.pid} ended: {describe_exit(rc)}")
        self._cleanup()

    def _cleanup(self) -> None:
        # The run folder is this start's alone (its name carries a random token): its socket and
        # heartbeat go with it, so a worker that somehow outlived this sees its pool gone.
        shutil.rmtree(self.run_dir, ignore_errors=True)
        if self.transcript is not None:
            self.transcript.close()


def shared_files_env() -> dict[str, str]:
    """Where a worker finds protocol.py and worker_base.py, under the project's names and the original design's."""
    return {"RESIDENT_POOL_PROTOCOL": PROTOCOL_PATH, "RESIDENT_POOL_WORKER_BASE": WORKER_BASE_PATH,
            "TOOLUNIVERSE_REMOTE_PROTOCOL": PROTOCOL_PATH, "TOOLUNIVERSE_REMOTE_WORKER_BASE": WORKER_BASE_PATH}


def env_for(process: WorkerProcess) -> dict[str, str]:
    """What every worker is told about its pool: protocol, worker base and heartbeat paths."""
    return {**shared_files_env(), "RESIDENT_POOL_HEARTBEAT": str(process.heartbeat_path)}
