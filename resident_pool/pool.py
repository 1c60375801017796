"""The host pool: one long-lived process per host and user that owns the workers.

Clients lease a worker over the pool's socket and then talk to the worker's
socket directly; the pool never copies a payload. A lease is bound to the
client's connection, so a client that dies gives its worker back at once.
"""

from __future__ import annotations

import itertools
import logging
import os
import select
import signal
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import paths
from .admission import Admission, Ledger, read_devices
from .errors import ManifestError, ResidentPoolError, error_from_dict
from .exits import REFUSAL_CODES
from .launch import worker_for
from .manifest import Manifest, load_manifest
from .protocol import ProtocolError, bind_unix, recv_line, send_line
from .supervisor import ResidentWorker

__all__ = ["POOL_SOCKET", "PoolServer"]

log = logging.getLogger("resident_pool.pool")
POOL_SOCKET = "pool.sock"
BREAKER_FAILURES = 3
_TICK_S = 0.25
_lease_ids = itertools.count(1)


@dataclass
class Replica:
    worker: ResidentWorker
    lease: int | None = None
    retiring: bool = False
    cold: bool = True

    @property
    def free(self) -> bool:
        return self.lease is None and not self.retiring


@dataclass
class Breaker:
    """A provider whose starts keep failing is refused at once until cooldown or a manifest change."""

    fingerprint: str = ""
    failures: int = 0
    error: dict[str, Any] | None = None
    open_until: float = 0.0
    refused: int = 0

    def is_open(self, fingerprint: str) -> bool:
        if self.open_until and fingerprint != self.fingerprint:
            self.reset()  # the manifest changed: worth another start
        return time.monotonic() < self.open_until

    def reset(self) -> None:
        self.failures, self.error, self.open_until, self.refused = 0, None, 0.0, 0


class _CpuOnly:
    """Admission for a "recommended" GPU provider on a host with no GPU: run it on the CPU."""

    def admit(self, worker) -> dict[str, str]:
        return {"CUDA_VISIBLE_DEVICES": ""}

    def release(self, worker) -> None:
        pass


@dataclass
class _Provider:
    manifest: Manifest
    stamp: tuple[int, int]
    fingerprint: str
    source: Path  # the manifest path as clients name it
    replicas: dict[int, Replica] = field(default_factory=dict)
    queue: list[int] = field(default_factory=list)  # tickets waiting for a replica, in arrival order
    waiters: dict[int, threading.Condition] = field(default_factory=dict)
    breaker: Breaker = field(default_factory=Breaker)


