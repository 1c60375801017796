"""Fork servers (zygotes), pool side: a provider's imports paid once per host, not once per worker start.

``Zygote`` is one zygote process (``zygote_server.py`` run by path in the provider's
interpreter and environment) and its control channel. ``ForkedProcess`` is a worker it
forked, seen through the Popen subset a ``WorkerProcess`` uses (``procs.ProcessHandle``):
the zygote reaps it and reports its return code, since the pool, not its parent, cannot.
``Zygotes`` is the pool's registry: which provider may fork, which zygote serves which
environment, and when one retires.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..exits import LOST_EXIT, describe_exit
from ..host.paths import Paths
from ..host.procs import ForkRefused, child_env, pid_alive, terminate_group
from ..protocol import ready
from .exec_env import interpreter
from .launch import weights_root
from .manifest import ContainerEnv, Manifest
from .transcripts import Transcript, read_tail
from .worker_process import Launch

__all__ = ["ZYGOTE_SERVER_PATH", "ForkedProcess", "Zygote", "Zygotes", "fork_refusal"]

log = logging.getLogger("resident_pool.zygote")

ZYGOTE_SERVER_PATH = str(Path(__file__).parent.parent / "zygote_server.py")
# Set for the zygote alone, never for a worker: torch's device count then asks NVML
# instead of running cuInit, which would leave every fork with a broken CUDA context.
ZYGOTE_ONLY_ENV = {"PYTORCH_NVML_BASED_CUDA_CHECK": "1"}
# What differs from one start to the next; set in each forked child, never in the zygote.
PER_START = frozenset({"RESIDENT_POOL_HEARTBEAT", "CUDA_VISIBLE_DEVICES"})
FORK_REPLY_TIMEOUT_S = 30.0
_EXIT_WAIT_S = 5.0  # how long a zygote whose channel closed may take to exit by itself


class ForkedProcess:
    """A worker a zygote forked: pid, return code (from the zygote's report), poll and wait, as Popen has them."""

    def __init__(self, pid: int, zygote_pid: int | None) -> None:
        self.pid = pid
        self.zygote_pid = zygote_pid
        self.returncode: int | None = None
        self._ended = threading.Event()
        self._orphaned = False
        try:  # a handle on this very process, immune to pid reuse, for when the zygote can no longer report
            self._pidfd: int | None = os.pidfd_open(pid)
        except OSError:
            self._pidfd = None

    def poll(self) -> int | None:
        if not self._ended.is_set() and self._orphaned and self._gone():
            self.exited(LOST_EXIT)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else deadline - time.monotonic()
            if self._ended.wait(0.05 if left is None else max(0.0, min(0.05, left))):
                return self.returncode  # type: ignore[return-value]
            if self.poll() is not None:
                return self.returncode  # type: ignore[return-value]
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(f"forked worker {self.pid}", timeout)

    def exited(self, returncode: int) -> None:
        """The zygote reaped it (or, orphaned, it is gone): record its code once."""
        if self._ended.is_set():
            return
        self.returncode = returncode
        self._ended.set()
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None

    def orphan(self) -> None:
        """Its zygote died: from now on only its liveness can be seen, not its exit status."""
        self._orphaned = True

    def _gone(self) -> bool:
        if self._pidfd is not None:
            return ready(self._pidfd)
        return not pid_alive(self.pid)


@dataclass
class _Pending:
    done: threading.Event = field(default_factory=threading.Event)
    process: ForkedProcess | None = None
    error: str | None = None
    reason: str | None = None


class Zygote:
    """One fork server for one provider environment."""

    def __init__(self, slug: str, key: str, python: str, env: Mapping[str, str | None], script: str,
                 preload: list[str], load: str | None = None, weights: Callable[[], str | None] | None = None,
                 start_timeout_s: float = 900.0, *, paths: Paths, kill_grace_s: float) -> None:
        """``weights``: gives the weights root for the load stage, asked once, when the zygote starts; ``paths``:
        where its transcript goes; ``kill_grace_s``: between SIGTERM and SIGKILL when its group must be ended."""
        self.slug = slug
        self.key = key
        self.python = python
        self.env = dict(env)
        self.script = script
        self.preload = list(preload)
        self.load = load
        self.weights = weights
        self.start_timeout_s = start_timeout_s
        self.paths = paths
        self.kill_grace_s = kill_grace_s
        self.proc: subprocess.Popen | None = None
        self.transcript: Transcript | None = None
        self.info: dict[str, Any] = {}  # its ready event: modules and their seconds, load stage, threads
        self.failure: str | None = None  # why it cannot fork (it then stays down until its key changes)
        self.created = time.monotonic()
        self.last_active = self.created
        self.forks = 0
        self._sock: socket.socket | None = None
        self._send_lock = threading.Lock()  # one message at a time on the channel
        self._state_lock = threading.Lock()  # the pending requests and the children
        self._start_lock = threading.Lock()
        self._pending: dict[int, _Pending] = {}
        self._children: dict[int, ForkedProcess] = {}
        self._ids = itertools.count(1)
        self._reader: threading.Thread | None = None
        self._down = threading.Event()
        self._settled = threading.Event()  # its start ended: ready, or failed (or was never made: stopped first)
        self._stop_asked = threading.Event()

    # -- facts -------------------------------------------------------------------
    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def down(self) -> bool:
        """It has exited (or failed to start): it forks no more."""
        return self._down.is_set()

    def up(self) -> bool:
        return self.proc is not None and not self._down.is_set() and self.failure is None

    @property
    def stopped(self) -> bool:
        """It was asked to stop (it forks no more, and a start under way ends quietly)."""
        return self._stop_asked.is_set()

    def settle(self, timeout: float | None) -> bool:
        """Wait up to ``timeout`` for its start to end (ready or failed); whether it has."""
        return self._settled.wait(timeout)

    def live_children(self) -> list[ForkedProcess]:
        with self._state_lock:
            children = list(self._children.values())
        return [child for child in children if child.poll() is None]

    def stale(self) -> str | None:
        """Why its imports may no longer be what a fresh worker would import (an install since), or None."""
        for entry, stamp in (self.info.get("paths") or {}).items():
            try:
                now = os.stat(entry or ".").st_mtime_ns
            except OSError:
                now = None
            if now != stamp:
                return f"{entry or '.'} changed since it preloaded (an install or upgrade)"
        for path, stamp in (self.info.get("files") or {}).items():
            try:
                now = os.stat(path).st_mtime_ns
            except OSError:
                now = None
            if now != stamp:
                return f"{path}, which it loaded, changed on disk since"
        return None

    def describe(self) -> dict[str, Any]:
        return {"pid": self.pid if self.up() else None, "key": self.key[:12], "preload": self.preload,
                "load": self.load, "modules_s": self.info.get("modules"), "load_s": self.info.get("load_s"),
                "threads": self.info.get("threads"), "forks": self.forks, "workers": len(self.live_children()),
                "transcript": str(self.transcript.path) if self.transcript else None, "failure": self.failure}

    # -- start ---------------------------------------------------------------------
    def ensure_started(self) -> None:
        """Start it (once) and wait for its preload; ForkRefused says why it cannot serve."""
        with self._start_lock:
            if self.failure:
                raise ForkRefused(self.failure)
            if self._down.is_set():
                raise ForkRefused(f"the zygote (pid {self.pid}) has exited")
            if self._stop_asked.is_set() and self.proc is None:
                self._settled.set()
                raise ForkRefused("the zygote was stopped before it started")
            if self.proc is None:
                try:
                    self._start()
                except ForkRefused as exc:
                    self.failure = str(exc)
                    raise
                except (OSError, ValueError) as exc:  # no transcript, or a garbled first line
                    self.failure = f"the zygote could not start: {type(exc).__name__}: {exc}"
                    if self.proc is not None:
                        terminate_group(self.proc, self.kill_grace_s)
                    if self.transcript is not None:
                        self.transcript.close()
                    self._down.set()
                    raise ForkRefused(self.failure) from exc
                finally:
                    self._settled.set()

    def _start(self) -> None:
        self.transcript = Transcript.create(self.paths.log_dir(), f"zygote-{self.slug}", 0)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.proc = subprocess.Popen(
                [self.python, ZYGOTE_SERVER_PATH, str(theirs.fileno())], pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL, stdout=self.transcript.fileno(), stderr=subprocess.STDOUT,
                env=child_env({**self.env, **ZYGOTE_ONLY_ENV}), start_new_session=True, close_fds=True)
        except OSError as exc:
            ours.close()
            raise ForkRefused(f"the zygote could not start: {self.python}: {exc.strerror}") from exc
        finally:
            theirs.close()
        self._sock = ours
        if self._stop_asked.is_set():  # stopped while it was being made: stop() saw no channel to close
            self._end("the zygote was stopped before it was ready")
            raise ForkRefused(self.failure or "stopped")
        self.transcript.note(f"zygote pid {self.proc.pid} for {self.slug} (environment {self.key[:12]}): "
                             f"preloading {', '.join(self.preload) or 'nothing'}"
                             + (f", then the load stage {self.load}()" if self.load else ""))
        weights = self.weights() if self.load and self.weights is not None else None
        self._send({"op": "configure", "script": self.script, "preload": self.preload, "load": self.load,
                    "weights_root": weights})
        ours.settimeout(self.start_timeout_s)
        buf = bytearray()
        try:
            line = self._read_line(buf)
        except TimeoutError:
            self._end(f"the zygote did not finish its preload within start_timeout_s = {self.start_timeout_s:g} s")
            raise ForkRefused(self.failure or "the zygote did not start") from None
        if line is None and self._stop_asked.is_set():  # stop() closed the channel: no failure, an end
            self._end("the zygote was stopped before it was ready")
            raise ForkRefused(self.failure or "stopped")
        if line is None or line.get("event") != "ready":
            why = (line or {}).get("error") or "it exited before it was ready"
            self._end(f"the zygote could not preload: {why}")
            raise ForkRefused(self.failure or why)
        self.info = line
        ours.settimeout(None)
        self._reader = threading.Thread(target=self._read, args=(buf,), daemon=True, name=f"zygote-{self.slug}")
        self._reader.start()

    def _end(self, why: str) -> None:
        """It failed at start: record why (with its exit and transcript) and make sure it is gone."""
        rc = terminate_group(self.proc, self.kill_grace_s) if self.proc is not None else None
        tail = read_tail(self.transcript.path, 1) if self.transcript else []  # its last word; the rest is there
        self.failure = (f"{why} ({describe_exit(rc)}; transcript {self.transcript.path if self.transcript else '-'}"
                        + (f": {tail[0]}" if tail else "") + ")")
        if self.transcript is not None:
            self.transcript.note(self.failure)
            self.transcript.close()
        if self._sock is not None:
            self._sock.close()
        self._down.set()

    # -- the control channel -----------------------------------------------------------
    def _send(self, message: dict[str, Any], fds: list[int] | None = None) -> None:
        assert self._sock is not None
        data = (json.dumps(message) + "\n").encode()
        with self._send_lock:
            sent = socket.send_fds(self._sock, [data], fds) if fds else 0
            self._sock.sendall(data[sent:])

    def _read_line(self, buf: bytearray) -> dict[str, Any] | None:
        assert self._sock is not None
        while b"\n" not in buf:
            chunk = self._sock.recv(65536)
            if not chunk:
                return None
            buf += chunk
        line, _, rest = bytes(buf).partition(b"\n")
        buf[:] = rest
        return json.loads(line)

    def _read(self, buf: bytearray) -> None:
        """Replies and exit reports, in the order the zygote sent them, until it is gone."""
        try:
            while True:
                message = self._read_line(buf)
                if message is None:
                    break
                self._dispatch(message)
        except (OSError, ValueError) as exc:
            log.warning("%s: the zygote's channel broke: %s", self.slug, exc)
        self._lost()

    def _dispatch(self, message: dict[str, Any]) -> None:
        if message.get("event") == "exit":
            with self._state_lock:
                child = self._children.pop(message["pid"], None)
            if child is not None:
                child.exited(int(message["returncode"]))
            return
        with self._state_lock:
            pending = self._pending.pop(message.get("id"), None)
        if pending is None:
            return
        if message.get("ok"):
            # Made here, before the next message is read: its exit report can only come after.
            pending.process = ForkedProcess(int(message["pid"]), self.pid)
            with self._state_lock:
                self._children[pending.process.pid] = pending.process
        else:
            pending.error = str(message.get("error") or "the zygote refused")
            pending.reason = message.get("reason")
        pending.done.set()

    def _lost(self) -> None:
        """The channel closed: the zygote exited (or was stopped). Its live children can no longer be reaped here."""
        self._down.set()
        rc = None
        if self.proc is not None:
            try:
                rc = self.proc.wait(timeout=_EXIT_WAIT_S)
            except subprocess.TimeoutExpired:
                rc = terminate_group(self.proc, self.kill_grace_s)
        with self._state_lock:
            children, self._children = list(self._children.values()), {}
            pending, self._pending = list(self._pending.values()), {}
        for waiter in pending:
            waiter.error = f"the zygote (pid {self.pid}) exited: {describe_exit(rc)}"
            waiter.done.set()
        for child in children:
            child.orphan()
        if self.transcript is not None:
            self.transcript.note(f"zygote pid {self.pid} ended: {describe_exit(rc)}"
                                 + (f"; {len(children)} worker(s) it forked run on, their exit status unknowable"
                                    if children else ""))
            self.transcript.close()

    # -- forking -------------------------------------------------------------------------
    def fork(self, argv: list[str], env: Mapping[str, str], stdout_fd: int, cwd: str) -> ForkedProcess:
        """A worker forked from this zygote (started first if need be); ForkRefused when it cannot be."""
        self.ensure_started()
        if argv[1:2] != [self.script]:
            raise ForkRefused(f"the zygote preloaded for {self.script}, not {argv[1] if len(argv) > 1 else argv}")
        pending = _Pending()
        request_id = next(self._ids)
        with self._state_lock:
            self._pending[request_id] = pending
        try:
            self._send({"op": "fork", "id": request_id, "argv": list(argv[1:]), "env": dict(env), "cwd": cwd},
                       fds=[stdout_fd])
        except OSError as exc:
            with self._state_lock:
                self._pending.pop(request_id, None)
            raise ForkRefused(f"the zygote (pid {self.pid}) cannot be reached: {exc}") from exc
        if not pending.done.wait(FORK_REPLY_TIMEOUT_S):
            raise ForkRefused(f"the zygote (pid {self.pid}) did not answer a fork within {FORK_REPLY_TIMEOUT_S:g} s")
        if pending.reason == "cuda_initialized":  # it will not get better: no more forks from this one
            self.failure = pending.error
            threading.Thread(target=self.stop, daemon=True, name=f"stop-zygote-{self.slug}").start()
        if pending.error is not None or pending.process is None:
            raise ForkRefused(pending.error or "the zygote refused")
        self.forks += 1
        self.last_active = time.monotonic()
        return pending.process

    # -- stop ------------------------------------------------------------------------------
    def stop(self) -> None:
        """Close its channel (it exits on that) and wait; the workers it forked are not touched. A start under way
        (its preload) ends on that too, quietly: its process ended, its transcript closed, no failure said."""
        self._stop_asked.set()
        sock = self._sock
        if sock is None or self._down.is_set():
            return  # never made (a start made later sees it was stopped), or gone
        try:
            sock.shutdown(socket.SHUT_RDWR)  # never close() under a start reading it: its read ends, then it closes
        except OSError:
            pass  # already gone
        self._settled.wait(_EXIT_WAIT_S * 3)
        if self._reader is not None:
            self._reader.join(timeout=_EXIT_WAIT_S * 3)
        sock.close()


class _Refusal:
    """A provider that asked for a zygote but cannot have one: each start says why, then spawns."""

    pid = None

    def __init__(self, why: str) -> None:
        self.why = why

    def fork(self, argv: list[str], env: Mapping[str, str], stdout_fd: int, cwd: str) -> ForkedProcess:
        raise ForkRefused(self.why)


def fork_refusal(manifest: Manifest, launch: Launch) -> str | None:
    """Why this provider's workers are spawned rather than forked, or None when a zygote may fork them."""
    if manifest.lifecycle.preload is None:
        return "no [lifecycle] preload"
    if isinstance(manifest.env, ContainerEnv) or launch.stop or launch.kill:
        return "a container provider: its engine starts each worker"
    argv = launch.argv
    if len(argv) > 2 and argv[1] == "-m" and argv[2].endswith(".worker_launch"):
        return "its kit starts the worker through worker_launch"
    if len(argv) < 2 or argv[1] != str(manifest.worker_path):
        return "its command is not `<python> <worker script>` (interpreter flags or a wrapper differ)"
    return None


def _weights(manifest: Manifest) -> str | None:
    root = weights_root(manifest, interpreter(manifest))
    return str(root) if root is not None else None


def _key(launch: Launch, manifest: Manifest) -> str:
    """The provider environment: interpreter, script, environment (less what changes per start), preload."""
    env = sorted((name, value) for name, value in launch.env.items() if name not in PER_START)
    lifecycle = manifest.lifecycle
    data = [launch.argv[0], launch.argv[1], env, lifecycle.preload, lifecycle.load]
    return hashlib.sha256(json.dumps(data).encode()).hexdigest()


class Zygotes:
    """The pool's zygotes: one per provider environment, retired with the last use of its workers."""

    def __init__(self, paths: Paths, kill_grace_s: float) -> None:
        self.paths = paths
        self.kill_grace_s = kill_grace_s
        self._lock = threading.Lock()
        self._current: dict[str, Zygote] = {}  # per provider: the zygote new workers fork from
        self._retiring: list[Zygote] = []  # replaced or stopped; gone once their workers are
        self._spawn_why: dict[str, str] = {}  # per provider: why its last start was spawned
        self._ended: dict[str, str] = {}  # per provider: how its last zygote ended, for status

    def spawner(self, manifest: Manifest, launch: Launch) -> Zygote | _Refusal | None:
        """The zygote this start forks from (created, not yet started: the start starts it), or None to spawn."""
        slug = manifest.slug
        why = fork_refusal(manifest, launch)
        key = _key(launch, manifest) if why is None else ""
        with self._lock:
            current = self._current.get(slug)
            replaced = None
            if current is None:
                pass
            elif current.key != key:
                replaced = "its provider's environment changed"
            elif current.failure:
                pass  # not retried until its environment changes, it idles out, or the provider is stopped
            elif current.down:
                replaced = "it exited"
            elif current.info:
                replaced = current.stale()
            if replaced:
                self._replace(slug, replaced)
                current = None
            if why is not None:
                self._spawn_why[slug] = why
                # Where a preload was asked for, the start's transcript says why it was not used.
                return None if manifest.lifecycle.preload is None else _Refusal(why)
            if current is not None and current.failure:
                return current  # its fork refuses at once, with the failure, in this start's transcript
            if current is None:
                env = {name: value for name, value in launch.env.items() if name not in PER_START}
                current = self._current[slug] = Zygote(
                    slug, key, launch.argv[0], env, launch.argv[1], manifest.lifecycle.preload or [],
                    manifest.lifecycle.load, lambda: _weights(manifest), manifest.lifecycle.start_timeout_s,
                    paths=self.paths, kill_grace_s=self.kill_grace_s)
            self._spawn_why.pop(slug, None)
            return current

    def _replace(self, slug: str, why: str) -> None:
        old = self._current.pop(slug)
        log.info("%s: retiring zygote %s: %s", slug, old.pid, why)
        if old.transcript is not None and not old.down:
            old.transcript.note(f"retiring once its workers are gone: {why}")
        self._retiring.append(old)

    def maintain(self, activity: Mapping[str, float], idle_timeouts: Mapping[str, float],
                 now: float | None = None) -> None:
        """Retire zygotes idle past their provider's idle timeout, and replaced ones once their workers are gone.

        ``activity``: per provider, when one of its workers was last in use (now, for a busy one).
        """
        now = time.monotonic() if now is None else now
        stopping = []
        with self._lock:
            for slug, zygote in list(self._current.items()):
                zygote.last_active = max(zygote.last_active, activity.get(slug, 0.0))
                if zygote.down and zygote.proc is not None and not zygote.failure:
                    self._ended[slug] = zygote.failure or f"zygote pid {zygote.pid} exited"
                    self._replace(slug, "it exited")
                    continue
                timeout = idle_timeouts.get(slug, 0.0)
                if zygote.live_children() or timeout <= 0 or now - zygote.last_active < timeout:
                    continue
                self._ended[slug] = f"zygote pid {zygote.pid} retired after idle_timeout_s = {timeout:g}"
                self._replace(slug, f"no worker used for {now - zygote.last_active:.1f} s "
                                    f"(idle_timeout_s = {timeout:g})")
            for zygote in list(self._retiring):
                if not zygote.live_children():
                    self._retiring.remove(zygote)
                    stopping.append(zygote)
        for zygote in stopping:  # it exits as soon as its channel closes; its own thread reaps it
            threading.Thread(target=zygote.stop, daemon=True, name=f"stop-zygote-{zygote.slug}").start()

    def retire(self, slug: str | None, why: str) -> None:
        """Stop ``slug``'s zygote (every one when None) once its workers are gone, and forget its failure."""
        with self._lock:
            for name in [s for s in self._current if slug in (None, s)]:
                self._ended[name] = f"zygote retired: {why}"
                self._replace(name, why)
        self.maintain({}, {})

    def status(self, slug: str, manifest: Manifest) -> dict[str, Any]:
        """How ``slug``'s workers start: ``{"way": "zygote", "zygote": {...}}`` or ``{"way": "spawn", "why"}``."""
        with self._lock:
            zygote = self._current.get(slug)
            why = self._spawn_why.get(slug)
            ended = self._ended.get(slug)
        if why is None and manifest.lifecycle.preload is None:
            why = "no [lifecycle] preload"
        if why is None and zygote is not None and zygote.failure:
            why = f"its zygote failed: {zygote.failure}"
        if why is not None:
            return {"way": "spawn", "why": why}
        described = zygote.describe() if zygote is not None else None
        return {"way": "zygote", "zygote": described,
                **({"last_zygote": ended} if ended and (zygote is None or zygote.proc is None) else {})}

    def describe(self) -> list[dict[str, Any]]:
        """Every zygote alive, current or retiring."""
        with self._lock:
            zygotes = [*self._current.values(), *self._retiring]
        return [{"slug": z.slug, **z.describe()} for z in zygotes if z.up()]

    def stop_all(self) -> None:
        with self._lock:
            zygotes = [*self._current.values(), *self._retiring]
            self._current, self._retiring = {}, []
        for zygote in zygotes:
            zygote.stop()
