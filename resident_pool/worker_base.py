"""The model side: a provider's worker script builds its model, then calls serve().

Standard library only at import: the pool passes this file's path in
``RESIDENT_POOL_WORKER_BASE`` and a worker loads it by path inside the model's
own environment, where this package is not installed::

    import importlib.util, os
    spec = importlib.util.spec_from_file_location("worker_base", os.environ["RESIDENT_POOL_WORKER_BASE"])
    worker_base = importlib.util.module_from_spec(spec); spec.loader.exec_module(worker_base)
    worker_base.serve(slug="minilm", socket_path=sys.argv[1], on_predict=embed)

A worker written for the original design runs unchanged: the pool also exports
``TOOLUNIVERSE_REMOTE_WORKER_BASE`` and ``TOOLUNIVERSE_REMOTE_PROTOCOL``, and
``protocol()``, ``bootstrap()`` and the ``*_ENV`` names are here.
"""

from __future__ import annotations

import array
import bisect
import collections
import importlib.util
import math
import mmap
import os
import reprlib
import select
import selectors
import socket
import struct
import sys
import time
import traceback
import types
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["BATCHING_ENV", "BATCH_SIZE_BUCKETS", "DEFAULT_MAX_BATCH_SIZE", "DEFAULT_ORPHAN_GRACE_S", "IN_FLIGHT_FILE",
           "LATENCY_BUCKETS_S", "NO_CUBLAS_RELEASE_ENV", "ORPHAN_GRACE_ENV", "PROTOCOL_ENV", "WORKER_BASE_ENV",
           "bootstrap", "empty", "empty_like", "load_arrays", "load_protocol", "protocol",
           "release_cublas_workspaces", "serve", "staged"]

DEFAULT_ORPHAN_GRACE_S = 120.0
# The original design's names. The pool exports both names of each path; a hand-run worker may
# set the original's names for the two knobs. Where both are set, the project's own name wins.
PROTOCOL_ENV = "TOOLUNIVERSE_REMOTE_PROTOCOL"
WORKER_BASE_ENV = "TOOLUNIVERSE_REMOTE_WORKER_BASE"
ORPHAN_GRACE_ENV = "TOOLUNIVERSE_RESIDENT_ORPHAN_GRACE_S"
NO_CUBLAS_RELEASE_ENV = "TOOLUNIVERSE_RESIDENT_NO_CUBLAS_RELEASE"
DEFAULT_HEARTBEAT_STALE_S = 30.0
# How often the idle loop wakes to check whether its pool is gone.
_TICK_S = 0.25
_RECALLED_KEPT = 4096
_ACCEPTS_PER_PASS = 64  # the listener's backlog
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
# A batching worker's limits, as the pool sets them from the manifest's [batching] table. Where set they win over
# serve()'s arguments, which are the script's own defaults (for a worker run by hand): the operator tunes a
# provider for its card in the manifest, without editing its script.
BATCHING_ENV = {"max_batch_size": "RESIDENT_POOL_MAX_BATCH_SIZE", "max_wait_ms": "RESIDENT_POOL_MAX_WAIT_MS",
                "max_batch_work": "RESIDENT_POOL_MAX_BATCH_WORK"}
DEFAULT_MAX_BATCH_SIZE = 64
# A queued request rises one priority class per this many seconds waited, as in the pool's own lines
# (resident_pool/priority.py; its ``aging_s``), so a ``batch`` request is never starved by a stream of others.
AGING_ENV = "RESIDENT_POOL_AGING_S"
DEFAULT_AGING_S = 300.0
# The pool's priority classes (resident_pool/priority.py, which this file cannot import), the highest first.
_RANKS = {"interactive": 0, "normal": 1, "batch": 2}
# Upper bounds of the histogram of requests per model call a batching worker's ``stats`` answers.
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


def _variable(own: str, original: str) -> str | None:
    """The project's variable, else the original design's name for it; empty counts as unset."""
    return os.environ.get(own) or os.environ.get(original) or None


class _Watchdog:
    """Is the pool (or supervisor) that started this worker still there?

    It keeps a heartbeat file fresh (``RESIDENT_POOL_HEARTBEAT``); a file that is gone or
    older than ``RESIDENT_POOL_HEARTBEAT_STALE_S`` means it is gone. A file works where a
    parent pid cannot: inside a container (the pool's pid is not visible; under ``--init``
    the parent pid is 1) and in a worker forked from a preloading process (its parent is not
    the pool). A worker started by hand, with no heartbeat, falls back to its parent pid:
    gone once it changed, or when it is init's (1), which also catches a parent that died
    before this file was imported.
    """

    def __init__(self) -> None:
        self.path = os.environ.get("RESIDENT_POOL_HEARTBEAT") or None
        self.stale_s = float(os.environ.get("RESIDENT_POOL_HEARTBEAT_STALE_S") or DEFAULT_HEARTBEAT_STALE_S)

    def describe(self) -> str:
        return f"heartbeat {self.path}" if self.path else f"parent {_PARENT_AT_START}"

    def gone(self) -> bool:
        if self.path is None:
            parent = os.getppid()
            return parent != _PARENT_AT_START or parent == 1
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


class _BatchStats:
    """A batching worker's model calls: how many requests each took and how long it ran, and how long requests
    waited in the queue for one (the pool's batch size and queue wait histograms)."""

    def __init__(self) -> None:
        self.calls = 0
        self.items = 0
        self.seconds = 0.0
        self.sizes = [0] * (len(BATCH_SIZE_BUCKETS) + 1)
        self.waits = [0] * (len(LATENCY_BUCKETS_S) + 1)
        self.waited_s = 0.0

    def called(self, size: int, elapsed_s: float) -> None:
        self.calls += 1
        self.items += size
        self.seconds += elapsed_s
        self.sizes[bisect.bisect_left(BATCH_SIZE_BUCKETS, size)] += 1

    def waited(self, wait_s: float) -> None:
        self.waited_s += wait_s
        self.waits[bisect.bisect_left(LATENCY_BUCKETS_S, wait_s)] += 1

    def answer(self) -> dict[str, Any]:
        return {"batches": {"calls": self.calls, "items": self.items, "sum_s": round(self.seconds, 6),
                            "size": {"bounds": list(BATCH_SIZE_BUCKETS), "counts": list(self.sizes)}},
                "queue_wait": {"bounds_s": list(LATENCY_BUCKETS_S), "counts": list(self.waits),
                               "sum_s": round(self.waited_s, 6)}}


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

    def begin(self) -> None:
        """A model call begins: now, on the wall clock."""
        if self.board is not None:
            struct.pack_into("d", self.board, 0, time.time())

    def end(self) -> None:
        if self.board is not None:
            struct.pack_into("d", self.board, 0, 0.0)


def _imported_in_package() -> bool:
    """Whether this file was imported as a module of its own package (``resident_pool.worker_base``), so its
    siblings import as such; loaded by path under any other name (``worker_base``, the original's
    ``tooluniverse.remote_resident.worker_base``), they are loaded by path too."""
    package = sys.modules.get(__package__) if __package__ else None
    here = os.path.realpath(os.path.dirname(os.path.abspath(__file__)))
    return any(os.path.realpath(folder) == here for folder in getattr(package, "__path__", ()))