class PoolServer:
    def __init__(self, manifests: Path, quiet_exit_s: float | None = None) -> None:
        self.manifests = manifests.resolve()
        self.state_dir = paths.state_dir()
        self.socket_path = str(self.state_dir / POOL_SOCKET)
        self.quiet_exit_s = (
            float(os.environ.get("RESIDENT_POOL_QUIET_EXIT_S", "600")) if quiet_exit_s is None else quiet_exit_s
        )
        self.breaker_cooldown_s = float(os.environ.get("RESIDENT_POOL_BREAKER_COOLDOWN_S", "300"))
        self.ledger = Ledger(self.state_dir / "ledger.json")
        self.admission = Admission(self.ledger, evict=self._evict_idle, on_wait=self._log_wait,
                                   cancelled=self._client_gone)
        self.providers: dict[str, _Provider] = {}
        self.leases: dict[int, tuple[str, int, int]] = {}  # lease -> (slug, replica, connection)
        # One lock; each waiting acquire has its own condition on it, so a release wakes the
        # first in line alone. Waking every waiter cost 64 thread switches per release under load.
        self.lock = threading.RLock()
        self.cv = threading.Condition(self.lock)
        self.connections = 0
        self.quiet_since = time.monotonic()
        self.started = time.time()
        self.stop_signal: int | None = None
        self._tickets = itertools.count(1)
        # The client connection an acquiring thread serves: admission reports its waits there.
        self._current = threading.local()

    # -- serving -------------------------------------------------------------
    def serve_forever(self) -> None:
        listener = bind_unix(self.socket_path)
        self.socket_inode = os.stat(self.socket_path).st_ino
        listener.settimeout(_TICK_S)
        (self.state_dir / "pool.pid").write_text(str(os.getpid()))
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(signum, self._record_signal)
        log.info("pool %d serving %s (manifests %s)", os.getpid(), self.socket_path, self.manifests)
        threading.Thread(target=self._maintain_loop, name="maintain", daemon=True).start()
        try:
            while self.stop_signal is None:
                try:
                    conn, _ = listener.accept()
                except TimeoutError:
                    continue
                with self.cv:
                    self.connections += 1
                threading.Thread(target=self._serve_client, args=(conn,), daemon=True).start()
        finally:
            listener.close()
            if self._socket_is_ours():
                self._unlink_own(self.socket_path)
            self.stop_all()
            log.info("pool %d stopped (%s)", os.getpid(),
                     f"signal {self.stop_signal}" if self.stop_signal else "quiet")

    def _record_signal(self, signum, frame) -> None:
        # Only record it: the accept loop notices within a tick and stops cleanly.
        self.stop_signal = signum

    def _unlink_own(self, path: str) -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass

    def _maintain_loop(self) -> None:
        while self.stop_signal is None:
            try:
                self._maintain()
            except Exception:  # one bad pass must not end retirement for good; logged with its traceback
                log.exception("maintenance pass failed")
            time.sleep(_TICK_S)

    def _socket_is_ours(self) -> bool:
        try:
            return os.stat(self.socket_path).st_ino == self.socket_inode
        except FileNotFoundError:
            return False

    def _maintain(self) -> None:
        """Retire idle workers; leave when nothing has been held or asked for a while."""
        if not self._socket_is_ours():
            # The state directory was deleted or another pool took the socket: no new client
            # can reach this pool, so its workers would only hold memory. Stand down.
            log.warning("socket %s is gone or no longer ours; stopping every worker and exiting", self.socket_path)
            self.stop_signal = 0
            return
        now = time.monotonic()
        retire = []
        with self.cv:
            for provider in self.providers.values():
                timeout = provider.manifest.lifecycle.idle_timeout_s
                for replica in provider.replicas.values():
                    worker = replica.worker
                    if not replica.free or not worker.is_running():
                        continue
                    if provider.manifest.mode == "subprocess" or (timeout > 0 and worker.idle_s() >= timeout):
                        replica.retiring = True
                        retire.append((provider, replica))
            held = any(r.worker.is_running() or r.lease for p in self.providers.values() for r in p.replicas.values())
            if held or self.connections:
                self.quiet_since = now
        for provider, replica in retire:
            replica.worker._note(f"idle for {replica.worker.idle_s():.1f} s; retiring")
            self._retire(provider, replica)
        if self.quiet_exit_s > 0 and now - self.quiet_since >= self.quiet_exit_s:
            log.info("no workers and no clients for %g s; exiting", self.quiet_exit_s)
            self.stop_signal = 0

    def _retire(self, provider: _Provider, replica: Replica) -> None:
        replica.worker.stop()
        with self.cv:
            if provider.replicas.get(replica.worker.replica) is replica:
                del provider.replicas[replica.worker.replica]
            self._wake(provider)

    def _serve_client(self, conn: socket.socket) -> None:
        connection = id(conn)
        buf = bytearray()
        try:
            while True:
                try:
                    message = recv_line(conn, buf)
                except ProtocolError as exc:
                    send_line(conn, {"ok": False, "reason": "bad_request", "error": f"bad request line: {exc}"})
                    if exc.recoverable:
                        continue
                    return
                if message is None:
                    return
                self._current.conn = conn
                reply = self._dispatch(message, connection)
                if reply is not None:
                    send_line(conn, reply)
        except OSError:
            pass  # the client went away mid-reply; its leases are released below
        finally:
            conn.close()
            self._release_connection(connection)
            with self.cv:
                self.connections -= 1

    def _dispatch(self, message: dict[str, Any], connection: int) -> dict[str, Any] | None:
        op = message.get("op")
        try:
            if op == "acquire":
                return {"ok": True, **self.acquire(str(message.get("slug")), message.get("manifests"), connection)}
            if op == "release":
                return self.release(int(message["lease"]), message.get("outcome", "ok"), message)
            if op == "status":
                return {"ok": True, **self.status()}
            if op == "waiting":
                return {"ok": True, "waiting": self.waiting()}
            if op == "stop":
                return {"ok": True, "stopped": self.stop(message.get("slug"))}
            if op == "hello":
                return {"ok": True, "pid": os.getpid(), "manifests": str(self.manifests)}
            if op == "shutdown":
                self.stop_signal = 0
                return {"ok": True, "pid": os.getpid()}
        except ResidentPoolError as exc:
            return {"ok": False, "reason": exc.reason, "error": exc.to_dict()}
        except (KeyError, TypeError, ValueError) as exc:
            return {"ok": False, "reason": "bad_request", "error": {"type": "ResidentPoolError",
                                                                  "error": f"bad {op} request: {exc!r}"}}
        return {"ok": False, "reason": "unknown_op",
                "error": {"type": "ResidentPoolError", "error": f"unknown pool op {op!r}"}}

    # -- manifests -------------------------------------------------------------
    def _provider(self, slug: str, manifests: str | None) -> _Provider:
        # Clients send absolute folders; resolving symlinks on every acquire costs a stat per component.
        directory = Path(manifests) if manifests else self.manifests
        path = directory / slug / "manifest.toml"
        try:
            info = path.stat()
        except FileNotFoundError:
            raise ManifestError(
                f"{slug}: no provider of that name: {path} does not exist; check the slug or pass --manifests",
                slug=slug,
            ) from None
        stamp = (info.st_mtime_ns, info.st_size)
        with self.cv:
            provider = self.providers.get(slug)
            if provider is not None and provider.source != path and provider.replicas:
                raise ManifestError(
                    f"{slug}: this pool already holds {slug} from {provider.manifest.path}, not {path}; "
                    f"stop it first (`resident-pool stop {slug}`)",
                    slug=slug,
                )
            if provider is not None and provider.stamp == stamp and provider.source == path:
                return provider
        manifest = load_manifest(path)
        with self.cv:
            provider = self.providers.get(slug)
            if provider is None:
                provider = self.providers[slug] = _Provider(manifest, stamp, manifest.fingerprint(), path)
            else:
                provider.manifest, provider.stamp = manifest, stamp
                provider.fingerprint, provider.source = manifest.fingerprint(), path
            return provider

    def _admitter(self, manifest: Manifest):
        if manifest.gpu.policy == "none":
            return None
        if manifest.gpu.policy == "recommended" and not read_devices()[0]:
            return _CpuOnly()
        return self.admission

    # -- leases ---------------------------------------------------------------
    def acquire(self, slug: str, manifests: str | None, connection: int) -> dict[str, Any]:
        """Lease a ready replica of ``slug``, starting one if the provider may have another."""
        provider = self._provider(slug, manifests)
        manifest = provider.manifest
        ticket = next(self._tickets)
        with self.cv:
            breaker = provider.breaker
            if breaker.is_open(provider.fingerprint):
                breaker.refused += 1
                raise self._breaker_error(slug, breaker)
            provider.queue.append(ticket)
            provider.waiters[ticket] = waiter = threading.Condition(self.lock)
            try:
                while True:
                    replica = self._claim(provider, ticket)
                    if replica is not None:
                        break
                    if self._client_gone():  # its place in the queue must not hold up the rest
                        raise ResidentPoolError(f"{slug}: the client waiting for a replica went away",
                                                slug=slug, reason="client_gone")
                    waiter.wait(_TICK_S)
            finally:
                provider.queue.remove(ticket)
                del provider.waiters[ticket]
                self._wake(provider)
            lease = next(_lease_ids)
            replica.lease = lease
            self.leases[lease] = (slug, replica.worker.replica, connection)
        worker = replica.worker
        cold = not worker.is_running()
        if cold:
            try:
                worker.ensure_started()
            except ResidentPoolError as exc:
                self._start_failed(provider, replica, lease, exc)
                raise
            if worker.vram_budget_gb and worker.admitter is self.admission:
                self.admission.started(worker)
            with self.cv:
                provider.breaker.reset()
        return {
            "lease": lease, "slug": slug, "replica": worker.replica, "pid": worker.pid,
            "socket": worker.socket_path, "cold": cold, "transcript": str(worker.transcript),
            "request_timeout_s": manifest.lifecycle.request_timeout_s, "device": worker.device,
        }

    def _wake(self, provider: _Provider) -> None:
        """A replica may be free: the first request in line looks (the lock is held)."""
        if provider.queue:
            provider.waiters[provider.queue[0]].notify()

    def _claim(self, provider: _Provider, ticket: int) -> Replica | None:
        """The replica this ticket may take now, or None to keep waiting (first come, first served)."""
        if provider.queue[0] != ticket:
            return None
        replicas = sorted(provider.replicas.values(), key=lambda r: (not r.worker.is_running(), r.worker.replica))
        for replica in replicas:
            if replica.free:
                return replica
        if len(provider.replicas) < provider.manifest.lifecycle.max_replicas:
            index = next(i for i in itertools.count() if i not in provider.replicas)
            worker = worker_for(provider.manifest, replica=index, admitter=self._admitter(provider.manifest))
            provider.replicas[index] = replica = Replica(worker)
            return replica
        return None

    def _start_failed(self, provider: _Provider, replica: Replica, lease: int, exc: ResidentPoolError) -> None:
        with self.cv:
            self.leases.pop(lease, None)
            replica.lease = None
            provider.replicas.pop(replica.worker.replica, None)
            breaker = provider.breaker
            breaker.failures += 1
            breaker.error = exc.to_dict()
            breaker.fingerprint = provider.fingerprint
            if exc.exit_code in REFUSAL_CODES or breaker.failures >= BREAKER_FAILURES:
                breaker.open_until = time.monotonic() + self.breaker_cooldown_s
                log.warning("%s: breaker open for %g s after: %s", provider.manifest.slug,
                            self.breaker_cooldown_s, exc)
            self._wake(provider)

    def _breaker_error(self, slug: str, breaker: Breaker) -> ResidentPoolError:
        original = error_from_dict(breaker.error or {"type": "WorkerStartError", "error": "start failed"})
        left = max(0.0, breaker.open_until - time.monotonic())
        original.message = (
            f"{original.message}\n  (not started again: {slug} failed {breaker.failures} start(s); the breaker "
            f"stays open {left:.0f} s more or until its manifest changes)"
        )
        original.args = (original.message,)
        original.details["breaker"] = {"failures": breaker.failures, "open_s": round(left, 1)}
        return original

    def release(self, lease: int, outcome: str, message: dict[str, Any]) -> dict[str, Any] | None:
        """A lease ends; ``ok`` needs no answer (the client does not wait for one)."""
        with self.cv:
            held = self.leases.pop(lease, None)
            if held is None:
                return None if outcome == "ok" else {"ok": True}
            slug, index, _ = held
            provider = self.providers[slug]
            replica = provider.replicas.get(index)
        reply: dict[str, Any] | None = None if outcome == "ok" else {"ok": True}
        if replica is not None:
            worker = replica.worker
            if outcome == "broken":
                error = worker.broken_error(str(message.get("error", "the connection broke")))
                if error is not None:
                    reply = {"ok": True, "error": error.to_dict()}
            elif outcome == "exiting":
                reply = {"ok": True, "error": worker.reply_error(message.get("reply") or {}).to_dict()}
            elif outcome == "timeout":
                worker.broken_error("the request outran its request_timeout_s")
            worker.served += int(message.get("served", 0))
            worker.last_used = time.monotonic()
        with self.cv:
            if replica is not None:
                replica.lease = None
            self._wake(provider)
        return reply

    def _release_connection(self, connection: int) -> None:
        with self.cv:
            mine = [lease for lease, (_, _, conn) in self.leases.items() if conn == connection]
        for lease in mine:
            self.release(lease, "ok", {})

    # -- eviction and waiting -------------------------------------------------
    def _evict_idle(self, needed_gb: float) -> bool:
        """Stop the least recently used idle GPU worker; True if one was stopped."""
        with self.cv:
            idle = [(replica.worker.last_used, provider, replica)
                    for provider in self.providers.values() for replica in provider.replicas.values()
                    if replica.free and replica.worker.is_running() and replica.worker.vram_budget_gb]
            if not idle:
                return False
            _, provider, replica = min(idle, key=lambda item: item[0])
            replica.retiring = True
        replica.worker._note(f"evicted (idle) to make room for a worker needing {needed_gb:g} GB")
        self._retire(provider, replica)
        return True

    def _client_gone(self) -> bool:
        """Whether the client this thread serves closed its connection (a killed flow run)."""
        conn = getattr(self._current, "conn", None)
        if conn is None:
            return False
        readable, _, _ = select.select([conn], [], [], 0)
        if not readable:
            return False
        try:
            return conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except BlockingIOError:
            return False
        except OSError:
            return True

    def _log_wait(self, wait: dict[str, Any]) -> None:
        """Admission is waiting: say so in the pool's log and to the client that asked."""
        log.info("%s waits for %g GB (%.0f s so far); free %s; held by %s", wait["slug"], wait["needs_gb"],
                 wait["waited_s"], wait["free"], "; ".join(wait["holders"]) or "nobody in the pool")
        conn = getattr(self._current, "conn", None)
        if conn is not None:
            try:
                send_line(conn, {"progress": {"waiting_for_admission": wait}})
            except OSError:
                pass  # the client is gone; its connection's cleanup releases what it held

    def waiting(self) -> list[dict[str, Any]]:
        queued = self.admission.waiting()
        with self.cv:
            for slug, provider in self.providers.items():
                if len(provider.queue) > 0 and not provider.breaker.open_until:
                    queued.append({"slug": slug, "for": "a free replica", "count": len(provider.queue)})
        return queued

    # -- status and stop --------------------------------------------------------
    def status(self) -> dict[str, Any]:
        workers = []
        breakers = {}
        with self.cv:
            for slug, provider in sorted(self.providers.items()):
                for index, replica in sorted(provider.replicas.items()):
                    worker = replica.worker
                    state = "busy" if replica.lease else worker.state.value
                    workers.append({
                        "slug": slug, "replica": index, "pid": worker.pid if worker.is_running() else None,
                        "state": state, "device": worker.device, "budget_gb": worker.vram_budget_gb,
                        "served": worker.served, "starts": worker.starts,
                        "idle_s": round(worker.idle_s(), 1), "uptime_s": _round(worker.uptime_s()),
                        "transcript": str(worker.transcript) if worker.transcript else None,
                    })
                b = provider.breaker
                if b.failures or b.open_until:
                    breakers[slug] = {"failures": b.failures, "open": time.monotonic() < b.open_until,
                                      "open_s": round(max(0.0, b.open_until - time.monotonic()), 1),
                                      "refused": b.refused, "error": (b.error or {}).get("error")}
        return {"pool": {"pid": os.getpid(), "socket": self.socket_path, "manifests": str(self.manifests),
                         "since": self.started, "ledger": str(self.ledger.path)},
                "workers": workers, "waiting": self.waiting(), "breakers": breakers,
                "ledger": self.ledger.entries()}

    def stop(self, slug: str | None) -> list[str]:
        """Stop every replica of ``slug`` (all providers when None); returns what was stopped."""
        with self.cv:
            targets = [(provider, replica) for name, provider in self.providers.items()
                       if slug in (None, name) for replica in provider.replicas.values()]
            for _, replica in targets:
                replica.retiring = True
            if slug is not None and slug in self.providers:
                self.providers[slug].breaker.reset()
        stopped = []
        for provider, replica in targets:
            self._retire(provider, replica)
            stopped.append(f"{replica.worker.slug}[{replica.worker.replica}]")
        return stopped

    def stop_all(self) -> None:
        self.stop(None)


def _round(value: float | None) -> float | None:
    return round(value, 1) if value is not None else None

