"""The client: ``Pool()`` connects to this host's pool (starting one if none runs).

Imports nothing of the pool's side: a client process (a Prefect task) pays for the
protocol, the settings and the errors, never for the server.
"""

from __future__ import annotations

import itertools
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from filelock import FileLock

from . import arrays
from . import priority as order
from .errors import ResidentPoolError, WorkerRequestError, error_from_dict
from .host.paths import Paths
from .lease import EXITING, KEPT_BUFFER_BYTES, RECALLED_RETRIES, Held, failure
from .messages import Acquire, Release, StopWorkers, Variant, Warm, bad_request
from .protocol import COPY, Inbox, PeerError, ProtocolError, connect, ready, recv_line, send_line, set_timeouts
from .settings import Settings, settings
from .version import __version__

__all__ = ["KEPT_BUFFER_BYTES", "Pool", "Session", "default_manifests", "shutdown_pool"]

POOL_START_TIMEOUT_S = 60.0


class _Process:
    """This process's request ids, and the forks it came from (os.register_at_fork).

    A Pool made before a fork (a module-level one, multiprocessing's fork start method) sees, in the child, its
    parent's connections, kept leases and request ids: written on from both sides, one socket would carry two
    processes' requests, and each would read the other's replies. A Pool notices ``forks`` changed and opens its
    own."""

    forks = 0
    request_ids = itertools.count(1)


def _forked() -> None:
    _Process.forks += 1
    # Another range for this process's request ids: a reply meant for its parent is never taken for its own.
    _Process.request_ids = itertools.count((os.getpid() << 32) + 1)


os.register_at_fork(after_in_child=_forked)


def _check_priority(priority: str) -> None:
    if not order.is_class(priority):
        raise bad_request(f"priority {priority!r} is not a class: one of {', '.join(order.CLASSES)}")


def default_manifests(manifests: str | os.PathLike[str] | None, config: Settings, where: Paths) -> Path:
    """``manifests``, else $RESIDENT_POOL_MANIFESTS (``config``), else ./manifests where it exists, else the running
    pool's folder (at ``where``); absolute (./manifests when none of them is there, so a message can name it)."""
    chosen = manifests or config.manifests
    if chosen:
        return Path(chosen).expanduser().resolve()
    here = Path("manifests").resolve()
    if here.is_dir():
        return here
    return running_pool_manifests(where, config.client_timeout_s) or here


def running_pool_manifests(where: Paths, timeout_s: float) -> Path | None:
    """The manifests folder of this host's running pool, as its hello says; None when no pool answers."""
    try:
        with connect(where.pool_socket()) as sock:
            sock.settimeout(timeout_s)
            send_line(sock, {"op": "hello", "version": __version__})
            hello = recv_line(sock, bytearray())
    except (OSError, ProtocolError, ResidentPoolError):  # none runs, it is not ours, or it went away
        return None
    folder = hello.get("manifests") if isinstance(hello, dict) else None
    return Path(folder) if isinstance(folder, str) and os.path.isabs(folder) else None


def after_hello(hello: dict[str, Any] | None) -> str:
    """What a client does with a connection after the pool's hello: ``use`` it; ``again`` (the pool closed it: the
    next one answers); ``drained`` (this pool drains to exit: wait for its socket to go, then again); ``replace``
    (an idle pool of another version: ask it to shut down, then again). Raises where the pool turned it away, or
    runs another version and holds workers."""
    if hello is None:
        return "again"
    if hello.get("ok") is False:  # turned away (too many connections): its reason, not a version story
        error = hello.get("error")
        raise error_from_dict(error if isinstance(error, dict) else {"error": str(error)})
    if hello.get("version") == __version__ and not hello.get("draining"):
        return "use"
    if hello.get("draining"):
        return "drained"
    if not hello.get("idle"):
        raise ResidentPoolError(
            f"this client is resident-pool {__version__} but the pool (pid {hello.get('pid')}) runs "
            f"{hello.get('version')} and holds workers; run `resident-pool stop --all` (its workers "
            "drain, and the idle pool then gives way to this version), or retry once it is idle",
            reason="version_mismatch", details={"client": __version__, "pool": hello.get("version")})
    return "replace"