def load_protocol():
    """The wire protocol module: the package's when this file was imported as part of it; else loaded by path
    from ``RESIDENT_POOL_PROTOCOL`` (or ``TOOLUNIVERSE_REMOTE_PROTOCOL``), else beside this file."""
    if _imported_in_package():
        from . import protocol as module

        return module
    module = sys.modules.get("resident_pool_protocol")
    if module is None:
        here = os.path.dirname(os.path.abspath(__file__))
        path = _variable("RESIDENT_POOL_PROTOCOL", PROTOCOL_ENV) or os.path.join(here, "protocol.py")
        if not os.path.isfile(path):
            raise SystemExit(f"the wire protocol is not at {path}; set RESIDENT_POOL_PROTOCOL (or {PROTOCOL_ENV}) "
                             "to the path of resident_pool's protocol.py")
        spec = importlib.util.spec_from_file_location("resident_pool_protocol", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules["resident_pool_protocol"] = module
        spec.loader.exec_module(module)
    return module


def protocol():
    """The wire module as the original design's ``protocol()`` handed it out (``OP_PING``, ``OP_PREDICT``,
    ``OP_SHUTDOWN``, ``send_line``, ``recv_line``, ``ProtocolError``, and the rest of ``load_protocol()``'s).

    One difference from ``load_protocol()``'s: its ``recv_line`` raises ProtocolError when the peer closes
    between messages, as the original's did (the original's own accept loop leaves a connection only that
    way), where this project's returns None. Code written for this project takes ``load_protocol()``.
    """
    global _original_protocol  # noqa: PLW0603 - made once per copy of this file, on first use
    real = load_protocol()
    view = _original_protocol
    if view is None or view.__dict__["_real"] is not real:
        view = types.ModuleType(f"{real.__name__}_original", real.__doc__)
        view.__file__ = real.__file__
        view._real = real
        view.__getattr__ = lambda name: getattr(real, name)  # every other name is the real module's, live
        view.recv_line = _recv_line_to_the_end(real)
        _original_protocol = view
    return view


_original_protocol: types.ModuleType | None = None


def _recv_line_to_the_end(real):
    def recv_line(sock, buf, max_bytes=real.MAX_LINE_BYTES):
        """One message; ``buf`` carries bytes past it. ProtocolError at the end of the stream, as the original."""
        message = real.recv_line(sock, buf, max_bytes)
        if message is None:
            raise real.ProtocolError("peer closed the connection mid-message (0 bytes unterminated)")
        return message

    return recv_line


def bootstrap(worker_file: str | os.PathLike[str] | None = None):
    """This worker base as a module, for a worker script written to the original design.

    The loaded copy this call belongs to when it is registered; else the file named by
    ``RESIDENT_POOL_WORKER_BASE`` (or ``TOOLUNIVERSE_REMOTE_WORKER_BASE``), else this one,
    loaded once. ``worker_file`` is the original's argument; the base is not found from it.
    """
    for module in list(sys.modules.values()):
        if getattr(module, "__dict__", None) is globals():
            return module
    module = sys.modules.get("resident_pool_worker_base")
    if module is None:
        path = _variable("RESIDENT_POOL_WORKER_BASE", WORKER_BASE_ENV) or os.path.abspath(__file__)
        spec = importlib.util.spec_from_file_location("resident_pool_worker_base", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules["resident_pool_worker_base"] = module
        spec.loader.exec_module(module)
    return module


def load_arrays():
    """The arrays module (arrays beside the line, as attachments), found beside protocol.py.

    None where it is not there (a container that binds only protocol.py and
    worker_base.py): the worker then speaks plain JSON, arrays as lists.
    """
    if _imported_in_package():
        from . import arrays

        return arrays
    module = sys.modules.get("resident_pool_arrays")
    if module is None:
        path = os.path.join(os.path.dirname(os.path.abspath(load_protocol().__file__)), "arrays.py")
        if not os.path.isfile(path):
            return None
        spec = importlib.util.spec_from_file_location("resident_pool_arrays", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules["resident_pool_arrays"] = module
        spec.loader.exec_module(module)
    return module


def staged() -> Any:
    """What the provider's load stage returned in the zygote this worker was forked from, else None.

    None in a spawned worker, and in one forked from a zygote without a load stage: the
    script then loads its weights itself. ``[lifecycle] load`` names the stage.
    """
    zygote = sys.modules.get("resident_pool_zygote")
    return getattr(zygote, "staged", None)


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


# How long an exiting worker waits for its last reply to be read.
_LAST_REPLY_TIMEOUT_S = 5.0
# How long a worker told to shut down spends, in all, on replies its clients have not read: below the 3 s the pool
# gives an acknowledged shutdown before it sends SIGTERM (worker_process.SHUTDOWN_EXIT_S).
_CLOSING_S = 2.0


def _nothing() -> None:
    pass


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


class _ReplyBuffers:
    """A connection's attachments: whether its client takes them, and the reused buffers replies travel in."""

    def __init__(self, arrays, protocol, log) -> None:
        self.arrays, self.protocol, self.log = arrays, protocol, log
        self.attach_min_bytes, self.max_attachment_bytes = arrays.limits()
        self.logged = False

    def negotiate(self, request: dict[str, Any], inbox) -> dict[str, Any]:
        """Record whether this connection's client takes attachments; this worker's offer."""
        if inbox is not None:
            inbox.peer = self.arrays.accepted(request.get("attachments"))
        return {"version": self.arrays.VERSION, "max_bytes": self.max_attachment_bytes}

    def slabs(self, inbox):
        """This connection's reused buffers for its replies (made on first need)."""
        if inbox.slabs is None:
            inbox.slabs = self.arrays.Slabs()
        return inbox.slabs

    def outgoing(self, inbox, nbytes: int):
        """A writable view of ``nbytes`` in a reused buffer of ``inbox``'s next reply, or None (no request in
        flight, a client without reused buffers, an array that travels inline)."""
        if inbox is None or not self.arrays.reuses(inbox.peer) or nbytes < self.attach_min_bytes:
            return None
        slabs = self.slabs(inbox)
        slab = slabs.take(nbytes, int(inbox.peer.get("max_bytes", 0)))
        if slab is None:
            return None
        try:
            if not self.logged:
                self.logged = True
                path = self.protocol.SLAB_PATH
                self.log(f"reply buffers: pages {path['pages']}, populated by {path['populate']}")
            return slabs.lend(slab, writable=True)[:nbytes]
        finally:
            slabs.reserved(slab)


class _Outbox:
    """Replies on their way out: encoded (arrays as attachments, in a connection's reused buffers for a client that
    takes them), sent as far as each client reads, the rest kept per connection until it reads again.

    A client that never reads its replies stalls only itself: its connection is not read again until its reply has
    gone (``waiting``), while every other client is served.
    """

    def __init__(self, slug: str, protocol, arrays, buffers, selector: selectors.BaseSelector) -> None:
        self.slug, self.protocol, self.arrays, self.buffers, self.selector = slug, protocol, arrays, buffers, selector
        self.attach_min_bytes = arrays.limits()[0] if arrays else 0
        # By connection: the rest of the bytes, the descriptors still to go with the first of them, and what to
        # release once those have gone.
        self.unsent: dict[socket.socket, tuple[memoryview, list[int], Callable[[], None]]] = {}

    def waiting(self, conn: socket.socket) -> bool:
        """Whether ``conn``'s last reply has not all gone yet (its next lines wait for it)."""
        return conn in self.unsent

    def reply(self, conn: socket.socket, reply: dict[str, Any], inbox=None, received=(),
              release: Callable[[], None] | None = None) -> bool:
        """Send ``reply``; its arrays go as attachments to a client that asked for them (else as lists).

        ``release`` runs once the reply's descriptors are in the kernel's hands (or the
        connection is gone); False when the connection is broken.
        """
        return self.send_encoded(conn, *self.encode(reply, inbox, received, release))

    def encode(self, reply: dict[str, Any], inbox, received, release: Callable[[], None] | None
               ) -> tuple[bytes, list[int], int | None, Callable[[], None] | None]:
        """``reply`` as (line, descriptors, fresh memfd to close, release); its arrays in this connection's
        reused buffers for a client of version 2."""
        try:
            if self.arrays is None:
                raw, fds, fresh = self.protocol.encode_line(reply), [], None
            elif (plain := self.arrays.plain_line(reply)) is not None:  # most replies carry no array
                raw, fds, fresh = plain, [], None
            else:
                peer = inbox.peer if inbox is not None else None
                slabs = self.buffers.slabs(inbox) if self.arrays.reuses(peer) else None
                raw, fds, fresh = self.arrays.encode(reply, peer, self.attach_min_bytes, received, slabs,
                                                     try_plain=False)
        except (ValueError, TypeError, RecursionError) as exc:
            # The result itself cannot cross the wire (NaN, a set, over the cap, nested past the recursion limit).
            fallback = {"ok": False, "reason": "request_failed", "id": reply.get("id"),
                        "error": f"{self.slug}: the result cannot be sent: {exc}"}
            return self.encode(fallback, None, (), release)
        return raw, fds, fresh, release

    def send_encoded(self, conn: socket.socket, raw: bytes, fds: list[int], fresh: int | None,
                     release: Callable[[], None] | None, held: list[int] | None = None) -> bool:
        if held:
            raw = self.arrays.with_field(raw, "held", held)
        if fresh is None:
            return self._send(conn, memoryview(raw), list(fds), release or _nothing)

        def done() -> None:
            if fresh is not None:
                os.close(fresh)
            if release is not None:
                release()

        return self._send(conn, memoryview(raw), list(fds), done)

    def _send(self, conn: socket.socket, data: memoryview, fds: list[int], done: Callable[[], None]) -> bool:
        """Send what the socket takes now; the rest waits until the client reads (EVENT_WRITE)."""
        try:
            if fds:
                sent = conn.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
            else:
                sent = conn.send(data)
        except BlockingIOError:
            sent = 0
        except OSError:
            done()
            return False
        if sent and fds:
            fds = []  # in the kernel's hands now: ours may close
        if not fds:
            done()
            done = _nothing
        if sent < len(data):
            self.unsent[conn] = (data[sent:], fds, done)
            self.selector.modify(conn, selectors.EVENT_WRITE, self.selector.get_key(conn).data)
        return True

    def flush(self, conn: socket.socket) -> bool:
        """The client read some: send more of its reply (False: the connection is broken)."""
        data, fds, done = self.unsent.pop(conn)
        self.selector.modify(conn, selectors.EVENT_READ, self.selector.get_key(conn).data)
        return self._send(conn, data, fds, done)

    def finish(self, conn: socket.socket, deadline: float | None = None) -> None:
        """A last reply goes out before the process does (or the connection closes), for a few seconds at most
        (until ``deadline``, a monotonic time, where one is given)."""
        unsent = self.unsent.pop(conn, None)
        if unsent is None:
            return
        data, fds, done = unsent
        try:
            conn.settimeout(_LAST_REPLY_TIMEOUT_S if deadline is None else max(0.01, deadline - time.monotonic()))
            if fds:
                data = data[conn.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]):]
            conn.sendall(data)
        except OSError:
            pass  # the client is gone; the exit code still tells the pool
        finally:
            done()

    def drop(self, conn: socket.socket) -> None:
        """``conn`` closes: what its unsent reply holds is let go."""
        unsent = self.unsent.pop(conn, None)
        if unsent is not None:
            unsent[2]()


def _exiting_reply(exc: BaseException, request_id: Any, log: Callable[[str], None]) -> dict[str, Any]:
    """The last reply to a request whose model call raised something that is not an Exception (call it inside the
    ``except``: it carries the traceback)."""
    code = _exit_code(exc)
    why = _readable(exc)
    log(f"exiting ({type(exc).__name__}, code {code}): {why}")
    return {"ok": False, "id": request_id, "reason": "worker_exiting", "error": why, "type": type(exc).__name__,
            "exit_code": code, "traceback": traceback.format_exc(limit=8)[-4000:]}


def _recalled_reply(request_id: Any) -> dict[str, Any]:
    return {"ok": False, "id": request_id, "reason": "lease_recalled",
            "error": "the pool took this lease back (another request waits, or the worker retires); acquire a new one"}


class _Leases:
    """The pool's leases as this worker knows them: those it took back, and how many requests each had answered.

    A request naming a lease taken back is refused (``lease_recalled``); the recall's answer says how many
    requests the lease had answered, so the pool counts them. Bounded: a lease is recalled once, and a client
    that still names one this old has long been told.
    """

    def __init__(self) -> None:
        self._recalled: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._served: collections.OrderedDict[str, int] = collections.OrderedDict()

    def recall(self, lease: Any) -> None:
        if isinstance(lease, str) and lease:
            self._recalled[lease] = None
            while len(self._recalled) > _RECALLED_KEPT:
                self._recalled.popitem(last=False)

    def recalled(self, lease: Any) -> bool:
        return isinstance(lease, str) and lease in self._recalled

    def answered(self, lease: Any) -> None:
        if isinstance(lease, str) and lease:
            served = self._served
            served[lease] = served.pop(lease, 0) + 1  # popped and put back: now the newest
            while len(served) > _RECALLED_KEPT:
                served.popitem(last=False)

    def served(self, lease: Any) -> int:
        return self._served.get(lease, 0) if isinstance(lease, str) else 0


class _Model:
    """A worker's model side: takes each ``predict`` the wire reads to the model, one model call at a time, and does
    what every model call needs around the model: ``on_reset`` first, the in-flight board, the cuBLAS release after.

    When a request runs is the subclass's to decide: ``_Serial`` runs it as soon as it is read.
    """

    def __init__(self, slug: str, on_reset: Callable[[], None] | None, release_cublas: bool,
                 log: Callable[[str], None]) -> None:
        self.slug, self.on_reset, self.release_cublas, self.log = slug, on_reset, release_cublas, log
        self.arrays = load_arrays()
        self.array_errors = (self.arrays.ArrayError,) if self.arrays else ()
        self.stats = _Stats()
        self.leases = _Leases()
        self.in_flight = _InFlight()
        self.served = 0
        self.last_request = _PROCESS_STARTED
        self.current = None  # the connection whose request is in the model (worker_base.empty builds its reply there)
        # Replies to send before the process exits, after the model raised SystemExit: (conn, inbox, message, reply).
        self._last_words: list[tuple[socket.socket, Any, Any, dict[str, Any]]] = []

    def take(self, conn: socket.socket, inbox, message) -> dict[str, Any] | None:
        """A ``predict`` read from ``conn``: its reply, or None where it is answered later."""
        request = message.obj
        if self.leases.recalled(request.get("lease")):
            return _recalled_reply(request.get("id"))
        try:
            payload = self._payload(request, message)
        except self.array_errors as exc:
            return {"ok": False, "id": request.get("id"), "reason": "bad_request", "error": f"bad request: {exc}"}
        return self._arrived(conn, inbox, message, payload)

    def _arrived(self, conn: socket.socket, inbox, message, payload: Any) -> dict[str, Any] | None:
        raise NotImplementedError

    def recall(self, lease: Any) -> int:
        """The pool takes ``lease`` back: its requests read from now on are refused. Returns how many of its requests
        are still to be answered here (its recall is answered after them)."""
        self.leases.recall(lease)
        return 0

    def due_in(self, now: float) -> float | None:
        """Seconds until a model call is due for requests read and waiting (0: now); None when none waits."""
        return None

    def run_batch(self, answer: Callable[[Any], None]) -> None:
        """One model call for requests read and waiting; ``answer`` sends each one's reply as soon as it is known."""
        raise NotImplementedError("a serial model side runs each request as it is read")

    def pending(self, lease: Any) -> int:
        """How many of ``lease``'s requests are read and not yet answered (none here: each runs as it is read)."""
        return 0

    def forget(self, conn: socket.socket) -> None:
        """``conn`` closed: nothing read from it is answered any more."""

    def abandon(self) -> list:
        """The worker stops: the requests read and never run, taken off the model side to be answered unrun."""
        return []

    def describe(self, now: float) -> dict[str, Any]:
        """What a ping adds about the model side."""
        return {}

    def idle_s(self, now: float) -> float:
        return now - self.last_request

    def report(self) -> dict[str, Any]:
        """What the ``stats`` op answers about the requests answered."""
        return self.stats.answer()

    def farewells(self) -> list[tuple[socket.socket, Any, Any, dict[str, Any]]]:
        """The last replies owed once the model raised SystemExit (or the like), taken once."""
        words, self._last_words = self._last_words, []
        return words

    def _answered(self, lease: Any) -> None:
        self.served += 1
        self.leases.answered(lease)

    def _payload(self, request: dict[str, Any], message) -> Any:
        """The request's payload with its array references read (numpy arrays where numpy imports).

        A request without a ``payload`` (the original design's ``{"op": "predict", ...fields}``)
        is its own payload, as the original handed it whole to ``on_predict``.
        """
        payload = request.get("payload", request)
        if not message.references or self.arrays is None:
            return payload
        payload = self.arrays.decode(payload, message.attachments)
        if "payload" in request:
            # Held by the request until its reply is sent: unmapping a large payload (freeing its pages) is then
            # no longer on the caller's clock.
            request["payload"] = payload
        return payload

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


class _Serial(_Model):
    """One request at a time, run as soon as it is read: a worker given ``on_predict``."""

    def __init__(self, on_predict: Callable[[Any], Any], **common: Any) -> None:
        super().__init__(**common)
        self.on_predict = on_predict

    def _arrived(self, conn: socket.socket, inbox, message, payload: Any) -> dict[str, Any]:
        request_id = message.obj.get("id")
        lease = message.obj.get("lease")
        started = time.monotonic()
        self.last_request = started
        self.in_flight.begin()
        self.current = inbox
        try:
            if self.on_reset is not None:
                self.on_reset()
            result = self.on_predict(payload)
        except Exception as exc:  # noqa: BLE001 - any Exception is the request's failure, not the worker's
            self.stats.record(time.monotonic() - started, "request_failed")
            self.log(f"request failed: {type(exc).__name__}: {exc}")
            return {"ok": False, "id": request_id, "reason": "request_failed",
                    "error": f"{type(exc).__name__}: {exc}", "type": type(exc).__name__,
                    "traceback": traceback.format_exc(limit=8)[-4000:]}
        except BaseException as exc:
            # Answered, then re-raised: kits arm timers that kill a process which swallowed
            # their refusal, and the exit code is what the operator branches on.
            self._last_words = [(conn, inbox, message, _exiting_reply(exc, request_id, self.log))]
            raise
        finally:
            self.current = None
            self.in_flight.end()
            freed = self._release()
            self._answered(lease)
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


class _Limits:
    """How many requests one model call may take, how much work they may hold together, and how long a call may
    be held open for more; each from the pool's variable (``BATCHING_ENV``) where set, else serve()'s argument."""

    def __init__(self, slug: str, max_batch_size: Any, max_wait_ms: Any, max_batch_work: Any,
                 size_of: Callable[[Any], Any] | None) -> None:
        self.max_batch_size = int(_limit(slug, "max_batch_size", max_batch_size, DEFAULT_MAX_BATCH_SIZE, whole=True,
                                         least=1))
        self.max_wait_ms = _limit(slug, "max_wait_ms", max_wait_ms, 0, whole=False, least=0)
        self.max_wait_s = self.max_wait_ms / 1000
        self.max_batch_work = _limit(slug, "max_batch_work", max_batch_work, None, whole=False, least=0)
        if self.max_batch_work is not None and self.max_batch_work <= 0:
            raise ValueError(f"{slug}: max_batch_work must be more than 0 (it bounds the work of one model call)")
        if self.max_batch_work is not None and size_of is None:
            raise ValueError(f"{slug}: max_batch_work ({self.max_batch_work:g}) bounds the work size_of measures, and "
                             "this worker's serve() has no size_of: give it size_of= (a request's work, such as the "
                             "length of its sequences), or unset the bound")
        aging = os.environ.get(AGING_ENV)
        try:
            self.aging_s = float(aging) if aging else DEFAULT_AGING_S
        except ValueError:
            raise ValueError(f"{slug}: {AGING_ENV}={aging!r} is not a number of seconds") from None

    def describe(self) -> dict[str, Any]:
        return {"max_batch_size": self.max_batch_size, "max_wait_ms": self.max_wait_ms,
                "max_batch_work": self.max_batch_work}


def _limit(slug: str, name: str, argument: Any, default: Any, *, whole: bool, least: float) -> Any:
    """One batching limit: the pool's variable where set, else serve()'s argument, else ``default``; a bad value is
    a ValueError naming where it came from."""
    variable = BATCHING_ENV[name]
    text = os.environ.get(variable)
    if text:
        source, value = f"{variable}={text!r} (the manifest's [batching] {name})", text
        try:
            value = int(text) if whole else float(text)
        except ValueError:
            value = None
    elif argument is not None:
        source, value = f"serve({name}={argument!r})", argument
        if isinstance(value, bool) or not isinstance(value, int if whole else int | float):
            value = None
    else:
        return default
    if value is None or not math.isfinite(value) or value < least:
        kind = "a whole number" if whole else "a number"
        raise ValueError(f"{slug}: {source} is not {kind} of at least {least:g}; set it to one"
                         + (f", or unset it for the default {default}" if default is not None else ""))
    return value


class _Item:
    """One caller's request in a batching worker, from its line read to its reply."""

    __slots__ = ("arrived", "conn", "done", "id", "inbox", "lease", "message", "payload", "rank", "reply", "taken",
                 "work")

    def __init__(self, conn: socket.socket, inbox, message, payload: Any, rank: int, arrived: float) -> None:
        self.conn: socket.socket | None = conn  # None once its client is gone
        self.inbox, self.message, self.payload = inbox, message, payload
        self.id = message.obj.get("id")
        self.lease = message.obj.get("lease")
        self.rank, self.arrived = rank, arrived
        self.work: float = 1
        self.taken: float | None = None  # when a model call took it
        self.reply: dict[str, Any] | None = None
        self.done = False


class _Queue:
    """The requests read and not yet in a model call, and which of them the next call takes.

    The highest priority class first (a request rises one class per ``aging_s`` waited, so none starves), first
    come first served within a class, up to ``max_batch_size`` requests and ``max_batch_work`` of work (the first
    request is taken whatever its own work: it would never run otherwise).

    With ``max_wait_ms`` above 0 a call is held open only for the callers answered in the last call that have not
    asked again (``awaited``): closed-loop callers answered together come back over a few milliseconds and meet in
    one call, and a caller whose every peer has asked again (a lone caller) never waits.
    """

    def __init__(self, limits: _Limits) -> None:
        self.limits = limits
        self.items: list[_Item] = []  # in the order they arrived
        self.work: float = 0
        self.awaited: set[Any] = set()  # connections answered in the last model call that have not asked again
        self.freed = -math.inf  # when the last model call ended

    def answered(self, conns: Iterable[Any], now: float) -> None:
        """A model call that ended at ``now`` answered ``conns``: the next call may wait for them to ask again."""
        self.awaited = set(conns)
        self.freed = now

    def __len__(self) -> int:
        return len(self.items)

    def put(self, item: _Item) -> None:
        self.items.append(item)
        self.work += item.work
        self.awaited.discard(item.conn)

    def due_in(self, now: float) -> float | None:
        """Seconds until the next model call is due (0: now), None when nothing waits. A call waits for more only
        while a caller answered in the last call has not asked again and fewer than ``max_batch_size`` requests
        (and less than ``max_batch_work``) wait, at most ``max_wait_ms`` from the first one's arrival or the last
        call's end, whichever is later (a request that came during a call waits for its stragglers as one that
        came after it does)."""
        if not self.items:
            return None
        limits = self.limits
        if (limits.max_wait_s <= 0 or not self.awaited or len(self.items) >= limits.max_batch_size
                or (limits.max_batch_work is not None and self.work >= limits.max_batch_work)):
            return 0.0
        return max(0.0, max(self.items[0].arrived, self.freed) + limits.max_wait_s - now)

    def take(self, now: float) -> list[_Item]:
        """The requests of the next model call, taken off the queue."""
        limits = self.limits
        if len(self.items) == 1:  # a lone caller's: no ordering to do
            batch, self.items, self.work = self.items, [], 0
            batch[0].taken = now
            return batch
        aging = limits.aging_s

        def standing(item: _Item) -> int:
            return max(0, item.rank - int((now - item.arrived) // aging)) if aging > 0 else item.rank

        batch, work = [], 0
        for item in sorted(self.items, key=standing):  # stable: first come first served within a class
            if len(batch) == limits.max_batch_size or (
                    batch and limits.max_batch_work is not None and work + item.work > limits.max_batch_work):
                break
            batch.append(item)
            work += item.work
        for item in batch:
            item.taken = now
            self.work -= item.work
        self.items = [item for item in self.items if item.taken is None]
        if not self.items:
            self.work = 0  # no rounding left behind by float work
        return batch

    def drop(self, conn: socket.socket) -> list[_Item]:
        """The requests read from ``conn``, taken off the queue (its client is gone)."""
        self.awaited.discard(conn)
        dropped = [item for item in self.items if item.conn is conn]
        if dropped:
            self.items = [item for item in self.items if item.conn is not conn]
            self.work -= sum(item.work for item in dropped)
        return dropped

    def oldest_wait(self, now: float) -> float:
        return now - self.items[0].arrived if self.items else 0.0

    def clear(self) -> list[_Item]:
        """Every request waiting, taken off the queue."""
        items, self.items, self.work = self.items, [], 0
        self.awaited = set()
        return items


class _Failure:
    """Why a model call, or one request of it, failed: what each failed request's reply says."""

    __slots__ = ("kind", "message", "split", "trace")

    def __init__(self, exc: BaseException, *, split: bool, context: str = "") -> None:
        self.kind = type(exc).__name__
        self.message = f"{context}{exc}"
        self.trace = "".join(traceback.format_exception(exc, limit=8))[-4000:]
        # A call that raised may have failed for one request in it: its halves are tried. One whose own code
        # failed whatever it was given (on_reset, the shape of its answer) is not.
        self.split = split


class _Batching(_Model):
    """A batching worker's model side (``on_predict_batch``): requests read from every caller queue, and whenever
    the model is free one call takes what is queued, within the limits.

    A call that raises is split and its halves tried again, recursively, until the failing requests are isolated:
    the others get their answers, each failing one its own error naming its input. Something that is not an
    Exception (SystemExit) still ends the worker, after every request of that call still unanswered has had the
    same last reply.
    """

    def __init__(self, on_predict_batch: Callable[[list[Any]], Any], size_of: Callable[[Any], Any] | None,
                 limits: _Limits, **common: Any) -> None:
        super().__init__(**common)
        self.on_predict_batch, self.size_of, self.limits = on_predict_batch, size_of, limits
        self.queue = _Queue(limits)
        self.batch: list[_Item] = []  # the requests of the model call running now
        self.calls = 0
        self.batch_stats = _BatchStats()
        self.shown = reprlib.Repr()
        self.shown.maxstring = self.shown.maxother = 120
        self.shown.maxlevel, self.shown.maxdict, self.shown.maxlist = 3, 6, 6

    def _arrived(self, conn: socket.socket, inbox, message, payload: Any) -> dict[str, Any] | None:
        priority = message.obj.get("priority")
        rank = _RANKS["normal"] if priority is None else _RANKS.get(priority) if isinstance(priority, str) else None
        if rank is None:
            return {"ok": False, "id": message.obj.get("id"), "reason": "bad_request",
                    "error": f"bad request: priority {priority!r} is not a class: one of {', '.join(_RANKS)}"}
        now = time.monotonic()
        self.last_request = now
        item = _Item(conn, inbox, message, payload, rank, now)
        if self.size_of is not None:
            refused = self._measure(item)
            if refused is not None:
                return refused
        self.queue.put(item)
        return None

    def _measure(self, item: _Item) -> dict[str, Any] | None:
        """``item``'s work, by ``size_of``; a failure reply where that fails (it fails this request alone)."""
        try:
            work = self.size_of(item.payload)
        except Exception as exc:  # noqa: BLE001 - the request's failure, not the worker's
            failure = _Failure(exc, split=False, context="size_of: ")
        except BaseException as exc:
            self._last_words = [(item.conn, item.inbox, item.message, _exiting_reply(exc, item.id, self.log))]
            raise
        else:
            if isinstance(work, int | float) and not isinstance(work, bool) and math.isfinite(work) and work >= 0:
                item.work = work
                return None
            failure = _Failure(TypeError(f"size_of returned {work!r} for this input; it must return a number of at "
                                         "least 0 (the request's work)"), split=False)
        item.taken = item.arrived
        self._answered(item.lease)
        return self._failed(item, failure, 0.0, 0, len(self.queue))

    # -- one model call after another ------------------------------------------------
    def due_in(self, now: float) -> float | None:
        return self.queue.due_in(now)

    def run_batch(self, answer: Callable[[_Item], None]) -> None:
        now = time.monotonic()
        batch = self.queue.take(now)
        behind = len(self.queue)
        for item in batch:
            self.batch_stats.waited(now - item.arrived)
        self.batch = batch
        calls = self.calls
        self.in_flight.begin()
        try:
            failed = self._solve(batch, answer, behind, now)
        except BaseException as exc:
            last = _exiting_reply(exc, None, self.log)
            self._last_words = [(item.conn, item.inbox, item.message, {**last, "id": item.id})
                                for item in batch if not item.done and item.conn is not None]
            raise
        finally:
            self.batch = []
            self.in_flight.end()
            self.last_request = time.monotonic()
        self.queue.answered((item.conn for item in batch if item.conn is not None), self.last_request)
        if self.calls - calls > 1:
            self.log(f"isolated {failed} failing request(s) among {len(batch)} in {self.calls - calls} model calls")

    def _solve(self, items: list[_Item], answer: Callable[[_Item], None], behind: int, started: float) -> int:
        """Answer every request of ``items`` with a model call that begins at ``started``, splitting a call that
        raised; returns how many failed."""
        results, failure, freed, now = self._call(items, started)
        if failure is not None and failure.split and len(items) > 1:
            if len(items) == len(self.batch):
                self.log(f"a model call of {len(items)} requests failed ({failure.kind}: {failure.message}); "
                         "splitting it to isolate the failing requests")
            middle = len(items) // 2
            failed = self._solve(items[:middle], answer, behind, now)
            return failed + self._solve(items[middle:], answer, behind, time.monotonic())
        failed = 0
        size = len(items)
        for index, item in enumerate(items):
            outcome = failure if failure is not None else results[index]
            if isinstance(outcome, Exception):
                outcome = _Failure(outcome, split=False)
            if isinstance(outcome, _Failure):
                item.reply = self._failed(item, outcome, now - item.taken, size, behind)
                failed += 1
            else:
                self.stats.record(now - item.taken)
                item.reply = {"ok": True, "id": item.id, "result": outcome, "elapsed_s": round(now - item.taken, 6),
                              "queue_wait_s": round(item.taken - item.arrived, 6), "batch_size": size,
                              "queued": behind}
            if freed:
                item.reply["cublas_workspaces_freed_mib"] = round(freed / 2**20, 3)
        results = outcome = None  # the replies hold the results now: a buffer they pass on is the reply's to let go
        for item in items:
            item.done = True
            self._answered(item.lease)
            answer(item)
        return failed

    def _call(self, items: list[_Item], started: float) -> tuple[Any, _Failure | None, int, float]:
        """One model call that began at ``started``: (its results, None, cuBLAS bytes freed, when it ended), or
        (None, why it failed, bytes freed, when it ended)."""
        self.calls += 1
        payloads = [item.payload for item in items]
        self.current = items[0].inbox if len(items) == 1 else None  # worker_base.empty builds where the reply goes
        results = failure = None
        try:
            if self.on_reset is not None:
                try:
                    self.on_reset()
                except Exception as exc:  # noqa: BLE001 - fails this call's requests, whatever they were
                    failure = _Failure(exc, split=False, context="on_reset: ")
            if failure is None:
                results = self.on_predict_batch(payloads)
        except Exception as exc:  # noqa: BLE001 - one request's, maybe: the call is split to find out
            failure = _Failure(exc, split=True)
        finally:
            payloads = None
            self.current = None
            freed = self._release()
            ended = time.monotonic()
            self.batch_stats.called(len(items), ended - started)
        if failure is None and (not isinstance(results, list | tuple) or len(results) != len(items)):
            got = f"{len(results)} results" if isinstance(results, list | tuple) else f"a {type(results).__name__}"
            failure = _Failure(TypeError(f"on_predict_batch returned {got} for {len(items)} payloads; it must return "
                                         "a list of one result per payload, in their order"), split=False)
            results = None
        return results, failure, freed, ended

    def _failed(self, item: _Item, failure: _Failure, elapsed_s: float, size: int, behind: int) -> dict[str, Any]:
        shown = self.shown.repr(item.payload)
        self.stats.record(elapsed_s, "request_failed")
        self.log(f"request failed: {failure.kind}: {failure.message} (input {shown})")
        return {"ok": False, "id": item.id, "reason": "request_failed", "error": f"{failure.kind}: {failure.message} "
                f"(input: {shown})", "type": failure.kind, "input": shown, "traceback": failure.trace,
                "queue_wait_s": round(item.taken - item.arrived, 6), "batch_size": size, "queued": behind}

    # -- what the wire asks -----------------------------------------------------------
    def pending(self, lease: Any) -> int:
        """How many of ``lease``'s requests are read and not yet answered."""
        if not isinstance(lease, str) or not lease:
            return 0
        return (sum(1 for item in self.queue.items if item.lease == lease)
                + sum(1 for item in self.batch if item.lease == lease and not item.done))

    def recall(self, lease: Any) -> int:
        self.leases.recall(lease)
        return self.pending(lease)

    def forget(self, conn: socket.socket) -> None:
        for item in self.queue.drop(conn):
            item.message.close()
        for item in self.batch:
            if item.conn is conn:
                item.conn = None

    def abandon(self) -> list[_Item]:
        return self.queue.clear()

    def describe(self, now: float) -> dict[str, Any]:
        return {"batching": self.limits.describe(), "queued": len(self.queue),
                "queue_wait_s": round(self.queue.oldest_wait(now), 6)}

    def idle_s(self, now: float) -> float:
        return 0.0 if self.queue.items else now - self.last_request

    def report(self) -> dict[str, Any]:
        return {**self.stats.answer(), **self.batch_stats.answer()}


class _Server:
    """A worker's wire side: its socket, the connections and their lines, and every op but ``predict``, which goes to
    the model side (``_Model``); replies leave through the ``_Outbox``."""

    def __init__(self, socket_path: str | os.PathLike[str], model: _Model, ready, log: Callable[[str], None],
                 orphan_grace_s: float) -> None:
        self.protocol = load_protocol()
        self.arrays = model.arrays
        self.attach_min_bytes, self.max_attachment_bytes = self.arrays.limits() if self.arrays else (0, 0)
        self.slug = model.slug
        self.socket_path = os.fspath(socket_path)
        self.model = model
        self.ready = ready
        self.log = log
        self.orphan_grace_s = orphan_grace_s
        self.watchdog = _Watchdog()
        self.started = time.monotonic()
        self.stopping = False
        self.buffers = _ReplyBuffers(self.arrays, self.protocol, self.log) if self.arrays else None
        # Many clients may connect, but the model runs in this thread, one call at a time: one CUDA context never
        # interleaves two calls, and a client that connects and says nothing cannot wedge the others.
        self.selector = selectors.DefaultSelector()
        self.outbox = _Outbox(self.slug, self.protocol, self.arrays, self.buffers, self.selector)
        self.later: set[socket.socket] = set()  # whose request is answered later: their next lines wait for it
        # Recalls answered once their lease's requests read before them are: lease -> (conn, inbox, message).
        self.recalls: dict[str, list[tuple[socket.socket, Any, Any]]] = {}
        # Connections whose client shut its sending side with a request still to answer: not read (each read would
        # be the same end of stream), answered all the same. conn -> inbox.
        self.parked: dict[socket.socket, Any] = {}
        self.answered: list[tuple[socket.socket, Any]] = []  # in the model call running: their next lines wait

    # -- the loop ----------------------------------------------------------
    def run(self) -> None:
        listener = self.protocol.bind_unix(self.socket_path)
        self.socket_inode = os.stat(self.socket_path).st_ino
        self.log(f"listening on {self.socket_path} (pid {os.getpid()})")
        if self.arrays is None:
            self.log("arrays.py is not beside protocol.py here: arrays go as JSON lists, not attachments "
                     "(bind it into the container beside protocol.py)")
        listener.setblocking(False)
        self.selector.register(listener, selectors.EVENT_READ, None)
        try:
            while not self.stopping:
                due = self.model.due_in(time.monotonic())
                events = self.selector.select(_TICK_S if due is None else min(due, _TICK_S))
                if not events and due is None and self._orphaned_and_idle():
                    self.log(
                        f"the pool is gone ({self.watchdog.describe()}) and no request came for "
                        f"{self.orphan_grace_s:g} s; exiting so the device is given back"
                    )
                    self._unlink_socket()
                    # os._exit: a thread a model library left running must not keep this process alive.
                    os._exit(0)
                # New connections first, read at once: the pool's recall is read before a kept lease's next
                # request in the same batch, which it refuses (a waiting client waits for one request at most).
                if len(events) > 1:
                    events.sort(key=lambda event: event[0].fileobj is not listener)
                for key, mask in events:
                    if key.fileobj is listener:
                        # Every client waiting to be accepted, at once: their first lines join this pass (and a
                        # batching worker's next model call) rather than one pass each.
                        for _ in range(_ACCEPTS_PER_PASS):
                            accepted = self._accept(listener)
                            if accepted is None:
                                break
                            if self.protocol.ready(accepted[0]):
                                self._read(*accepted)
                    elif mask & selectors.EVENT_WRITE:
                        self._flushed(key.fileobj, key.data)
                    else:
                        self._read(key.fileobj, key.data)
                    if self.stopping:
                        break
                due = self.model.due_in(time.monotonic())
                if due is not None and due <= 0 and not self.stopping:
                    self._run_batch()
                if self.recalls:
                    self._answer_recalls()
        finally:
            self._answer_before_closing(listener)
            for conn in list(self.outbox.unsent):
                self.outbox.drop(conn)
            for conn in list(self.parked):
                self._close(conn)
            for key in list(self.selector.get_map().values()):
                key.fileobj.close()
                if key.data is not None:
                    key.data.close()
            self.selector.close()
            self._unlink_socket()

    def _accept(self, listener: socket.socket):
        try:
            conn, _ = listener.accept()
        except OSError:
            return None
        # Non-blocking: a client that stops reading holds only its own reply (see _send), never this loop.
        conn.setblocking(False)
        # A client's reused buffers are read in place: only it can change one, and only between its requests.
        inbox = self.protocol.Inbox(self.max_attachment_bytes, self.attach_min_bytes, reused=self.protocol.IN_PLACE)
        self.selector.register(conn, selectors.EVENT_READ, inbox)
        return conn, inbox

    def _close(self, conn: socket.socket) -> None:
        self.later.discard(conn)
        self.model.forget(conn)
        for lease, waiting in list(self.recalls.items()):
            for entry in [entry for entry in waiting if entry[0] is conn]:
                waiting.remove(entry)
                entry[2].close()
            if not waiting:
                del self.recalls[lease]
        self.outbox.drop(conn)
        inbox = self.parked.pop(conn) if conn in self.parked else self.selector.unregister(conn).data
        inbox.close()  # its descriptors, mappings and buffers
        conn.close()

    def _read(self, conn: socket.socket, inbox) -> None:
        # The inbox queues the descriptors that came with each line (arrays sent
        # as attachments); each is closed once that line's reply is sent.
        try:
            got = self.protocol.fill(conn, inbox)
        except self.protocol.ProtocolError as exc:
            self.outbox.reply(conn, {"ok": False, "error": f"bad request line: {exc}", "reason": "bad_request"})
            got = 0
        except OSError:
            got = 0
        if not got:
            if conn in self.later and not _hung_up(conn):  # it shut its sending side only: it waits for its reply
                self.parked[conn] = self.selector.unregister(conn).data
                return
            self._close(conn)
            return
        if conn in self.later and len(inbox) > self.protocol.MAX_LINE_BYTES:
            # Lines are read while a request waits for the model (to see a client go); more than a line's cap of
            # them is no client of this protocol, which waits for each reply.
            self.log("a client sent more than a line's cap while its request waited for the model; closing it")
            self._close(conn)
            return
        self._serve_lines(conn, inbox, len(inbox) - got)

    def _flushed(self, conn: socket.socket, inbox) -> None:
        """The client read some of its reply: more of it goes, and once it has all gone, its next lines are served."""
        if not self.outbox.flush(conn):
            self._close(conn)
        elif not self.outbox.waiting(conn):
            self._serve_lines(conn, inbox, 0)

    def _run_batch(self) -> None:
        """One model call for what the callers have queued (a batching model side). Each is answered on its own
        connection as soon as its answer is known; its next lines are served once the call is over."""
        self.answered = []
        try:
            self.model.run_batch(self._answer)
        except BaseException:
            self._say_last_words()
            raise
        for conn, inbox in self.answered:
            if len(inbox) and conn.fileno() >= 0 and conn not in self.later:  # a line sent before the reply came
                self._serve_lines(conn, inbox, 0)

    def _answer(self, item) -> None:
        """Send a queued request's reply (``item.reply``) on its own connection, in its client's own buffers."""
        conn, message = item.conn, item.message
        reply, item.reply, item.payload = item.reply, None, None
        if conn is None:  # its client is gone
            message.close()
            return
        if self.parked:
            self._unpark(conn)
        self.later.discard(conn)
        encoded = self._encode(reply, item.inbox, message)
        del reply  # the result's arrays: whatever still holds a client's buffer after this, kept it
        if self._send(conn, message, encoded):
            self.answered.append((conn, item.inbox))
        else:
            self._close(conn)

    def _answer_recalls(self) -> None:
        """Answer each recall whose lease has no request left to answer here."""
        for lease in [lease for lease in self.recalls if not self.model.pending(lease)]:
            for conn, inbox, message in self.recalls.pop(lease, []):
                self._unpark(conn)
                self.later.discard(conn)
                encoded = self._encode(self._recall_answer(message.obj.get("id"), lease), inbox, message)
                if not self._send(conn, message, encoded):
                    self._close(conn)
                elif not self.stopping:
                    self._serve_lines(conn, inbox, 0)

    def _unpark(self, conn: socket.socket) -> None:
        """A parked connection is watched again for its reply's sake (a reply the client does not take at once
        waits for it to be writable)."""
        inbox = self.parked.pop(conn, None)
        if inbox is not None:
            self.selector.register(conn, selectors.EVENT_READ, inbox)

    def _answer_before_closing(self, listener: socket.socket) -> None:
        """Stopping (a shutdown, or an exit): every request a client has already sent is answered, not run, before
        its connection closes: ``lease_recalled`` where the pool took its lease back, else ``worker_stopping``.

        Closing a connection with a request unread in it would reset it: the client could not tell a request that
        never ran from one that died with its worker. Each connection's reading side is shut first, so from then
        on a client's send fails (EPIPE) and it knows that request was never sent.
        """
        try:
            listener.setblocking(False)
            while True:  # clients that connected (and may have sent) but were not accepted yet
                try:
                    conn, _ = listener.accept()
                except OSError:
                    break
                conn.setblocking(False)
                self.selector.register(conn, selectors.EVENT_READ, self.protocol.Inbox(
                    self.max_attachment_bytes, self.attach_min_bytes, reused=self.protocol.IN_PLACE))
        except OSError as exc:  # a listener already gone: only the connections accepted are left to answer
            self.log(f"could not take the last connections before closing: {exc}")
        for item in self.model.abandon():  # read, and never run
            self._unpark(item.conn)
            self.later.discard(item.conn)
            item.payload = None
            encoded = self._encode(self._not_run(item.message.obj, item.conn), item.inbox, item.message)
            if not self._send(item.conn, item.message, encoded):
                self._close(item.conn)
        self._answer_recalls()
        readable = []
        for key in list(self.selector.get_map().values()):
            conn, inbox = key.fileobj, key.data
            if inbox is None:
                continue  # the listener
            try:
                conn.shutdown(socket.SHUT_RD)
                while self.protocol.fill(conn, inbox):  # queued before the shutdown: readable, then end of stream
                    pass
            except (OSError, self.protocol.ProtocolError):
                continue  # gone, or a stream that cannot be read: nothing of it can be answered
            readable.append((conn, inbox))
        # Every connection that takes its answers now gets them first; one whose client does not read its last reply
        # is served after, within what is left of a budget below the pool's patience with a stop (a stalled client
        # must not cost another its answer).
        for conn, inbox in readable:
            self._serve_lines(conn, inbox, 0, handle=self._not_run)
        deadline = time.monotonic() + _CLOSING_S
        for conn, inbox in readable:
            while self.outbox.waiting(conn) and time.monotonic() < deadline:
                self.outbox.finish(conn, deadline)
                self._serve_lines(conn, inbox, 0, handle=self._not_run)

    def _not_run(self, request: dict[str, Any], conn: socket.socket, inbox=None, message=None) -> dict[str, Any]:
        """The answer to a request that came after the worker was told to stop: it did not run."""
        if request.get("op") == "predict" and self.model.leases.recalled(request.get("lease")):
            return _recalled_reply(request.get("id"))
        return {"ok": False, "id": request.get("id"), "reason": "worker_stopping",
                "error": f"{self.slug}: the worker is shutting down; this request did not run: send it again"}

    def _serve_lines(self, conn: socket.socket, inbox, scan_from: int, handle=None) -> None:
        """Answer each whole line buffered for ``conn``, until one's reply must wait: for the client to read, or for
        the model side (``handle``: what answers a request; the ops by default)."""
        handle = handle or self._handle
        while ((not self.stopping or handle is not self._handle) and not self.outbox.waiting(conn)
               and conn not in self.later):
            try:
                message = self.protocol.pop_message(inbox, scan_from=scan_from)
            except self.protocol.ProtocolError as exc:
                self.outbox.reply(conn, {"ok": False, "error": f"bad request line: {exc}", "reason": "bad_request"})
                if exc.recoverable:
                    scan_from = 0
                    continue
                self._close(conn)
                return
            if message is None:
                return
            scan_from = 0
            if inbox.slabs is not None:
                inbox.slabs.settle()  # the client has read the last reply (it asks again): its buffers are free
            try:
                reply = handle(message.obj, conn, inbox, message)
            except BaseException:
                self._say_last_words()
                message.close()
                raise
            if reply is None:  # answered once the model side has run it
                self.later.add(conn)
                return
            encoded = self._encode(reply, inbox, message)
            del reply  # the result's arrays: whatever still holds a client's buffer after this, kept it
            if not self._send(conn, message, encoded):
                self._close(conn)
                return
            if not inbox:  # the usual case: a client waits for its reply before it sends again
                return

    def _encode(self, reply: dict[str, Any], inbox, message):
        """``reply`` encoded for ``conn``'s client; the request's descriptors are closed once it has gone."""
        try:
            return self.outbox.encode(reply, inbox, message.attachments, message.close)
        except BaseException:
            message.close()
            raise

    def _send(self, conn: socket.socket, message, encoded) -> bool:
        """Send an encoded reply to ``message``; False when the connection is broken."""
        return self.outbox.send_encoded(conn, *encoded, self._still_held(message))

    def _say_last_words(self) -> None:
        """The process is exiting (the model raised SystemExit): the last replies owed go out before it does."""
        for conn, _inbox, message, reply in self.model.farewells():
            self._unpark(conn)
            self.later.discard(conn)
            self.outbox.reply(conn, reply)
            self.outbox.finish(conn)
            message.close()

    def _orphaned_and_idle(self) -> bool:
        if time.monotonic() - self.model.last_request < self.orphan_grace_s:
            return False
        return self.watchdog.gone()

    def _still_held(self, message) -> list[int]:
        """The client's reused buffers (by attachment index) something here still reads, now the reply is
        made: the client must not fill those again. Checked once the request (its payload) is let go."""
        if not message.attachments:
            return []
        reused = [index for index, attachment in enumerate(message.attachments) if attachment.reused]
        if not reused:
            return []
        message.obj = {}  # the request, its payload's references read in place
        return [index for index in reused if message.attachments[index].held()]

    # -- ops ---------------------------------------------------------------
    def _handle(self, request: dict[str, Any], conn: socket.socket, inbox, message) -> dict[str, Any] | None:
        op = request.get("op")
        request_id = request.get("id")
        if op == "predict":
            return self.model.take(conn, inbox, message)
        if op == "ping":
            return self._ping(request, inbox)
        if op == "stats":
            return {"ok": True, "id": request_id, "pid": os.getpid(), "served": self.model.served,
                    **self.model.report()}
        if op == "shutdown":
            self.stopping = True
            return {"ok": True, "id": request_id, "stopping": True}
        if op == "recall":
            lease = request.get("lease")
            if self.model.recall(lease):  # answered once its requests read before this are
                self.recalls.setdefault(lease, []).append((conn, inbox, message))
                return None
            return self._recall_answer(request_id, lease)
        return {"ok": False, "id": request_id, "reason": "unknown_op",
                "error": f"unknown op {op!r}; expected one of {', '.join(self.protocol.OPS)}"}

    def _ping(self, request: dict[str, Any], inbox) -> dict[str, Any]:
        request_id = request.get("id")
        now = time.monotonic()
        reply = {"ok": True, "id": request_id, "model": self.slug, "ready": True,
                 "uptime_s": round(now - self.started, 3), "pid": os.getpid(), "served": self.model.served,
                 "recall": True}
        if self.ready is not None:
            try:
                extra = self.ready() or {}
                reply.update(extra if isinstance(extra, dict) else {"ready_info": repr(extra)})
            except Exception as exc:  # noqa: BLE001 - a broken ready() is reported, never fatal to a loaded model
                reply["ready_error"] = f"{type(exc).__name__}: {exc}"
            reply.update({"ok": True, "id": request_id})
        reply.update(self.model.describe(now))
        offer = self._negotiate(request, inbox)
        if offer:
            reply["attachments"] = offer
        return reply

    def _recall_answer(self, request_id: Any, lease: Any) -> dict[str, Any]:
        return {"ok": True, "id": request_id, "idle_s": round(self.model.idle_s(time.monotonic()), 3),
                "served": self.model.leases.served(lease)}

    # -- arrays beside the line ------------------------------------------------
    def _negotiate(self, request: dict[str, Any], inbox) -> dict[str, Any] | None:
        return self.buffers.negotiate(request, inbox) if self.buffers else None

    def outgoing(self, nbytes: int):
        """A writable view of ``nbytes`` the current request's reply will carry, or None (see _ReplyBuffers)."""
        return self.buffers.outgoing(self.model.current, nbytes) if self.buffers else None

    def _unlink_socket(self) -> None:
        # A newer worker may have bound this path since (a restarted pool): only the one this process bound goes.
        try:
            if os.stat(self.socket_path).st_ino == self.socket_inode:
                os.unlink(self.socket_path)
        except FileNotFoundError:
            pass


def _hung_up(conn: socket.socket) -> bool:
    """Whether the peer closed its end entirely (not only its sending side)."""
    poller = select.poll()
    poller.register(conn, select.POLLOUT)
    return any(events & select.POLLHUP for _, events in poller.poll(0))


_SERVING: list[_Server] = []  # the server of this process, while serve() runs


def empty(shape: Any, dtype: Any = "float32") -> Any:
    """A new, uninitialised array to fill and return in this request's result, built where its reply goes.

    Inside ``on_predict`` with a client that takes reused buffers, its memory is already the buffer the
    reply carries: returning it costs no copy (a ``numpy.empty`` result is copied there). ``dtype`` a numpy
    dtype (or its name) gives a numpy array; a torch dtype gives a torch CPU tensor over the same memory.
    Outside a request, or for a small array (sent inline anyway), it is ordinary memory. It belongs to
    the reply: keep no reference to it past the request (a buffer something still holds is not reused).
    """
    torch = sys.modules.get("torch")
    wants_tensor = torch is not None and isinstance(dtype, torch.dtype)
    import numpy

    name = str(dtype).removeprefix("torch.") if wants_tensor else numpy.dtype(dtype).name
    shape = (shape,) if isinstance(shape, int) else tuple(int(n) for n in shape)
    nbytes = math.prod(shape) * numpy.dtype(name).itemsize if name in _ARRAY_DTYPES else 0
    view = _SERVING[-1].outgoing(nbytes) if _SERVING and nbytes else None
    if view is None:
        return torch.empty(shape, dtype=dtype) if wants_tensor else numpy.empty(shape, name)
    array = numpy.frombuffer(view, name, math.prod(shape)).reshape(shape)
    return torch.from_numpy(array) if wants_tensor else array


def empty_like(value: Any) -> Any:
    """``empty`` with the shape and dtype of ``value`` (a numpy array or a torch CPU tensor), of its kind."""
    return empty(tuple(value.shape), value.dtype)


# What numpy and the wire both carry (arrays.DTYPES); a torch dtype past these (bfloat16) gets torch.empty.
_ARRAY_DTYPES = frozenset({"bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
                           "float16", "float32", "float64", "complex64", "complex128"})


def serve(
    *,
    slug: str,
    socket_path: str | os.PathLike[str],
    on_predict: Callable[[Any], Any] | None = None,
    ready: Callable[[], dict[str, Any]] | None = None,
    on_reset: Callable[[], None] | None = None,
    log: Callable[[str], None] | None = None,
    orphan_grace_s: float | None = None,
    release_cublas: bool = True,
    on_predict_batch: Callable[[list[Any]], list[Any]] | None = None,
    max_batch_size: int | None = None,
    max_wait_ms: float | None = None,
    size_of: Callable[[Any], float] | None = None,
    max_batch_work: float | None = None,
) -> None:
    """Answer ``ping``, ``predict``, ``stats``, ``recall`` and ``shutdown`` on ``socket_path``.

    ``on_predict`` gets the request's ``payload`` (the whole request when it has
    none, as in the original design) and returns the reply's ``result``, one request at a time. An
    Exception from it fails that request only; SystemExit or KeyboardInterrupt is
    answered with ``reason: worker_exiting`` and re-raised.

    ``on_predict_batch`` instead (a worker the pool runs with ``[batching]``) gets a list of payloads queued by
    several callers and returns a list of results in their order; a result that is an Exception fails that request
    alone, and a call that raises is split until the failing requests are isolated (docs/batching.md). A call takes
    up to ``max_batch_size`` requests (and, with ``size_of``, up to ``max_batch_work`` of their work), and may wait
    ``max_wait_ms`` for more; the pool's variables for them (``BATCHING_ENV``), where set, win over these arguments.
    """
    log = log or (lambda message: print(f"[{slug}] {message}", file=sys.stderr, flush=True))
    if orphan_grace_s is None:
        grace = _variable("RESIDENT_POOL_ORPHAN_GRACE_S", ORPHAN_GRACE_ENV)
        orphan_grace_s = float(grace) if grace else DEFAULT_ORPHAN_GRACE_S
    release_cublas = release_cublas and _variable("RESIDENT_POOL_NO_CUBLAS_RELEASE", NO_CUBLAS_RELEASE_ENV) != "1"
    common = {"slug": slug, "on_reset": on_reset, "release_cublas": release_cublas, "log": log}
    if (on_predict is None) == (on_predict_batch is None):
        raise TypeError(f"{slug}: serve() takes exactly one of on_predict= (one payload per call) or "
                        "on_predict_batch= (a list of payloads per call, answered in their order)")
    if on_predict_batch is not None:
        if not callable(on_predict_batch) or (size_of is not None and not callable(size_of)):
            raise TypeError(f"{slug}: on_predict_batch and size_of must be functions")
        limits = _Limits(slug, max_batch_size, max_wait_ms, max_batch_work, size_of)
        model: _Model = _Batching(on_predict_batch, size_of, limits, **common)
        log(f"batching: up to {limits.max_batch_size} requests per model call"
            + (f", {limits.max_batch_work:g} of work" if limits.max_batch_work is not None else "")
            + (f", held open up to {limits.max_wait_ms:g} ms for more" if limits.max_wait_ms else ""))
    else:
        shaping = {"max_batch_size": max_batch_size, "max_wait_ms": max_wait_ms, "size_of": size_of,
                   "max_batch_work": max_batch_work}
        given = [name for name, value in shaping.items() if value is not None]
        if given:
            raise TypeError(f"{slug}: {', '.join(given)} shape the model calls of on_predict_batch; this worker gives "
                            "serve() on_predict, which answers one request per call")
        asked = [variable for variable in BATCHING_ENV.values() if os.environ.get(variable)]
        if asked:
            log(f"{', '.join(asked)} set (the manifest's [batching]), but this worker gives serve() on_predict: it "
                "answers one request per call; give it on_predict_batch= to batch")
        model = _Serial(on_predict, **common)
    server = _Server(socket_path, model, ready, log, orphan_grace_s)
    _SERVING.append(server)
    try:
        server.run()
    finally:
        _SERVING.remove(server)
