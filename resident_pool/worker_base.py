"""The model side: a provider's worker script builds its model, then calls serve().

Standard library only at import: the pool passes this file's path in
``RESIDENT_POOL_WORKER_BASE`` and a worker loads it by path inside the model's
own environment, where this package is not installed::

    import importlib.util, os
    spec = importlib.util.spec_from_file_location("worker_base", os.environ["RESIDENT_POOL_WORKER_BASE"])
    worker_base = importlib.util.module_from_spec(spec); spec.loader.exec_module(worker_base)
    worker_base.serve(slug="minilm", socket_path=sys.argv[1], on_predict=embed)
"""

from __future__ import annotations

import bisect
import importlib.util
import mmap
import os
import selectors
import socket
import struct
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

__all__ = ["IN_FLIGHT_FILE", "LATENCY_BUCKETS_S", "load_protocol", "release_cublas_workspaces", "serve"]

DEFAULT_ORPHAN_GRACE_S = 120.0
DEFAULT_HEARTBEAT_STALE_S = 30.0
# How often the idle loop wakes to check whether its pool is gone.
_TICK_S = 0.25
_SEND_TIMEOUT_S = 60.0
# Idle time counts from process start, not from serve(): a pool that died while the model
# loaded is noticed as soon as serve() runs.
_PROCESS_STARTED = time.monotonic()
_PARENT_AT_START = os.getppid()
# Upper bounds (seconds) of the request latency histogram the ``stats`` op answers. Fixed, so
# every worker's counts add up in the pool's metrics: from an echo's milliseconds to an hour.
LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0,
                     3600.0)
# Beside the heartbeat, in the worker's run folder: when the request in flight started.
IN_FLIGHT_FILE = "in-flight"


class _Watchdog:
    """Is the pool (or supervisor) that started this worker still there?

    It keeps a heartbeat file fresh (``RESIDENT_POOL_HEARTBEAT``); a file that is gone or
    older than ``RESIDENT_POOL_HEARTBEAT_STALE_S`` means it is gone. A file works where a
    parent pid cannot: inside a container (the pool's pid is not visible) and in a worker
    forked from a preloading process (its parent is not the pool). A worker started by hand,
    with no heartbeat, falls back to watching its parent pid.
    """

    def __init__(self) -> None:
        self.path = os.environ.get("RESIDENT_POOL_HEARTBEAT") or None
        self.stale_s = float(os.environ.get("RESIDENT_POOL_HEARTBEAT_STALE_S") or DEFAULT_HEARTBEAT_STALE_S)

    def describe(self) -> str:
        return f"heartbeat {self.path}" if self.path else f"parent {_PARENT_AT_START}"

    def gone(self) -> bool:
        if self.path is None:
            return os.getppid() != _PARENT_AT_START
        try:
            age = time.time() - os.stat(self.path).st_mtime
        except OSError:
            return True
        return age > self.stale_s


class _Stats:
    """What this worker has answered: the pool collects it with the ``stats`` op (requests never pass through
    the pool). Failures that end the process (worker_exiting, a death) are counted by the pool instead."""

    def __init__(self) -> None:
        self.requests = 0
        self.failures: dict[str, int] = {}
        self.buckets = [0] * (len(LATENCY_BUCKETS_S) + 1)  # the last one: slower than every bound
        self.seconds = 0.0

    def record(self, elapsed_s: float, failure: str | None = None) -> None:
        self.requests += 1
        self.seconds += elapsed_s
        self.buckets[bisect.bisect_left(LATENCY_BUCKETS_S, elapsed_s)] += 1
        if failure is not None:
            self.failures[failure] = self.failures.get(failure, 0) + 1

    def answer(self) -> dict[str, Any]:
        return {"requests": self.requests, "failures": dict(self.failures),
                "latency": {"bounds_s": list(LATENCY_BUCKETS_S), "counts": list(self.buckets),
                            "sum_s": round(self.seconds, 6)}}