def heard(line: dict[str, Any], recalled: dict[int, str]) -> bool:
    """A line the pool sent unasked: True when it was one (a recall is kept in ``recalled`` for its session)."""
    recall = line.get("recall")
    if isinstance(recall, dict) and isinstance(recall.get("lease"), int):
        recalled[recall["lease"]] = str(recall.get("why") or "")
        return True
    return "progress" in line


def admission_wait(line: dict[str, Any]) -> dict[str, Any] | None:
    """The admission wait a progress line reports (for ``on_wait``), or None."""
    progress = line.get("progress")
    return progress.get("waiting_for_admission") if isinstance(progress, dict) else None


class _Link:
    """One thread's connection to the pool and its cached worker connections."""

    def __init__(self, pool_socket: socket.socket) -> None:
        self.pool = pool_socket
        self.buf = bytearray()
        self.workers: dict[tuple[str, int, int], tuple[socket.socket, Inbox]] = {}
        self.kept: dict[str, Session] = {}  # Pool.predict's leases, by provider, held between calls
        self.recalled: dict[int, str] = {}  # leases the pool asked back (backfilled ones), and why

    def heard(self, line: dict[str, Any]) -> bool:
        """A line the pool sent unasked: True when it was one (a recall is kept for its session)."""
        return heard(line, self.recalled)

    def poll(self) -> None:
        """Read what the pool sent since (a recall), without waiting."""
        while ready(self.pool):
            line = recv_line(self.pool, self.buf)
            if line is None:
                return  # the pool went away: the next call says so
            self.heard(line)

    def disown(self) -> None:
        """In a forked child: this link, its leases and its buffers are the parent's. Its leases are never given
        back from here (the parent still uses them) and nothing is sent; only this process's copies of the
        descriptors close, which the parent's connections outlive."""
        for session in self.kept.values():
            session._ended = True
        self.kept.clear()
        self.recalled.clear()
        self.close()

    def close(self) -> None:
        for sock, inbox in self.workers.values():
            sock.close()
            inbox.close()
        self.workers.clear()
        self.pool.close()

    def __del__(self) -> None:
        # A Pool dropped without close() (a cached client at a process's end, a test's): its connections close
        # here, as the kernel would close them at exit, and the pool ends their leases. Not left to the
        # sockets' own finalizers, which warn (ResourceWarning) in whatever code runs when they are collected.
        try:
            self.close()
        except Exception:  # noqa: BLE001, S110 - a finalizer must not raise; the descriptors go at exit anyway
            pass