class _InFlight:
    """When the request in flight started, as 8 bytes in a file the pool reads without asking.

    A busy worker answers nothing until its request ends (it serves one at a time), so this is how
    `status` shows the age of a request that has run for hours. A memory write per request, no
    system call. Only under a pool (the file sits beside ``RESIDENT_POOL_HEARTBEAT``).
    """

    def __init__(self) -> None:
        self.board: mmap.mmap | None = None
        heartbeat = os.environ.get("RESIDENT_POOL_HEARTBEAT")
        if not heartbeat:
            return
        path = os.path.join(os.path.dirname(heartbeat), IN_FLIGHT_FILE)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
            try:
                os.ftruncate(fd, 8)
                self.board = mmap.mmap(fd, 8)
            finally:
                os.close(fd)
        except (OSError, ValueError):
            self.board = None  # a read-only or odd run folder: status shows the lease's age instead

    def mark(self, started: float) -> None:
        """``started`` (wall clock) when a request begins, 0.0 when it ends."""
        if self.board is not None:
            struct.pack_into("d", self.board, 0, started)


def load_protocol():
    """The protocol module: the package's when imported normally, else by path."""
    if __package__:
        from . import protocol

        return protocol
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.environ.get("RESIDENT_POOL_PROTOCOL") or os.path.join(here, "protocol.py")
    module = sys.modules.get("resident_pool_protocol")
    if module is None:
        spec = importlib.util.spec_from_file_location("resident_pool_protocol", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules["resident_pool_protocol"] = module
        spec.loader.exec_module(module)
    return module


def release_cublas_workspaces() -> int:
    """Free torch's per-(handle, stream) cuBLAS workspaces; returns bytes freed.

    torch keeps one workspace per stream forever; code that captures CUDA graphs
    makes a new side stream per request, so a held model grows by one workspace
    (32 MiB on recent torch) per request, unseen by gc and empty_cache.
    """
    # A worker that never imported torch holds no workspace, and importing it
    # here would cost an echo worker seconds and hundreds of MiB.
    torch = sys.modules.get("torch")
    if torch is None:
        return 0
    cuda = getattr(torch, "cuda", None)
    clear = getattr(getattr(torch, "_C", None), "_cuda_clearCublasWorkspaces", None)
    if cuda is None or clear is None or not cuda.is_available() or not cuda.is_initialized():
        return 0
    before = cuda.memory_allocated()
    clear()
    return max(0, before - cuda.memory_allocated())


def _exit_code(exc: BaseException) -> int | None:
    """The code the process will exit with when ``exc`` propagates."""
    if isinstance(exc, SystemExit):
        code = exc.code
        if code is None:
            return 0
        if isinstance(code, int) and not isinstance(code, bool):
            return code
        return 1
    return None


def _readable(exc: BaseException) -> str:
    """A kit's refusal carries its sentence in ``.reason`` or ``.line``."""
    for attribute in ("reason", "line"):
        value = getattr(exc, attribute, None)
        if isinstance(value, str) and value.strip():
            return value.strip()
    if isinstance(exc, SystemExit) and isinstance(exc.code, str):
        return exc.code
    text = str(exc)
    return text if text and text != "None" else type(exc).__name__


class _Server:
    def __init__(self, slug, socket_path, on_predict, ready, on_reset, log, orphan_grace_s, release_cublas):
        self.protocol = load_protocol()
        self.slug = slug
        self.socket_path = os.fspath(socket_path)
        self.on_predict = on_predict
        self.ready = ready
        self.on_reset = on_reset
        self.log = log or (lambda message: print(f"[{slug}] {message}", file=sys.stderr, flush=True))
        if orphan_grace_s is None:
            orphan_grace_s = float(os.environ.get("RESIDENT_POOL_ORPHAN_GRACE_S", DEFAULT_ORPHAN_GRACE_S))
        self.orphan_grace_s = orphan_grace_s
        self.release_cublas = release_cublas and os.environ.get("RESIDENT_POOL_NO_CUBLAS_RELEASE") != "1"
        self.watchdog = _Watchdog()
        self.started = time.monotonic()
        self.last_request = _PROCESS_STARTED
        self.served = 0
        self.stopping = False
        self.stats = _Stats()
        self.in_flight = _InFlight()

    # -- the loop ----------------------------------------------------------
    def run(self) -> None:
        listener = self.protocol.bind_unix(self.socket_path)
        self.socket_inode = os.stat(self.socket_path).st_ino
        self.log(f"listening on {self.socket_path} (pid {os.getpid()})")
        # Many clients may connect, but requests run one at a time in this
        # thread: one CUDA context never interleaves two requests, and a client
        # that connects and says nothing cannot wedge the others.
        self.selector = selectors.DefaultSelector()
        self.selector.register(listener, selectors.EVENT_READ, None)
        try:
            while not self.stopping:
                events = self.selector.select(_TICK_S)
                if not events and self._orphaned_and_idle():
                    self.log(
                        f"the pool is gone ({self.watchdog.describe()}) and no request came for "
                        f"{self.orphan_grace_s:g} s; exiting so the device is given back"
                    )
                    self._unlink_socket()
                    # os._exit: a thread a model library left running must not keep this process alive.
                    os._exit(0)
                for key, _ in events:
                    if key.fileobj is listener:
                        self._accept(listener)
                    else:
                        self._read(key.fileobj, key.data)
                    if self.stopping:
                        break
        finally:
            for key in list(self.selector.get_map().values()):
                key.fileobj.close()
            self.selector.close()
            self._unlink_socket()

    def _accept(self, listener: socket.socket) -> None:
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        # A reader that stops reading must not block the worker forever.
        conn.settimeout(_SEND_TIMEOUT_S)
        self.selector.register(conn, selectors.EVENT_READ, bytearray())

    def _close(self, conn: socket.socket) -> None:
        self.selector.unregister(conn)
        conn.close()

    def _read(self, conn: socket.socket, buf: bytearray) -> None:
        try:
            chunk = conn.recv(self.protocol.RECV_CHUNK)
        except OSError:
            chunk = b""
        if not chunk:
            self._close(conn)
            return
        scan_from = len(buf)
        buf += chunk
        while not self.stopping:
            try:
                request = self.protocol.pop_line(buf, scan_from=scan_from)
            except self.protocol.ProtocolError as exc:
                self._reply(conn, {"ok": False, "error": f"bad request line: {exc}", "reason": "bad_request"})
                if exc.recoverable:
                    scan_from = 0
                    continue
                self._close(conn)
                return
            if request is None:
                return
            scan_from = 0
            reply = self._handle(request, conn)
            if not self._reply(conn, reply):
                self._close(conn)
                return

    def _orphaned_and_idle(self) -> bool:
        if time.monotonic() - self.last_request < self.orphan_grace_s:
            return False
        return self.watchdog.gone()

    def _reply(self, conn: socket.socket, reply: dict[str, Any]) -> bool:
        try:
            self.protocol.send_line(conn, reply)
        except (ValueError, TypeError) as exc:
            # The result itself cannot cross the wire (NaN, a set, over the cap).
            fallback = {"ok": False, "reason": "request_failed", "id": reply.get("id"),
                        "error": f"{self.slug}: the result cannot be sent: {exc}"}
            return self._reply(conn, fallback)
        except OSError:
            return False
        return True

    # -- ops ---------------------------------------------------------------
    def _handle(self, request: dict[str, Any], conn: socket.socket) -> dict[str, Any]:
        op = request.get("op")
        request_id = request.get("id")
        if op == "ping":
            reply = {"ok": True, "id": request_id, "model": self.slug, "ready": True,
                     "uptime_s": round(time.monotonic() - self.started, 3), "pid": os.getpid(),
                     "served": self.served}
            if self.ready is not None:
                try:
                    extra = self.ready() or {}
                    reply.update(extra if isinstance(extra, dict) else {"ready_info": repr(extra)})
                except Exception as exc:  # noqa: BLE001 - a broken ready() is reported, never fatal to a loaded model
                    reply["ready_error"] = f"{type(exc).__name__}: {exc}"
                reply.update({"ok": True, "id": request_id})
            return reply
        if op == "predict":
            return self._predict(request, conn)
        if op == "stats":
            return {"ok": True, "id": request_id, "pid": os.getpid(), "served": self.served, **self.stats.answer()}
        if op == "shutdown":
            self.stopping = True
            return {"ok": True, "id": request_id, "stopping": True}
        return {"ok": False, "id": request_id, "reason": "unknown_op",
                "error": f"unknown op {op!r}; expected one of {', '.join(self.protocol.OPS)}"}

    def _predict(self, request: dict[str, Any], conn: socket.socket) -> dict[str, Any]:
        request_id = request.get("id")
        started = time.monotonic()
        self.last_request = started
        self.in_flight.mark(time.time())
        try:
            if self.on_reset is not None:
                self.on_reset()
            result = self.on_predict(request.get("payload"))
        except Exception as exc:  # noqa: BLE001 - any Exception is the request's failure, not the worker's
            self.stats.record(time.monotonic() - started, "request_failed")
            self.log(f"request failed: {type(exc).__name__}: {exc}")
            return {"ok": False, "id": request_id, "reason": "request_failed",
                    "error": f"{type(exc).__name__}: {exc}", "type": type(exc).__name__,
                    "traceback": traceback.format_exc(limit=8)[-4000:]}
        except BaseException as exc:
            code = _exit_code(exc)
            message = _readable(exc)
            self.log(f"exiting ({type(exc).__name__}, code {code}): {message}")
            self._reply(conn, {"ok": False, "id": request_id, "reason": "worker_exiting",
                               "error": message, "type": type(exc).__name__, "exit_code": code,
                               "traceback": traceback.format_exc(limit=8)[-4000:]})
            # Re-raise: kits arm timers that kill a process which swallowed
            # their refusal, and the exit code is what the operator branches on.
            raise
        finally:
            self.in_flight.mark(0.0)
            freed = self._release()
            self.served += 1
            self.last_request = time.monotonic()
        elapsed = self.last_request - started
        self.stats.record(elapsed)
        reply = {"ok": True, "id": request_id, "result": result, "elapsed_s": round(elapsed, 6)}
        if freed:
            freed_mib = round(freed / 2**20, 3)
            if isinstance(result, dict):
                result["cublas_workspaces_freed_mib"] = freed_mib
            else:
                reply["cublas_workspaces_freed_mib"] = freed_mib
        return reply

    def _release(self) -> int:
        if not self.release_cublas:
            return 0
        # A global looked up at call time, so a worker script (or a test) that
        # replaces it on this module sees every call.
        try:
            return int(release_cublas_workspaces() or 0)
        except Exception as exc:  # noqa: BLE001 - a broken CUDA runtime must not fail the request
            self.log(f"release_cublas_workspaces failed: {type(exc).__name__}: {exc}")
            return 0

    def _unlink_socket(self) -> None:
        # A newer worker may have bound this path since (a restarted pool):
        # only the socket this process bound is ours to remove.
        try:
            if os.stat(self.socket_path).st_ino == self.socket_inode:
                os.unlink(self.socket_path)
        except FileNotFoundError:
            pass


def serve(
    *,
    slug: str,
    socket_path: str | os.PathLike[str],
    on_predict: Callable[[Any], Any],
    ready: Callable[[], dict[str, Any]] | None = None,
    on_reset: Callable[[], None] | None = None,
    log: Callable[[str], None] | None = None,
    orphan_grace_s: float | None = None,
    release_cublas: bool = True,
) -> None:
    """Answer ``ping``, ``predict``, ``stats`` and ``shutdown`` on ``socket_path``, one request at a time.

    ``on_predict`` gets the request's ``payload`` and returns the reply's
    ``result``. An Exception from it fails that request only; SystemExit or
    KeyboardInterrupt is answered with ``reason: worker_exiting`` and re-raised.
    """
    _Server(slug, socket_path, on_predict, ready, on_reset, log, orphan_grace_s, release_cublas).run()