class Pool:
    """This host's pool of resident workers, as seen from one client process.

    Thread-safe: each thread gets its own connection, and with it its own leases.
    """

    def __init__(
        self,
        manifests: str | os.PathLike[str] | None = None,
        *,
        start: bool = True,
        on_wait: Callable[[dict[str, Any]], None] | None = None,
        holder: dict[str, str] | None = None,
    ) -> None:
        """``on_wait`` is called (every few seconds, on the thread that asked) while any request of this client waits
        for GPU admission (a call's own ``on_wait``, given to ``session`` or ``warm``, hears that call's waits
        alone); ``holder`` says who this client's leases are for (shown in ``status``)."""
        self.config = settings()  # read once: a Pool's settings are those of when it was made, like its folders
        self.paths = Paths.of(self.config)
        self.manifests = default_manifests(manifests, self.config, self.paths)
        self.start = start
        self.on_wait = on_wait
        self.holder = holder
        self.state_dir = self.paths.state_dir()
        self.socket_path = self.paths.pool_socket()
        self._local = threading.local()
        self._links: list[_Link] = []
        self._links_lock = threading.Lock()
        self._forks = _Process.forks

    # -- connection ------------------------------------------------------------
    def _leave_parents(self) -> None:
        """In a process forked since the last call: forget the parent's links and leases (untouched: they are
        its own), so this process connects, and acquires, anew."""
        self._forks = _Process.forks
        links, self._links = self._links, []
        self._local = threading.local()
        self._links_lock = threading.Lock()  # another thread of the parent may have held it at the fork
        for link in links:
            link.disown()

    def _link(self) -> _Link:
        if self._forks != _Process.forks:
            self._leave_parents()
        link = getattr(self._local, "link", None)
        if link is None:
            link = _Link(self._connect())
            self._local.link = link
            with self._links_lock:
                self._links.append(link)
        return link

    def _connect(self) -> socket.socket:
        """A connection to a pool of this client's version, starting one when none runs."""
        for _ in range(3):
            sock = self._open()
            try:
                sock.settimeout(self.config.client_timeout_s)
                try:
                    send_line(sock, {"op": "hello", "version": __version__})
                except (BrokenPipeError, ConnectionResetError):
                    pass  # closed on us: what it said first (too many connections) is still there to read
                hello = recv_line(sock, bytearray())
            except TimeoutError:
                sock.close()
                raise self._unresponsive("hello") from None
            except (ConnectionResetError, BrokenPipeError):
                sock.close()  # a pool that died or gave way between connect and hello: the next one answers
                continue
            except (OSError, ProtocolError):
                sock.close()
                raise
            try:
                step = after_hello(hello)
            except ResidentPoolError:
                sock.close()
                raise
            if step == "use":
                return sock
            sock.close()
            if step == "drained":
                self._wait_for_socket_to_go()
            elif step == "replace":
                self._call_once({"op": "shutdown"})  # idle: it drains at once and a pool of this version starts
                self._wait_for_socket_to_go()
        raise self._unreachable()

    def _unreachable(self) -> ResidentPoolError:
        return ResidentPoolError(f"no pool of version {__version__} could be reached on {self.socket_path}")

    def _no_pool(self) -> ResidentPoolError:
        return ResidentPoolError(f"no pool is running on {self.socket_path}; start one with `resident-pool daemon`",
                                 reason="no_pool")

    def _open(self) -> socket.socket:
        try:
            return connect(self.socket_path)
        except PeerError as exc:
            raise ResidentPoolError(str(exc), reason="peer_not_you") from None
        except (FileNotFoundError, ConnectionRefusedError):
            if not self.start:
                raise self._no_pool() from None
        # Two flow runs racing here start one pool, not two.
        with FileLock(str(self.state_dir / "start.lock")):
            try:
                return connect(self.socket_path)
            except (FileNotFoundError, ConnectionRefusedError):
                self._start_pool()
        return connect(self.socket_path)

    def _start_pool(self) -> None:
        log = self.paths.log_dir() / "pool.log"
        with open(log, "a") as out:
            # --background forks and returns at once: the pool belongs to no client, so it outlives
            # the flow run that started it. -P and the state directory as working directory: nothing
            # in the folder this client runs from is importable by the pool.
            started = subprocess.run(
                [sys.executable, "-P", "-m", "resident_pool.server.daemon", "--background",
                 "--manifests", str(self.manifests)],
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, check=False, timeout=60,
                cwd=self.state_dir,
            )
        if started.returncode != 0:  # it said why before detaching (a host admission service that does not answer)
            said = log.read_text(errors="replace").strip().splitlines()[-1:] if log.exists() else []
            raise ResidentPoolError(f"the pool could not start (exit {started.returncode}): "
                                    f"{said[0] if said else 'see ' + str(log)}", reason="pool_start_failed")
        deadline = time.monotonic() + POOL_START_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                connect(self.socket_path).close()
                return
            except (FileNotFoundError, ConnectionRefusedError):
                time.sleep(0.02)
        raise ResidentPoolError(f"the pool did not come up on {self.socket_path} within "
                                f"{POOL_START_TIMEOUT_S:g} s; see {log}")

    def _wait_for_socket_to_go(self, wait_s: float | None = None) -> None:
        deadline = time.monotonic() + (self.config.drain_grace_s + 30.0 if wait_s is None else wait_s)
        while os.path.exists(self.socket_path) and time.monotonic() < deadline:
            time.sleep(0.05)

    def _call_once(self, message: dict[str, Any]) -> None:
        try:
            with connect(self.socket_path) as sock:
                send_line(sock, message)
                recv_line(sock, bytearray())
        except (OSError, ProtocolError):
            pass  # it is gone already

    def _unresponsive(self, op: str) -> ResidentPoolError:
        return ResidentPoolError(
            f"the pool at {self.socket_path} did not answer {op} within {self.config.client_timeout_s:g} s "
            "(RESIDENT_POOL_CLIENT_TIMEOUT_S); it may be stopped (SIGSTOP), swapping or wedged: look at "
            f"{self.paths.log_dir() / 'pool.log'}, or restart it", reason="pool_unresponsive")

    def _call(self, message: dict[str, Any], expect_reply: bool = True,
              on_wait: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
        """Send ``message`` and read its reply; each report of a wait for GPU admission heard meanwhile goes to
        this client's ``on_wait`` and to this call's own ``on_wait``."""
        link = self._link()
        try:
            # Long ops (a cold start, a drain) send a keepalive every few seconds: silence past the
            # timeout means the pool is frozen, not busy.
            link.pool.settimeout(self.config.client_timeout_s)
            send_line(link.pool, message)
            if not expect_reply:
                return {}
            reply = recv_line(link.pool, link.buf)
            while reply is not None and link.heard(reply):
                wait = admission_wait(reply)
                if wait is not None:
                    for hear in (self.on_wait, on_wait):
                        if hear is not None:
                            hear(wait)
                reply = recv_line(link.pool, link.buf)
        except TimeoutError:
            self._drop_link()
            raise self._unresponsive(str(message.get("op"))) from None
        except (OSError, ProtocolError):
            self._drop_link()
            raise
        if reply is None:
            self._drop_link()
            raise ConnectionResetError(f"the pool at {self.socket_path} closed the connection")
        if not reply.get("ok"):
            error = reply.get("error")
            raise error_from_dict(error if isinstance(error, dict) else {"error": str(error)})
        return reply

    def _drop_link(self) -> None:
        link = getattr(self._local, "link", None)
        if link is not None:
            link.close()
            self._local.link = None
            with self._links_lock:
                if link in self._links:
                    self._links.remove(link)

    def close(self) -> None:
        """Close this client's connections; its leases end with them (the kept ones given back first)."""
        if self._forks != _Process.forks:
            self._leave_parents()  # the parent's: not given back from here
        with self._links_lock:
            links, self._links = self._links, []
        for link in links:
            for session in link.kept.values():
                if not session._ended:  # given back: not abandoned, which would cost the worker a ping
                    session._ended = True
                    try:
                        send_line(link.pool, Release(session.lease["lease"], "ok", session._unnoticed).to_message())
                    except OSError:
                        break  # the pool is gone: the leases went with the connection
            link.close()
        self._local = threading.local()

    def __enter__(self) -> Pool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- the API -------------------------------------------------------------
    def predict(self, slug: str, payload: Any, *, priority: str = order.DEFAULT) -> Any:
        """One prediction from ``slug``'s worker; starts it if none is warm. ``priority``: interactive, normal or
        batch, where the request waits when it must.

        The lease is kept between calls (per thread), so a warm call is one round trip to the worker. The pool
        counts a kept lease idle while no request runs, and takes it back when another client waits, admission
        needs the memory or the worker retires; the next call then acquires again, unseen by the caller.
        """
        _check_priority(priority)
        link = self._link()
        for _ in range(RECALLED_RETRIES):
            session = link.kept.get(slug)
            if session is None or session._ended:
                session = Session(self, *self._acquire(slug, None, self.holder, priority, keep=True))
                if not session.lease.get("kept"):  # a worker per lease (mode = "subprocess"), or one that
                    try:                           # cannot be asked for its lease back
                        return session.predict(payload)
                    finally:
                        session.release()
                link.kept[slug] = session
            try:
                result = session.predict(payload)
            except WorkerRequestError as error:
                if error.reason != "lease_recalled":
                    raise
                continue  # taken back between calls: acquire again
            finally:
                if session._ended:
                    link.kept.pop(slug, None)
                session.trim()
            session.notice()
            return result
        raise WorkerRequestError(f"{slug}: its lease was taken back {RECALLED_RETRIES} times in a row; the pool is "
                                 "busy with other clients: retry", slug=slug, reason="lease_recalled")

    @contextmanager
    def session(self, slug: str, variant: dict[str, Any] | None = None,
                holder: dict[str, str] | None = None, *,
                max_attachment_bytes: int | None = None, priority: str = order.DEFAULT,
                on_wait: Callable[[dict[str, Any]], None] | None = None) -> Iterator[Session]:
        """Hold one worker of ``slug`` for a batch; others wait for a replica meanwhile.

        ``variant`` (``{"name": "stock", "kit_mode": "off"}`` or ``{"name": "stock", "without_kit":
        True}``) asks for the provider built another way, as ``resident-pool check --against-stock`` does;
        ``holder`` (short strings: a flow run's name, id and URL) says who this lease is for;
        ``max_attachment_bytes`` lowers the largest attachment this session maps from the worker's answers
        below ``RESIDENT_POOL_MAX_ATTACHMENT_BYTES`` (a campaign does); ``priority`` (interactive, normal,
        batch) says where it waits in line. A backfilled lease (it started ahead of a request that did not
        fit yet) may be recalled: its worker is taken back once the request in flight is over (at once when the
        session is idle), and the session's next request waits again in its class, maybe for another worker,
        unseen by the caller (``session.recalls`` counts it). ``on_wait`` hears every few seconds what this
        session's lease waits for while it waits for GPU admission; ``session.wait`` keeps the last report.
        """
        _check_priority(priority)
        self._give_back_kept(slug)  # this thread is here, not in a Pool.predict: its kept lease is idle
        holder = holder or self.holder

        def acquire() -> tuple[dict[str, Any], dict[str, Any] | None]:
            return self._acquire(slug, variant, holder, priority, on_wait=on_wait)

        session = Session(self, *acquire(), max_attachment_bytes=max_attachment_bytes, reacquire=acquire)
        try:
            yield session
        finally:
            session.release()

    def _give_back_kept(self, slug: str) -> None:
        """Release this thread's kept lease of ``slug`` (a session of it would otherwise wait for it, or start
        another worker)."""
        link = getattr(self._local, "link", None)
        session = link.kept.pop(slug, None) if link is not None else None
        if session is not None:
            session.release()

    def _acquire(self, slug: str, variant: dict[str, Any] | None = None,
                 holder: dict[str, str] | None = None, priority: str = order.DEFAULT, keep: bool = False,
                 on_wait: Callable[[dict[str, Any]], None] | None = None,
                 ) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """The lease, and the last report of its wait for GPU admission (None: it did not wait for memory)."""
        message = Acquire(slug, str(self.manifests), holder or None,
                          Variant(**variant) if variant else None, priority, keep).to_message()
        heard: list[dict[str, Any]] = []  # this call's own: another thread's acquire keeps its own

        def hear(wait: dict[str, Any]) -> None:
            heard.append(wait)
            if on_wait is not None:
                on_wait(wait)

        attempts = 3
        for attempt in range(attempts):
            try:
                return self._call(message, on_wait=hear), (heard[-1] if heard else None)
            except ResidentPoolError as error:  # first: AdmissionTimeout is an OSError too, and final
                if error.reason != "pool_stopping" or attempt == attempts - 1:
                    raise
                self._drop_link()  # it drains to exit; the next pool serves this request
                self._wait_for_socket_to_go()
            except (OSError, ProtocolError):
                # The pool went away (killed, restarted): reconnect, or start a new one.
                if attempt == attempts - 1:
                    raise
        raise AssertionError("unreachable")

    def status(self) -> dict[str, Any]:
        reply = self._call({"op": "status"})
        reply.pop("ok", None)
        return reply

    def waiting(self) -> list[dict[str, Any]]:
        return self._call({"op": "waiting"})["waiting"]

    def stop(self, slug: str | None = None, now: bool = False) -> list[str]:
        """Stop ``slug``'s workers (every provider's when None); leased ones finish first unless ``now``."""
        return self._call(StopWorkers(slug, now).to_message())["stopped"]

    def warm(self, slug: str, replicas: int = 1, *,
             on_wait: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
        """Start ``slug``'s workers until ``replicas`` of them run (and answer); returns what was started.
        ``on_wait`` hears every few seconds what a start waits for while it waits for GPU admission."""
        reply = self._call(Warm(slug, replicas, str(self.manifests)).to_message(), on_wait=on_wait)
        reply.pop("ok", None)
        return reply

    def metrics_text(self) -> str:
        """The pool's metrics in Prometheus's text format."""
        return self._call({"op": "metrics"})["text"]

    def shutdown(self, wait_s: float = 60.0) -> int:
        """Stop every worker and the pool process itself; returns its pid.

        Waits (up to ``wait_s``) for its socket to go, so the next client starts a fresh pool.
        """
        pid = self._call({"op": "shutdown"})["pid"]
        self.close()
        self._wait_for_socket_to_go(wait_s)
        return pid


def shutdown_pool(wait_s: float = 60.0) -> int | None:
    """Shut down this host's pool if one runs; its pid, or None when there was none."""
    try:
        return Pool(start=False).shutdown(wait_s)
    except (ResidentPoolError, OSError):
        return None


class Session(Held):
    """A leased worker: requests go straight to its socket.

    ``wait``: the last report of the wait for GPU admission its lease went through (what it needed, what was free,
    who held it, how long it waited), or None when it did not wait for memory.
    """

    def __init__(self, pool: Pool, lease: dict[str, Any], wait: dict[str, Any] | None = None,
                 max_attachment_bytes: int | None = None,
                 reacquire: Callable[[], tuple[dict[str, Any], dict[str, Any] | None]] | None = None) -> None:
        self.pool = pool
        cap = pool.config.max_attachment_bytes
        self.max_attachment_bytes = cap if max_attachment_bytes is None else min(cap, max_attachment_bytes)
        self._reacquire = reacquire
        self._link = pool._link()  # the connection its lease is bound to: a recall comes on it
        self.recalls = 0  # leases given back on the pool's recall, each followed by a new one
        self._forks = _Process.forks  # the process it was opened in (a child of a fork has other forks)
        self._inbox: Inbox | None = None  # of the connection its last request went on
        self._hold(lease, wait)
        self._ended = False

    def _renew_if_recalled(self) -> None:
        """A backfilled lease the pool asked back is given back before the next request, which waits again in its
        class (maybe for another worker); every other lease is never taken from its session. (A kept lease is
        recalled at its worker only: Pool.predict acquires again.) The pool tells the session, and asks its worker
        too (so an idle session gives its memory back at once): this is the fast path, without a round trip to a
        worker that would refuse the lease."""
        if not self._renews():
            return
        self._link.poll()
        if self._link.recalled.pop(self.lease["lease"], None) is not None:
            self._renew()

    def _renew(self) -> None:
        """Give the recalled lease back (the pool may have ended it already: then the release finds nothing) and
        wait for a new one in this session's class."""
        self._forget_worker()
        self._link.recalled.pop(self.lease["lease"], None)
        try:
            self.pool._call(Release(self.lease["lease"], "ok", self._unnoticed).to_message(), expect_reply=False)
        except OSError:
            pass  # the pool is gone: the lease went with its connection, and the acquire below says what is wrong
        self._ended = False
        self._hold(*self._reacquire())
        self.recalls += 1

    def _worker(self) -> tuple[socket.socket, Inbox]:
        link = self.pool._link()
        # The cap is told to the worker once per connection: a session with another cap needs its own.
        key = (self.lease["socket"], self.pid, self.max_attachment_bytes)
        cached = link.workers.get(key)
        if cached is None:
            for old in [k for k in link.workers if k[0] == key[0]]:
                link.workers.pop(old)[0].close()
            # A worker's reused buffers are copied out before anything reads them: it may still change them.
            inbox = Inbox(self.max_attachment_bytes, self.pool.config.attach_min_bytes, reused=COPY)
            cached = link.workers[key] = (connect(self.lease["socket"]), inbox)
        return cached

    def _cached_worker(self) -> tuple[socket.socket, Inbox] | None:
        return self.pool._link().workers.get((self.lease["socket"], self.pid, self.max_attachment_bytes))

    def _forget_worker(self) -> None:
        cached = self.pool._link().workers.pop((self.lease["socket"], self.pid, self.max_attachment_bytes), None)
        if cached is not None:
            cached[0].close()
            cached[1].close()

    def _opened_here(self) -> bool:
        return self._forks == _Process.forks

    def _tell(self, message: dict[str, Any]) -> None:
        try:
            self.pool._call(message, expect_reply=False)
        except (OSError, ResidentPoolError):
            pass  # the pool is gone: the lease went with its connection

    def predict(self, payload: Any) -> Any:
        self._check_usable()
        for _ in range(RECALLED_RETRIES):
            self._renew_if_recalled()
            try:
                return self._predict_once(payload)
            except WorkerRequestError as error:
                # A backfilled lease the pool took back at its worker (the request was refused, not run): it waits
                # again in its class, unseen by the caller, as Pool.predict's kept lease does.
                if error.reason != "lease_recalled" or not self._renews():
                    raise
                self._renew()
        raise self._taken_back_too_often()

    def _predict_once(self, payload: Any) -> Any:
        request_id = next(_Process.request_ids)  # unique in this process: a reply to another request is never taken
        timeout = self.lease["request_timeout_s"]
        # try/except, not a context manager: entering and leaving two generator-based ones cost about what decoding
        # the reply does (measured here).
        try:
            sock, inbox = self._worker()
            self._inbox = inbox  # for trim, after the call
            if inbox.timeout != timeout:  # set in the kernel: Python's own timeout polls before each send and read
                set_timeouts(sock, timeout)
                inbox.timeout = timeout
            if inbox.peer is None:
                arrays.negotiate(sock, inbox)
            if inbox.slabs is None and arrays.reuses(inbox.peer):
                inbox.slabs = arrays.Slabs()  # this session's reused buffers, on its connection to the worker
        except BaseException as exc:
            error = self._failed(exc, timeout, sent=False)
            if error is None:
                raise
            raise error  # noqa: B904 - its cause is set by _failure_error (None where the exchange's adds nothing)
        # Encoded before a byte of it goes: a payload that cannot be sent (a dtype the protocol does not
        # carry, NaN, over a cap) raises here as the caller's mistake, and the session goes on as it was.
        encoded = arrays.encode(self._request(request_id, payload), inbox.peer, inbox.attach_min_bytes,
                                slabs=inbox.slabs)
        try:
            # Arrays in the payload and the result travel beside the line (arrays.py).
            reply = self._answered(arrays.complete(sock, inbox, *encoded, request_id=request_id), request_id)
        except BaseException as exc:
            error = self._failed(exc, timeout, sent=True)
            if error is None:
                raise
            raise error  # noqa: B904 - its cause is set by _failure_error (None where the exchange's adds nothing)
        result = self._outcome(reply)
        if result is EXITING:
            raise error_from_dict(self._end("exiting", {"reply": reply})["error"])
        return result

    def _failed(self, exc: BaseException, timeout: float, sent: bool) -> BaseException | None:
        """What a broken, timed-out or interrupted exchange with the worker does to this session (lease.failure): the
        error to raise instead of ``exc``, or None (``exc`` itself goes on).

        ``sent=False``: no request has gone yet (connecting, negotiating)."""
        kind = failure(exc)
        answer = self._end(kind, {}) if self._dropped(kind) else {}
        return self._failure_error(kind, exc, sent, timeout, answer)

    def _end(self, outcome: str, extra: dict[str, Any]) -> dict[str, Any]:
        self._ended = True
        return self.pool._call(Release(self.lease["lease"], outcome, self._unnoticed, extra.get("reply")).to_message())
