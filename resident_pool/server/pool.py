"""The host pool: one long-lived process per host and user that owns the workers.

Clients lease a worker over the pool's socket and then talk to the worker's socket
directly; the pool never copies a payload. The pool alone decides each worker's life:
it starts replicas, moves them through their state table (``states.REPLICA_EDGES``),
pings idle ones, retires them when idle, drains old versions and abandoned requests,
and stops them. Slow work on a process (a start, a stop, a ping) runs outside the lock
while the replica's state keeps everyone else away from it.
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
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..admission import Admission, Ledger, read_devices
from ..errors import (
    AdmissionTimeout,
    ManifestError,
    PoolStopping,
    ResidentPoolError,
    WorkerStartError,
    error_from_dict,
)
from ..exits import REFUSAL_CODES, describe_exit
from ..host import paths
from ..protocol import ProtocolError, bind_unix, recv_line, send_line
from ..providers.hibernate import CheckpointError, CudaCheckpoint, Hibernator
from ..providers.jit_cache import JitSizes
from ..providers.kit import jit_root, stray_variables
from ..providers.launch import command_builder
from ..providers.manifest import SLUG, Manifest, load_manifest
from ..providers.worker_process import DEATH_WAIT_S, HEARTBEAT_INTERVAL_S, Launch, WorkerProcess
from ..providers.zygote import Zygotes
from ..settings import settings
from ..version import __version__
from .breaker import Breaker
from .observing import STATS_TIMEOUT_S, PoolObserving
from .replica import Lease, Replica
from .states import ReplicaState

__all__ = ["CONTROL_LINE_BYTES", "PoolServer"]

log = logging.getLogger("resident_pool.pool")

# Control messages are small; a payload never passes through the pool.
CONTROL_LINE_BYTES = 1024 * 1024
_TICK_S = 0.25
# A worker between requests answers a ping at once; one that does not within this is computing.
ABANDON_PROBE_S = 1.0
LIVENESS_TIMEOUT_S = 10.0
RELEASE_OUTCOMES = ("ok", "broken", "exiting", "timeout", "abandoned")
# Start failures that say nothing about the provider (its client left, the card was full, the start was
# called off): they never count toward its breaker, or a busy card would fail every task of a campaign
# for the cooldown.
_NOT_THE_PROVIDERS_FAULT = frozenset({"client_gone", "no_room", "admission_timeout", "start_cancelled",
                                      "pool_stopping"})
_HOLDER_KEYS, _HOLDER_CHARS = 8, 300
# How often a client waiting on a long op hears from the pool; it gives up after a minute of silence.
KEEPALIVE_S = 10.0
_LONG_OPS = ("acquire", "stop")
# How often the pool tops every provider up to its min_replicas.
KEEP_WARM_S = 5.0


class _Connection:
    """One client connection; leases are bound to it, and end with it."""

    _ids = itertools.count(1)

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.id = next(self._ids)
        self._send_lock = threading.Lock()  # a reply, a progress line and a keepalive never interleave

    def send(self, message: dict[str, Any]) -> None:
        with self._send_lock:
            send_line(self.sock, message)


class _LongOp:
    """One long op in progress on a connection: when it began, when it last told its client so."""

    def __init__(self, connection: _Connection) -> None:
        self.connection = connection
        self.started = self.beaten = time.monotonic()
        self.active = True  # cleared under the connection's send lock: no keepalive follows the reply


class _Keepalives:
    """While long ops run (a cold start, an admission wait, a drain), tell each client every few seconds that
    the pool lives. One thread for all of them: a thread per op cost every warm acquire a start and a join,
    a third of a warm ``Pool.predict``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ops: set[_LongOp] = set()
        self._thread: threading.Thread | None = None

    @contextmanager
    def during(self, connection: _Connection) -> Iterator[None]:
        op = _LongOp(connection)
        with self._lock:
            self._ops.add(op)
            if self._thread is None:
                self._thread = threading.Thread(target=self._beat, name="keepalive", daemon=True)
                self._thread.start()
        try:
            yield
        finally:
            with connection._send_lock:
                op.active = False
            with self._lock:
                self._ops.discard(op)

    def _beat(self) -> None:
        while True:
            time.sleep(KEEPALIVE_S / 10)
            now = time.monotonic()
            with self._lock:
                due = [op for op in self._ops if now - op.beaten >= KEEPALIVE_S]
            for op in due:
                op.beaten = now
                try:
                    self._tell(op, now)
                except Exception:  # this thread beats for every client: one client's trouble never ends it
                    log.exception("keepalive to connection %s failed", op.connection.id)

    @staticmethod
    def _tell(op: _LongOp, now: float) -> None:
        with op.connection._send_lock:
            if not op.active:
                return
            sock = op.connection.sock
            # A client that does not read (stopped, at a debugger) gets no keepalive: a blocking send
            # would hold this thread, and every other client's keepalive, until it reads again.
            if not select.select([], [sock], [], 0)[1]:
                return
            try:
                send_line(sock, {"progress": {"alive_s": round(now - op.started)}})
            except OSError:
                pass  # the client is gone; its op notices on its own


class _CpuOnly:
    """Admission for a "recommended" GPU provider on a host with no GPU: run it on the CPU."""

    def admit(self, worker, wait: bool = True) -> dict[str, str]:
        return {"CUDA_VISIBLE_DEVICES": ""}

    def release(self, worker) -> None:
        pass


@dataclass
class _Provider:
    slug: str
    manifest: Manifest
    stamp: tuple[int, ...]
    version: str
    fingerprint: str
    source: Path
    breaker: Breaker
    replicas: dict[int, Replica] = field(default_factory=dict)
    queue: list[int] = field(default_factory=list)  # tickets waiting for a replica, in arrival order
    waiters: dict[int, threading.Condition] = field(default_factory=dict)
    waiting: dict[int, dict[str, str]] = field(default_factory=dict)  # who each ticket is for (a flow run)
    starts: int = 0
    last_error: str | None = None
    strip_kit: str | None = None  # a stock variant without its kit: that kit's package, whose variables go
    variant: dict[str, Any] | None = None  # how a variant (slug~name) is built; None for the provider as declared


class PoolServer(PoolObserving):
    def __init__(self, manifests: Path, quiet_exit_s: float | None = None) -> None:
        config = settings()
        self.manifests = manifests.resolve()
        self.state_dir = paths.state_dir()
        self.socket_path = paths.pool_socket(self.state_dir)
        self.quiet_exit_s = config.quiet_exit_s if quiet_exit_s is None else quiet_exit_s
        self.breaker_cooldown_s = config.breaker_cooldown_s
        self.drain_grace_s = config.drain_grace_s
        self.max_connections = config.max_connections
        self.ledger = Ledger(self.state_dir / "ledger.json", audit=config.ledger_audit)
        self.admission = Admission(self.ledger, evict=self._evict_idle, on_wait=self._report_wait,
                                   cancelled=self._client_gone, headroom_gb=config.gpu_headroom_gb,
                                   holder_of=self._holder_of)
        self.providers: dict[str, _Provider] = {}
        self.leases: dict[int, Lease] = {}
        self.zygotes = Zygotes()  # fork servers, one per provider environment that declares a preload
        self.hibernator = Hibernator(CudaCheckpoint(config.libcuda))  # for [lifecycle] evict = "hibernate"
        self.jit_sizes = JitSizes()
        # One lock for every record; each waiting acquire has its own condition on it, so a
        # release wakes the first in line alone (waking every waiter cost 64 thread switches
        # per release under load). ``changed`` wakes whoever waits for replicas to stop.
        self.lock = threading.RLock()
        self.changed = threading.Condition(self.lock)
        self.connections = 0
        self.keepalives = _Keepalives()
        self.quiet_since = time.monotonic()
        self.started = time.time()
        self.draining = False
        self.finished = threading.Event()
        self._signal: int | None = None
        self._tickets = itertools.count(1)
        self._last_beat = 0.0
        self._current = threading.local()  # the connection an op's thread serves: admission reports to it
        self._observe_init(config)
        self._warming: set[str] = set()  # providers being topped up to min_replicas
        self._last_keep_warm = 0.0
        self._kept_warm_loaded = False

    # -- serving -------------------------------------------------------------
    def serve_forever(self) -> None:
        listener = bind_unix(self.socket_path)
        self.socket_inode = os.stat(self.socket_path).st_ino
        listener.settimeout(_TICK_S)
        (self.state_dir / "pool.pid").write_text(str(os.getpid()))
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(signum, self._record_signal)
        log.info("pool %d (resident-pool %s) serving %s (manifests %s)", os.getpid(), __version__,
                 self.socket_path, self.manifests)
        threading.Thread(target=self._maintain_loop, name="maintain", daemon=True).start()
        self._observe_start()
        backoff = 0.0
        try:
            while not self.finished.is_set():
                self._accept_tick = time.monotonic()  # the watchdog's sign that this loop turns
                if self._signal is not None:
                    self.begin_stop(f"signal {signal.Signals(self._signal).name}")
                try:
                    conn, _ = listener.accept()
                except TimeoutError:
                    continue
                except OSError as exc:
                    # Out of descriptors (EMFILE) or buffers: wait for some connections to close;
                    # one flood must not take down the pool and every warm worker with it.
                    backoff = min(max(backoff * 2, 0.05), 1.0)
                    log.warning("accept failed (%s); backing off %.2f s", exc, backoff)
                    time.sleep(backoff)
                    continue
                backoff = 0.0
                self._spawn_client_thread(conn)
        finally:
            self._observe_stop()
            listener.close()
            if self._socket_is_ours():
                try:
                    os.unlink(self.socket_path)
                except FileNotFoundError:
                    pass
            log.info("pool %d stopped", os.getpid())

    def _spawn_client_thread(self, conn: socket.socket) -> None:
        with self.lock:
            full = self.connections >= self.max_connections
            if not full:
                self.connections += 1
        if full:
            # One thread and a buffer each: a flood of connections must not take the pool's memory.
            error = ResidentPoolError(
                f"the pool serves at most {self.max_connections} connections at once "
                "(RESIDENT_POOL_MAX_CONNECTIONS); close idle clients, or raise the setting",
                reason="too_many_connections")
            try:
                conn.settimeout(1.0)
                send_line(conn, {"ok": False, "reason": error.reason, "error": error.to_dict()})
            except OSError:
                pass  # it did not wait to hear why
            conn.close()
            return
        try:
            threading.Thread(target=self._serve_client, args=(conn,), daemon=True).start()
        except RuntimeError as exc:  # no thread to be had: refuse this one connection, keep serving
            log.warning("cannot serve a new connection (%s); closing it", exc)
            conn.close()
            with self.lock:
                self.connections -= 1

    def _record_signal(self, signum, frame) -> None:
        self._signal = signum  # only record it: the accept loop acts within a tick

    def begin_stop(self, why: str, now: bool = False) -> None:
        """Stop taking leases, let leased requests finish (up to drain_grace_s), stop every worker, exit."""
        with self.lock:
            if self.draining:
                return
            self.draining = True
            for provider in self.providers.values():
                for waiter in provider.waiters.values():
                    waiter.notify()
        log.info("stopping (%s): draining %d lease(s), up to %g s", why, len(self.leases), self.drain_grace_s)

        def stop_everything() -> None:
            try:
                self.stop(None, now=now, why=f"the pool is stopping ({why})")
                self.zygotes.stop_all()
            finally:
                self.finished.set()

        threading.Thread(target=stop_everything, name="drain", daemon=True).start()

    def _socket_is_ours(self) -> bool:
        try:
            return os.stat(self.socket_path).st_ino == self.socket_inode
        except FileNotFoundError:
            return False

    def _serve_client(self, sock: socket.socket) -> None:
        connection = _Connection(sock)
        buf = bytearray()
        self._current.connection = connection
        try:
            while True:
                try:
                    message = recv_line(sock, buf, CONTROL_LINE_BYTES)
                except ProtocolError as exc:
                    connection.send({"ok": False, "reason": "bad_request", "error": {
                        "type": "ResidentPoolError", "reason": "bad_request", "error": f"bad request line: {exc}"}})
                    if exc.recoverable:
                        continue
                    return
                if message is None:
                    return
                if message.get("op") in _LONG_OPS:
                    with self.keepalives.during(connection):
                        reply = self._dispatch(message, connection)
                else:
                    reply = self._dispatch(message, connection)
                if reply is not None:
                    connection.send(reply)
        except OSError:
            pass  # the client went away mid-reply; its leases end below
        finally:
            self._current.connection = None
            sock.close()
            self._connection_closed(connection)
            with self.lock:
                self.connections -= 1

    def _dispatch(self, message: dict[str, Any], connection: _Connection) -> dict[str, Any] | None:
        """Run one op; every op gets a reply (but a plain release), whatever goes wrong inside it."""
        op = message.get("op")
        handler: Callable[[dict[str, Any], _Connection], dict[str, Any] | None] | None = {
            "hello": self._op_hello, "acquire": self._op_acquire, "release": self._op_release,
            "status": lambda m, c: {"ok": True, **self.status()},
            "waiting": lambda m, c: {"ok": True, "waiting": self.waiting()},
            "stop": self._op_stop, "shutdown": self._op_shutdown,
            "warm": self._op_warm, "metrics": lambda m, c: {"ok": True, "text": self.metrics.render()},
        }.get(op) if isinstance(op, str) else None
        if handler is None:
            error = ResidentPoolError(f"unknown pool op {op!r}", reason="unknown_op")
            return {"ok": False, "reason": error.reason, "error": error.to_dict()}
        try:
            return handler(message, connection)
        except ResidentPoolError as exc:
            return {"ok": False, "reason": exc.reason, "error": exc.to_dict()}
        except Exception as exc:
            log.exception("pool op %s failed", op)
            error = ResidentPoolError(
                f"the pool could not {op}: {type(exc).__name__}: {exc}; the pool's log "
                f"({paths.log_dir() / 'pool.log'}) has the traceback", reason="pool_error")
            return {"ok": False, "reason": error.reason, "error": error.to_dict()}

    # -- ops ---------------------------------------------------------------------
    def _op_hello(self, message: dict[str, Any], connection: _Connection) -> dict[str, Any]:
        with self.lock:
            busy = bool(self.leases) or any(r.state is not ReplicaState.READY for p in self.providers.values()
                                            for r in p.replicas.values())
        return {"ok": True, "pid": os.getpid(), "version": __version__, "manifests": str(self.manifests),
                "idle": not busy, "draining": self.draining}

    def _op_acquire(self, message: dict[str, Any], connection: _Connection) -> dict[str, Any]:
        slug = message.get("slug")
        if not isinstance(slug, str) or not SLUG.fullmatch(slug):
            raise ResidentPoolError(f"provider name {slug!r} is not a slug: lowercase letters, digits, '-' "
                                    "or '_', at most 40 characters", reason="bad_request")
        manifests = message.get("manifests")
        if manifests is not None and not isinstance(manifests, str):
            raise ResidentPoolError("manifests must be a folder path", reason="bad_request")
        return {"ok": True, **self.acquire(slug, manifests, connection, _holder(message.get("holder")),
                                           _variant(message.get("variant")))}

    def _op_release(self, message: dict[str, Any], connection: _Connection) -> dict[str, Any] | None:
        lease_id, outcome, served = message.get("lease"), message.get("outcome", "ok"), message.get("served", 0)
        # Everything is checked before anything changes.
        if not isinstance(lease_id, int) or isinstance(lease_id, bool):
            raise ResidentPoolError(f"release needs an integer lease, not {lease_id!r}", reason="bad_request")
        if outcome not in RELEASE_OUTCOMES:
            raise ResidentPoolError(f"release outcome {outcome!r} is not one of {', '.join(RELEASE_OUTCOMES)}",
                                    reason="bad_request")
        if not isinstance(served, int) or isinstance(served, bool) or served < 0:
            raise ResidentPoolError(f"release needs served as a count, not {served!r}", reason="bad_request")
        reply = message.get("reply")
        if reply is not None and not isinstance(reply, dict):
            raise ResidentPoolError("release reply must be the worker's reply object", reason="bad_request")
        return self.release(lease_id, connection, outcome, served, reply or {})

    def _op_stop(self, message: dict[str, Any], connection: _Connection) -> dict[str, Any]:
        slug = message.get("slug")
        if slug is not None and not isinstance(slug, str):
            raise ResidentPoolError("stop takes a provider slug, or none for all", reason="bad_request")
        return {"ok": True, "stopped": self.stop(slug, now=bool(message.get("now")))}

    def _op_shutdown(self, message: dict[str, Any], connection: _Connection) -> dict[str, Any]:
        self.begin_stop("a client asked it to shut down")
        return {"ok": True, "pid": os.getpid()}

    # -- manifests -------------------------------------------------------------
    def _provider(self, slug: str, manifests: str | None, variant: dict[str, Any] | None = None) -> _Provider:
        """The provider as its manifest is now; a changed version drains the old replicas.

        A variant (``slug~stock``: its kit off, or without its kit) is a provider of its own,
        so running it never counts as a new version of the production one.
        """
        key = f"{slug}~{variant['name']}" if variant else slug
        # Clients send absolute folders; resolving symlinks on every acquire costs a stat per component.
        path = (Path(manifests) if manifests else self.manifests) / slug / "manifest.toml"
        try:
            info = path.stat()
        except FileNotFoundError:
            raise ManifestError(
                f"{slug}: no provider of that name: {path} does not exist; check the slug or pass --manifests",
                slug=slug) from None
        stamp: tuple[int, ...] = (info.st_ino, info.st_mtime_ns, info.st_size)
        with self.lock:
            provider = self.providers.get(key)
            if provider is not None and provider.source != path and any(r.live for r in provider.replicas.values()):
                raise ManifestError(
                    f"{slug}: this pool already serves {slug} from {provider.source}, not {path}; stop it first "
                    f"(`resident-pool stop {slug}`)", slug=slug)
            if provider is not None and provider.source == path and provider.stamp[:3] == stamp \
                    and provider.variant == variant:
                script = _stamp(provider.manifest.worker_path)
                if provider.stamp[3:] == script:
                    return provider
        declared = load_manifest(path)
        manifest = declared.variant(variant["kit_mode"], variant["without_kit"]) if variant else declared
        version = manifest.version()
        stamp += _stamp(manifest.worker_path)
        with self.lock:
            provider = self.providers.get(key)
            strip = declared.kit.package_name if variant and variant["without_kit"] and declared.kit else None
            if provider is None:
                provider = self.providers[key] = _Provider(
                    key, manifest, stamp, version, manifest.fingerprint(), path, Breaker(self.breaker_cooldown_s),
                    variant=variant, strip_kit=strip)
                return provider
            provider.manifest, provider.stamp, provider.source, provider.variant = manifest, stamp, path, variant
            provider.strip_kit = strip
            provider.fingerprint = manifest.fingerprint()
            if version != provider.version:
                log.info("%s: manifest version %s -> %s; draining the old replicas", slug, provider.version, version)
                provider.version = version
                for replica in list(provider.replicas.values()):
                    if replica.version != version:
                        self._retire(provider, replica, f"its manifest changed (version {version} replaces "
                                                        f"{replica.version})")
            return provider

    def _admitter(self, manifest: Manifest):
        if manifest.gpu.policy == "none":
            return None
        if manifest.gpu.policy == "recommended" and not read_devices()[0]:
            return _CpuOnly()
        return self.admission

    # -- leases ---------------------------------------------------------------
    def acquire(self, slug: str, manifests: str | None, connection: _Connection,
                holder: dict[str, str] | None = None, variant: dict[str, Any] | None = None) -> dict[str, Any]:
        """Lease a ready replica of ``slug``, starting one if the provider may have another."""
        if self.draining:
            raise self._stopping_error()
        provider = self._provider(slug, manifests, variant)
        ticket = next(self._tickets)
        with self.lock:
            if provider.breaker.is_open(provider.fingerprint):
                raise self._breaker_error(provider)
            provider.queue.append(ticket)
            provider.waiters[ticket] = waiter = threading.Condition(self.lock)
            provider.waiting[ticket] = holder or {}
            arrived = time.monotonic()
            try:
                while True:
                    if self.draining:
                        raise self._stopping_error()
                    claimed = self._claim(provider, ticket)
                    if claimed is not None:
                        break
                    if self._client_gone():  # its place in the queue must not hold up the rest
                        raise ResidentPoolError(f"{slug}: the client waiting for a replica went away",
                                                slug=slug, reason="client_gone")
                    waited = time.monotonic() - arrived
                    if waited >= provider.manifest.lifecycle.admission_timeout_s:
                        raise self._replica_timeout(provider, waited)
                    waiter.wait(_TICK_S)
            finally:
                provider.queue.remove(ticket)
                del provider.waiters[ticket]
                del provider.waiting[ticket]
                self._wake(provider)
            replica, cold = claimed
            lease = Lease(connection, replica, holder or {})
            replica.lease = lease
            self.leases[lease.id] = lease
        if cold:
            self._start(provider, replica, lease)
        return {
            "lease": lease.id, "slug": provider.slug, "replica": replica.index, "pid": replica.pid,
            "socket": replica.process.socket_path, "cold": cold, "transcript": replica.process.transcript_path,
            "request_timeout_s": provider.manifest.lifecycle.request_timeout_s, "device": replica.process.device,
            "version": replica.version,
            "kit": replica.process.launch.kit if replica.process.launch is not None else None,
        }

    def _claim(self, provider: _Provider, ticket: int) -> tuple[Replica, bool] | None:
        """The replica this ticket takes now and whether it must be started, or None to keep waiting."""
        if provider.queue[0] != ticket:
            return None  # first come, first served
        current = [r for r in provider.replicas.values() if r.version == provider.version and r.retire is None]
        for replica in sorted(current, key=lambda r: r.index):
            if replica.state is ReplicaState.READY:
                replica.transition(ReplicaState.LEASED, "leased")
                return replica, False
        for replica in sorted(current, key=lambda r: r.index):
            if replica.state is ReplicaState.HIBERNATED:  # a restore costs a copy back, not a start
                replica.transition(ReplicaState.STARTING, "its lease restores it from hibernation")
                return replica, True
        if sum(r.live for r in current) >= provider.manifest.lifecycle.max_replicas:
            return None
        now = time.monotonic()
        if any(r.state is ReplicaState.LEASED and r.lease is not None and r.lease.connection is None
               and now - r.lease.since < LIVENESS_TIMEOUT_S + STATS_TIMEOUT_S + 5.0 for r in current):
            return None  # the pool's own liveness ping, a moment long: its end wakes this ticket
        return self._new_replica(provider), True

    def _new_replica(self, provider: _Provider) -> Replica:
        """A STARTING replica of the provider's current version under the lowest free number (the lock is held)."""
        manifest = provider.manifest
        index = next(i for i in itertools.count() if i not in provider.replicas)
        process = self._new_process(provider.slug, index, manifest)
        budget = manifest.gpu.vram_budget_gb if manifest.gpu.policy != "none" else None
        replica = Replica(provider.slug, index, provider.version, process, budget, manifest)
        provider.replicas[index] = replica
        return replica

    def _new_process(self, slug: str, index: int, manifest: Manifest) -> WorkerProcess:
        return WorkerProcess(slug, index, state_dir=self.state_dir, start_timeout_s=manifest.lifecycle.start_timeout_s)

    def _start(self, provider: _Provider, replica: Replica, lease: Lease, wait: bool = True) -> None:
        """Admit, then restore (a hibernated replica) or spawn (or fork) and wait for it; a failure ends both.

        ``wait=False``: admitted only if its budget fits now (a warm-up of the pool's own).
        """
        manifest = replica.manifest
        admitter = self._admitter(manifest)
        with self.lock:
            if replica.hibernation is None:
                provider.starts += 1
        self._current.starting = replica  # admission's wait ends too when this start is called off
        try:
            env: dict[str, str | None] = {}
            if replica.vram_budget_gb and admitter is not None:
                asked = time.monotonic()
                try:
                    env = dict(self._admit(admitter, replica, wait))
                finally:
                    self._on_admission(provider, admitter, time.monotonic() - asked)
                replica.admitter = admitter
            if replica.abort:
                raise WorkerStartError(f"{provider.slug}: the start was called off: {replica.abort}",
                                       slug=provider.slug, reason="start_cancelled")

            def spawned(pid: int) -> None:
                if replica.admitter is self.admission:
                    self.admission.started(replica)  # the ledger names the loading worker from now on

            began = time.monotonic()
            if self._restored(provider, replica):
                spawned(replica.process.pid)
            else:
                replica.process.device = env.get("CUDA_VISIBLE_DEVICES")
                launch = Launch.of(command_builder(manifest)(replica.process))
                if provider.strip_kit:  # stock without the kit: none of its variables, even under passthrough "*"
                    launch = replace(launch, env={**launch.env,
                                                  **stray_variables(provider.strip_kit, os.environ, set())})
                replica.process.start(launch, env, spawner=self.zygotes.spawner(manifest, launch), on_spawn=spawned,
                                      cancelled=lambda: replica.abort)
        except Exception as exc:
            raise self._start_failed(provider, replica, lease, exc) from exc
        finally:
            self._current.starting = None
        with self.lock:
            provider.breaker.succeeded()
            replica.last_checked = time.monotonic()
            replica.transition(ReplicaState.LEASED, "started")
        self._on_started(provider, replica, time.monotonic() - began)

    def _admit(self, admitter, replica: Replica, wait: bool):
        if replica.hibernation is not None:  # its memory goes back to the device it left
            return admitter.admit(replica, device=int(replica.hibernation.device), wait=wait)
        return admitter.admit(replica, wait=wait)

    def _restored(self, provider: _Provider, replica: Replica) -> bool:
        """Restore a hibernated replica (admitted already); False when it is to start afresh instead."""
        if replica.hibernation is None:
            return False
        replica.hibernation = None
        try:
            self.hibernator.restore(replica.process)
            if replica.process.ping(timeout=LIVENESS_TIMEOUT_S) is None:
                raise CheckpointError(f"it did not answer a ping within {LIVENESS_TIMEOUT_S:g} s of its restore")
        except CheckpointError as exc:
            why = f"{replica.name}: its restore from hibernation failed ({exc}); stopped, and a fresh worker started"
            replica.process.note(why)
            self.hibernator.noted(provider.slug, why)
            replica.process.kill(grace_s=5.0)
            with self.lock:
                replica.last_error = provider.last_error = why
                provider.starts += 1
            replica.process = self._new_process(provider.slug, replica.index, replica.manifest)
            return False
        self.hibernator.noted(provider.slug, f"{replica.name} restored from hibernation")
        return True

    def _start_failed(self, provider: _Provider, replica: Replica, lease: Lease, exc: Exception) -> ResidentPoolError:
        if replica.abort and self.draining:
            error: ResidentPoolError = self._stopping_error()  # the client retries with the next pool
        elif replica.abort:
            error = WorkerStartError(f"{provider.slug}: the start was called off: {replica.abort}",
                                     slug=provider.slug, reason="start_cancelled",
                                     transcript=replica.process.transcript_path)
        elif isinstance(exc, ResidentPoolError):
            error = exc
        else:
            headline = f"{provider.slug}: could not start a worker: {type(exc).__name__}: {exc}"
            error = WorkerStartError(headline, slug=provider.slug, transcript=replica.process.transcript_path)
        if replica.process.proc is not None and replica.process.returncode is None:
            replica.process.kill(grace_s=5.0)
        self._release_budget(replica)
        with self.lock:
            self.leases.pop(lease.id, None)
            replica.lease = None
            replica.transition(ReplicaState.FAILED, error.headline)
            replica.last_error = provider.last_error = error.headline
            if provider.replicas.get(replica.index) is replica:
                del provider.replicas[replica.index]
            opened = error.reason not in _NOT_THE_PROVIDERS_FAULT and provider.breaker.failed(
                provider.fingerprint, error.to_dict(), refusal=error.exit_code in REFUSAL_CODES)
            if opened:
                log.warning("%s: breaker open for %g s after: %s", provider.slug, self.breaker_cooldown_s,
                            error.headline)
                error.details["breaker_opened"] = True  # the Prefect helpers say so in an event
            self._wake(provider)
            self.changed.notify_all()
        self._on_start_failed(provider, replica, error, opened)
        return error

    def _wake(self, provider: _Provider) -> None:
        """A replica may be free: the first request in line looks (the lock is held)."""
        if provider.queue:
            provider.waiters[provider.queue[0]].notify()

    def _breaker_error(self, provider: _Provider) -> ResidentPoolError:
        breaker = provider.breaker
        original = error_from_dict(breaker.error or {"type": "WorkerStartError", "error": "start failed"})
        left = breaker.remaining_s()
        note = (f"\n  (not started again: {provider.slug} failed {breaker.failures} start(s); the breaker stays "
                f"open {left:.0f} s more or until its manifest changes)")
        original.message += note
        original.args = (original.message,)
        original.details["breaker"] = {"failures": breaker.failures, "open_s": round(left, 1)}
        return original

    def _replica_timeout(self, provider: _Provider, waited: float) -> AdmissionTimeout:
        lifecycle = provider.manifest.lifecycle
        held = [f"{r.name} {r.state}" + (f" for {', '.join(r.lease.holder.values())}" if r.lease and r.lease.holder
                                         else "") for r in provider.replicas.values()]
        return AdmissionTimeout(
            f"{provider.slug}: waited {waited:.0f} s (admission_timeout_s = {lifecycle.admission_timeout_s:g}) for "
            f"a free replica; max_replicas = {lifecycle.max_replicas}, held: {'; '.join(held) or 'none'}; raise "
            "max_replicas or admission_timeout_s, or stop a holder (`resident-pool stop "
            f"{provider.slug}`)", slug=provider.slug, details={"waited_s": round(waited, 1), "held": held})

    def _stopping_error(self) -> PoolStopping:
        return PoolStopping(f"the pool (pid {os.getpid()}) is stopping; the client retries with the next pool")

    def release(self, lease_id: int, connection: _Connection, outcome: str, served: int,
                reply: dict[str, Any]) -> dict[str, Any] | None:
        """A lease ends; an ``ok`` one needs no answer (the client does not wait for one)."""
        with self.lock:
            lease = self.leases.get(lease_id)
            if lease is None:
                return None if outcome == "ok" else {"ok": True}
            if lease.connection is not connection:
                raise ResidentPoolError(f"lease {lease_id} is not held by this connection; a client releases "
                                        "only its own leases", reason="bad_request")
            del self.leases[lease_id]
            replica: Replica = lease.replica
            provider = self.providers[replica.slug]
            replica.lease = None
            replica.served += served
            replica.last_used = time.monotonic()
            if outcome == "ok":
                self._free(provider, replica, "released")
                return None
        if outcome == "abandoned":  # interrupted mid-request (Ctrl-C, a cancelled task): drain what it left
            self._abandoned(provider, replica, "its client gave up on a request in flight")
            return None
        if outcome == "timeout":
            self.metrics.book.failed(replica.slug, replica.index, "timeout")
            timeout = provider.manifest.lifecycle.request_timeout_s
            self._stop(provider, replica, f"a request outran request_timeout_s = {timeout:g} s", now=True)
            return {"ok": True}
        if outcome == "exiting":
            self.metrics.book.failed(replica.slug, replica.index, "worker_exiting")
            error = replica.process.exiting_error(reply)
            self._forget(provider, replica, error.headline)
            return {"ok": True, "error": error.to_dict()}
        rc = replica.process.wait_dead(DEATH_WAIT_S)  # broken: died, or a live worker closed on it
        if rc is not None:
            stopped = replica.retire is not None  # the pool stopped it on purpose (stop --now), else it died
            error = replica.process.died_error(rc, stopping=stopped)
            self.metrics.book.failed(replica.slug, replica.index, error.reason)
            self._forget(provider, replica, error.headline)
            return {"ok": True, "error": error.to_dict()}
        self._abandoned(provider, replica, "its client's connection to it broke")
        return {"ok": True}

    def _free(self, provider: _Provider, replica: Replica, why: str) -> None:
        """A lease ended cleanly (the lock is held): ready again, or on its way out if it drains."""
        if replica.state is ReplicaState.LEASED and provider.manifest.mode == "subprocess" and replica.retire is None:
            # Never READY: a waiting request would take it before the maintenance loop retires it.
            replica.retire = 'mode = "subprocess": a worker serves one lease'
        if replica.state is ReplicaState.LEASED and replica.retire is None and replica.version == provider.version:
            replica.transition(ReplicaState.READY, why)
            self._wake(provider)
        elif replica.state in (ReplicaState.LEASED, ReplicaState.DRAINING):
            self._stop_later(provider, replica, replica.retire or "its manifest changed")

    def _connection_closed(self, connection: _Connection) -> None:
        """A client went away (a killed flow run): each lease it held is abandoned, not simply freed."""
        with self.lock:
            mine = [lease for lease in self.leases.values() if lease.connection is connection]
            for lease in mine:
                del self.leases[lease.id]
                lease.replica.lease = None
        for lease in mine:
            replica = lease.replica
            self._abandoned(self.providers[replica.slug], replica, "its client went away")

    def _abandoned(self, provider: _Provider, replica: Replica, why: str) -> None:
        """Its client is gone: free at once if it is between requests, else drain the request first."""
        with self.lock:
            if replica.state not in (ReplicaState.LEASED, ReplicaState.DRAINING):
                return  # already on its way out
            if replica.state is ReplicaState.LEASED:
                replica.transition(ReplicaState.DRAINING, f"{why}; waiting for any request in flight")
            grace = provider.manifest.lifecycle.abandon_grace_s
            replica.drain_deadline = time.monotonic() + grace
        threading.Thread(target=self._await_abandoned, args=(provider, replica, grace), daemon=True,
                         name=f"drain-{replica.name}").start()

    def _await_abandoned(self, provider: _Provider, replica: Replica, grace: float) -> None:
        # The worker answers serially: a ping queued behind a running request is answered
        # once that request ends, so its answer is the moment the worker is free.
        answer = replica.process.ping(timeout=min(ABANDON_PROBE_S, grace) or 0.1)
        if answer is None and grace > ABANDON_PROBE_S:
            replica.process.note(f"its client went away mid-request; the request may run up to abandon_grace_s "
                                 f"= {grace:g} s more, and its answer is thrown away")
            answer = replica.process.ping(timeout=max(0.1, replica.drain_deadline - time.monotonic()))
        with self.lock:
            if replica.state is not ReplicaState.DRAINING or replica.lease is not None:
                return  # someone else decided meanwhile (a stop --now)
            if answer is not None and replica.retire is None and replica.version == provider.version:
                replica.transition(ReplicaState.READY, "the abandoned request ended")
                replica.last_used = time.monotonic()
                self._wake(provider)
                return
            if answer is None:
                # Its socket closes a moment before it can be reaped: wait that moment, or a death reads as a hang.
                rc = replica.process.wait_dead(DEATH_WAIT_S)
                if rc is not None:
                    why = f"died while its abandoned request ran: {describe_exit(rc)}"
                else:
                    why = f"its abandoned request still ran after abandon_grace_s = {grace:g} s"
                replica.last_error = provider.last_error = f"{replica.name}: {why}; stopped"
            else:
                why = replica.retire or "its manifest changed"
        self._stop(provider, replica, why, now=answer is None)

    # -- stopping -----------------------------------------------------------------
    def _retire(self, provider: _Provider, replica: Replica, why: str, now: bool = False) -> None:
        """Mark ``replica`` to stop (the lock is held): at once if free, after its lease if held."""
        replica.retire = replica.retire or why
        if replica.state is ReplicaState.HIBERNATED:  # its CUDA is locked: it can only be ended, not asked
            self._stop_later(provider, replica, why, now=True)
        elif replica.state is ReplicaState.READY or (now and replica.state in (ReplicaState.LEASED,
                                                                                 ReplicaState.DRAINING)):
            self._stop_later(provider, replica, why, now=now)
        elif replica.state is ReplicaState.LEASED and replica.lease is not None and replica.lease.connection:
            replica.transition(ReplicaState.DRAINING, f"{why}; its lease finishes first")
        elif replica.state is ReplicaState.STARTING and now:
            replica.abort = why  # its start thread stops the worker and fails the start
        # STARTING: otherwise acted on when its lease ends; DRAINING: its drain ends in a stop;
        # HIBERNATING: once it is done.

    def _stop_later(self, provider: _Provider, replica: Replica, why: str, now: bool = False) -> None:
        """Move to STOPPING (the lock is held) and stop the process on a thread of its own."""
        replica.transition(ReplicaState.STOPPING, why)
        threading.Thread(target=self._stop_process, args=(provider, replica, why, now), daemon=True,
                         name=f"stop-{replica.name}").start()

    def _stop(self, provider: _Provider, replica: Replica, why: str, now: bool = False) -> None:
        """Stop ``replica`` in this thread (it is not STOPPING yet)."""
        with self.lock:
            if replica.state in (ReplicaState.STOPPING, ReplicaState.STOPPED):
                return
            replica.transition(ReplicaState.STOPPING, why)
        self._stop_process(provider, replica, why, now)

    def _stop_process(self, provider: _Provider, replica: Replica, why: str, now: bool = False) -> None:
        if not now:
            self._collect_stats(replica, timeout=1.0)  # its counts since the last collection, before they go
        rc = replica.process.kill(grace_s=5.0) if now else replica.process.stop()
        gone = "" if rc is not None else "; it did not end after SIGKILL"
        self._forget(provider, replica, f"{why}{gone}" if now or gone else None)

    def _forget(self, provider: _Provider, replica: Replica, error: str | None) -> None:
        """The worker is gone: give back its budget, record why, drop the replica."""
        self._release_budget(replica)
        with self.lock:
            if replica.state is ReplicaState.STOPPED:
                return  # the other party to a race (a broken release and a stop) got here first
            if replica.state is not ReplicaState.STOPPING:
                replica.transition(ReplicaState.STOPPING, error or "ended")
            replica.transition(ReplicaState.STOPPED, error or "stopped")
            if error:
                replica.last_error = provider.last_error = error
            if provider.replicas.get(replica.index) is replica:
                del provider.replicas[replica.index]
            self._wake(provider)
            self.changed.notify_all()
        self._on_stopped(provider, replica)

    def _release_budget(self, replica: Replica) -> None:
        admitter, replica.admitter = replica.admitter, None
        if admitter is not None:
            admitter.release(replica)

    # -- eviction and waiting -------------------------------------------------
    def _evict_idle(self, needed_gb: float) -> bool:
        """Stop the least recently used idle GPU worker; True if one was stopped.

        Workers kept warm (min_replicas) go after every other idle one, and only when giving back
        every idle kept-warm budget would let the request fit: never for nothing.
        """
        with self.lock:
            idle = [(self._kept_warm(provider, replica), replica.last_used, provider, replica)
                    for provider in self.providers.values() for replica in provider.replicas.values()
                    if replica.state is ReplicaState.READY and replica.admitter is self.admission]
            if not idle:
                return False
            kept, _, provider, replica = min(idle, key=lambda item: item[:2])
            freed = _budgets_by_device(item[3] for item in idle if item[0])
        if kept and not self.admission.fits_if_freed(needed_gb, freed):
            return False
        why = f"evicted (idle) to make room for a worker needing {needed_gb:g} GB"
        hibernate = provider.manifest.lifecycle.evict == "hibernate"
        with self.lock:
            if replica.state is not ReplicaState.READY:
                return True  # leased or stopped meanwhile: admission looks again
            # Moved on under the same lock that saw it READY: a client cannot lease it in between.
            replica.transition(ReplicaState.HIBERNATING if hibernate else ReplicaState.STOPPING, why)
        self.metrics.evictions.labels(provider.slug).inc()
        if hibernate and self._hibernate(provider, replica, why):
            return True
        if hibernate:
            with self.lock:
                replica.transition(ReplicaState.STOPPING, why)
        self._stop_process(provider, replica, why)
        return True

    def _hibernate(self, provider: _Provider, replica: Replica, why: str) -> bool:
        """Checkpoint a HIBERNATING replica's device memory and give its budget back; False: stop it instead."""
        try:
            hibernation = self.hibernator.hibernate(replica.process)
        except CheckpointError as exc:
            note = f"{replica.name} could not hibernate ({exc}); stopped instead"
            replica.process.note(note)
            self.hibernator.noted(provider.slug, note)
            return False
        self._release_budget(replica)
        with self.lock:
            replica.hibernation = hibernation
            replica.transition(ReplicaState.HIBERNATED, why)
            self.hibernator.noted(provider.slug, f"{replica.name} hibernated: {why}")
            if replica.retire:  # a stop was asked for meanwhile
                self._stop_later(provider, replica, replica.retire, now=True)
            else:
                self._wake(provider)
        return True

    def _client_gone(self) -> bool:
        """Whether the wait this thread is in should end: its client left (a killed flow run), or its start
        was called off (a stop, the pool stopping)."""
        starting = getattr(self._current, "starting", None)
        if starting is not None and starting.abort:
            return True
        connection = getattr(self._current, "connection", None)
        if connection is None:
            return False
        readable, _, _ = select.select([connection.sock], [], [], 0)
        if not readable:
            return False
        try:
            return connection.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except BlockingIOError:
            return False
        except OSError:
            return True

    def _report_wait(self, wait: dict[str, Any]) -> None:
        """Admission is waiting: say so in the pool's log and to the client that asked."""
        log.info("%s waits for %g GB (%.0f s so far); free %s; held by %s", wait["slug"], wait["needs_gb"],
                 wait["waited_s"], wait["free"], "; ".join(wait["holders"]) or "nobody in the pool")
        connection = getattr(self._current, "connection", None)
        if connection is not None:
            try:
                connection.send({"progress": {"waiting_for_admission": wait}})
            except OSError:
                pass  # the client is gone; its connection's cleanup ends what it held

    def _holder_of(self, slug: str, index: int) -> str | None:
        """Who holds (or waits to start) ``slug``'s replica ``index``: the flow run a client named, if any."""
        with self.lock:
            provider = self.providers.get(slug)
            replica = provider.replicas.get(index) if provider else None
            if replica is None or replica.lease is None or not replica.lease.holder:
                return None
            return _describe_holder(replica.lease.holder)

    def waiting(self) -> list[dict[str, Any]]:
        queued = self.admission.waiting()
        for entry in queued:
            entry["holder"] = self._holder_of(entry["slug"], entry["replica"])
        with self.lock:
            for slug, provider in self.providers.items():
                if provider.queue:
                    queued.append({"slug": slug, "for": "a free replica", "count": len(provider.queue),
                                   "holders": [_describe_holder(provider.waiting[t]) for t in provider.queue
                                               if provider.waiting.get(t)]})
        return queued

    # -- maintenance: heartbeats, idle retirement, liveness ----------------------------------
    def _maintain_loop(self) -> None:
        while not self.finished.is_set():
            try:
                self._maintain()
            except Exception:  # one bad pass must not end retirement for good; logged with its traceback
                log.exception("maintenance pass failed")
            self.finished.wait(_TICK_S)

    def _maintain(self) -> None:
        if not self._socket_is_ours():
            # The state directory was deleted or another pool took the socket: no client can
            # reach this pool, so its workers would only hold memory. Stand down.
            log.warning("socket %s is gone or no longer ours; stopping every worker and exiting", self.socket_path)
            self.begin_stop("its socket is gone", now=True)
            return
        now = time.monotonic()
        # A tick early rather than a tick late: passes land on _TICK_S steps, and a beat due at 2.0 s
        # but made at 2.2 s lets a worker told "stale after 2 s" think its pool is gone.
        beat = now - self._last_beat >= HEARTBEAT_INTERVAL_S - _TICK_S
        if beat:
            self._last_beat = now
        checks = []
        with self.lock:
            for provider in self.providers.values():
                lifecycle = provider.manifest.lifecycle
                for replica in list(provider.replicas.values()):
                    if beat:  # a worker still loading its model counts on it too
                        replica.process.beat()
                    if replica.state is ReplicaState.HIBERNATED:
                        self._keep_hibernated(provider, replica, checks)
                    if replica.state in (ReplicaState.LEASED, ReplicaState.DRAINING):
                        rc = replica.process.poll()
                        if rc is not None:  # the OOM killer, between two requests of a session
                            why = f"{replica.name} died while {replica.state}: {describe_exit(rc)}"
                            replica.transition(ReplicaState.STOPPING, why)
                            checks.append((self._forget, (provider, replica, why)))
                        continue
                    if replica.state is not ReplicaState.READY:
                        continue
                    rc = replica.process.poll()
                    if rc is not None:
                        why = f"{replica.name} exited while idle: {describe_exit(rc)}"
                        replica.transition(ReplicaState.STOPPING, why)
                        checks.append((self._forget, (provider, replica, why)))
                    elif (provider.manifest.mode == "subprocess" or (0 < lifecycle.idle_timeout_s <= replica.idle_s())
                          ) and not self._kept_warm(provider, replica):
                        self._stop_later(provider, replica, f"idle for {replica.idle_s():.1f} s (idle_timeout_s = "
                                                            f"{lifecycle.idle_timeout_s:g})")
                    elif now - replica.last_checked >= lifecycle.ping_interval_s:
                        replica.transition(ReplicaState.LEASED, "liveness ping")
                        replica.lease = Lease(None, replica, {"pool": "liveness ping"})
                        checks.append((self._check_liveness, (provider, replica)))
            busy = self.connections or any(p.replicas for p in self.providers.values())
            if busy:
                self.quiet_since = now
        for action, args in checks:
            try:
                threading.Thread(target=action, args=args, daemon=True).start()
            except RuntimeError as exc:  # no thread to be had: run it here rather than leave a replica held
                log.warning("cannot start a thread for %s (%s); running it in the maintenance pass",
                            action.__name__, exc)
                action(*args)
        self._maintain_zygotes(now)
        if self.quiet_exit_s > 0 and now - self.quiet_since >= self.quiet_exit_s and not self.draining:
            log.info("no workers and no clients for %g s; exiting", self.quiet_exit_s)
            self.begin_stop("quiet")
        self._observe_tick(now)
        if now - self._last_keep_warm >= KEEP_WARM_S and not self.draining:
            self._last_keep_warm = now
            self._keep_warm()

    def _keep_hibernated(self, provider: _Provider, replica: Replica, checks: list) -> None:
        """Never pinged (its CUDA is locked: a ping that touched it would hang); still reaped, still retired
        when idle (the lock is held)."""
        rc = replica.process.poll()
        timeout = provider.manifest.lifecycle.idle_timeout_s
        if rc is not None:
            why = f"{replica.name} exited while hibernated: {describe_exit(rc)}"
            replica.transition(ReplicaState.STOPPING, why)
            checks.append((self._forget, (provider, replica, why)))
        elif 0 < timeout <= replica.idle_s():
            self._stop_later(provider, replica, f"hibernated and idle for {replica.idle_s():.1f} s "
                                                f"(idle_timeout_s = {timeout:g})", now=True)

    def _maintain_zygotes(self, now: float) -> None:
        """A zygote retires once no worker of its provider has been in use for the provider's idle timeout:
        with the last worker retired for idleness, but not with one admission evicted."""
        activity: dict[str, float] = {}
        with self.lock:
            timeouts = {slug: p.manifest.lifecycle.idle_timeout_s for slug, p in self.providers.items()}
            for slug, provider in self.providers.items():
                for replica in provider.replicas.values():
                    used = replica.last_used if replica.state is ReplicaState.READY else now
                    activity[slug] = max(activity.get(slug, 0.0), used)
        self.zygotes.maintain(activity, timeouts, now)

    def _check_liveness(self, provider: _Provider, replica: Replica) -> None:
        """Alive means running AND answering: an idle worker that does not answer is stopped."""
        answer = replica.process.ping(timeout=LIVENESS_TIMEOUT_S)
        if answer is not None:
            self._collect_stats(replica)  # still under the pool's own lease: the worker is idle
        with self.lock:
            replica.last_checked = time.monotonic()
            replica.lease = None
            if replica.state is not ReplicaState.LEASED:
                return  # stopped meanwhile
            if answer is not None:
                if replica.retire:
                    self._stop_later(provider, replica, replica.retire)
                else:
                    replica.transition(ReplicaState.READY, "answered its liveness ping")
                    self._wake(provider)
                return
        self._stop(provider, replica, f"{replica.name} did not answer a liveness ping within "
                                      f"{LIVENESS_TIMEOUT_S:g} s; stopped", now=True)

    # -- status and stop --------------------------------------------------------
    def status(self) -> dict[str, Any]:
        now = time.monotonic()
        workers, providers, breakers = [], {}, {}
        with self.lock:
            kit_providers = [(slug, p.manifest) for slug, p in self.providers.items() if p.manifest.kit is not None]
            for slug, provider in sorted(self.providers.items()):
                for index, replica in sorted(provider.replicas.items()):
                    process = replica.process
                    lease = replica.lease
                    workers.append({
                        "slug": slug, "replica": index, "pid": process.pid if process.returncode is None else None,
                        "state": replica.state.value, "version": replica.version,
                        "current": replica.version == provider.version, "device": process.device,
                        "budget_gb": replica.vram_budget_gb, "served": replica.served, "starts": provider.starts,
                        "idle_s": round(replica.idle_s(), 1), "uptime_s": _round(process.uptime_s()),
                        "transcript": process.transcript_path, "socket": process.socket_path,
                        "last_error": replica.last_error,
                        "retiring": replica.retire, "started_by": process.started_by,
                        "hibernation": replica.hibernation.describe() if replica.hibernation else None,
                        "lease": None if lease is None else {"id": lease.id, "holder": lease.holder,
                                                             "age_s": round(now - lease.since, 1)},
                    })
                snapshot = provider.breaker.snapshot()
                if snapshot:
                    breakers[slug] = snapshot
                providers[slug] = {"version": provider.version, "manifest": str(provider.source),
                                   "starts": provider.starts, "last_error": provider.last_error,
                                   "breaker": snapshot, "start": self.zygotes.status(slug, provider.manifest),
                                   "eviction": self.hibernator.status(slug, provider.manifest.lifecycle.evict)}
        for slug, manifest in kit_providers:  # walked outside the lock, at most once a minute per root
            providers[slug]["jit_cache"] = self.jit_sizes.report(jit_root(manifest, os.environ))
        return self._observe_status({
            "pool": {"pid": os.getpid(), "version": __version__, "socket": self.socket_path,
                     "manifests": str(self.manifests), "since": self.started, "ledger": str(self.ledger.path),
                     "draining": self.draining},
            "workers": workers, "providers": providers, "waiting": self.waiting(), "breakers": breakers,
            "ledger": self.ledger.entries(), "zygotes": self.zygotes.describe()})

    def stop(self, slug: str | None, now: bool = False, why: str = "stopped by `resident-pool stop`") -> list[str]:
        """Stop ``slug``'s replicas (every provider's when None): leased ones drain first, up to drain_grace_s."""
        with self.lock:
            targets = [(provider, replica) for name, provider in self.providers.items() if slug in (None, name)
                       for replica in provider.replicas.values()]
            if slug is not None and slug in self.providers:
                self.providers[slug].breaker.reset()
            for provider, replica in targets:
                self._retire(provider, replica, why, now=now)
            deadline = time.monotonic() + self.drain_grace_s
            while any(r.state is not ReplicaState.STOPPED and r.state is not ReplicaState.FAILED
                      for _, r in targets) and time.monotonic() < deadline:
                self.changed.wait(_TICK_S)
            late = f"{why}: still busy after drain_grace_s = {self.drain_grace_s:g} s"
            for provider, replica in targets:
                if replica.state in (ReplicaState.LEASED, ReplicaState.DRAINING):
                    self._stop_later(provider, replica, late)
                elif replica.state is ReplicaState.STARTING:
                    replica.abort = replica.abort or late  # its start thread stops it and fails the start
            while any(r.state in (ReplicaState.STOPPING, ReplicaState.STARTING) for _, r in targets):
                self.changed.wait(_TICK_S)
            for key in [k for k, p in self.providers.items() if p.variant and slug in (None, k) and not p.replicas]:
                del self.providers[key]  # a variant (a check's run) is gone with its last replica
        self.zygotes.retire(slug, why)
        return [replica.name for _, replica in targets]

    # -- warm-up on demand ------------------------------------------------------------
    def _op_warm(self, message: dict[str, Any], connection: _Connection) -> dict[str, Any]:
        slug, replicas, manifests = message.get("slug"), message.get("replicas", 1), message.get("manifests")
        if not isinstance(slug, str) or not SLUG.fullmatch(slug):
            raise ResidentPoolError(f"provider name {slug!r} is not a slug", reason="bad_request")
        if not isinstance(replicas, int) or isinstance(replicas, bool) or not 1 <= replicas <= 64:
            raise ResidentPoolError(f"warm takes a replica count from 1 to 64, not {replicas!r}", reason="bad_request")
        if manifests is not None and not isinstance(manifests, str):
            raise ResidentPoolError("manifests must be a folder path", reason="bad_request")
        return {"ok": True, **self.warm(slug, manifests, replicas)}

    def warm(self, slug: str, manifests: str | None, replicas: int, why: str = "warm-up",
             wait: bool = True) -> dict[str, Any]:
        """Start workers of ``slug`` until ``replicas`` of its current version are live; wait for them to answer.

        ``wait=False``: only where the budget fits now, never queueing before or evicting for requests.
        """
        if self.draining:
            raise self._stopping_error()
        provider = self._provider(slug, manifests)
        cap = provider.manifest.lifecycle.max_replicas
        if provider.manifest.mode == "subprocess":
            raise ResidentPoolError(f'{slug}: mode = "subprocess" starts a worker per request; it cannot be kept warm',
                                    slug=slug, reason="bad_request")
        if replicas > cap:
            raise ResidentPoolError(f"{slug}: cannot keep {replicas} replicas warm: max_replicas = {cap} in "
                                    f"{provider.source}; raise it or ask for fewer", slug=slug, reason="bad_request")
        with self.lock:
            if provider.breaker.is_open(provider.fingerprint):
                raise self._breaker_error(provider)
            live = [r for r in provider.replicas.values()
                    if r.live and r.version == provider.version and r.retire is None]
            starting = []
            for _ in range(replicas - len(live)):
                replica = self._new_replica(provider)
                replica.lease = Lease(None, replica, {"pool": why})  # the pool's own: no client holds it
                starting.append(replica)
        errors: list[ResidentPoolError] = []

        def start(replica: Replica) -> None:
            try:
                self._start(provider, replica, replica.lease, wait=wait)
            except ResidentPoolError as exc:
                errors.append(exc)
                return
            with self.lock:
                replica.lease = None
                replica.last_used = time.monotonic()
                self._free(provider, replica, f"started by {why}")

        threads = [threading.Thread(target=start, args=(r,), name=f"warm-{r.name}", daemon=True) for r in starting]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors and len(errors) == len(starting):
            raise errors[0]
        return {"slug": slug, "already_warm": len(live), "started": len(starting) - len(errors),
                "replicas": replicas, "errors": [e.headline for e in errors]}

    def _kept_warm(self, provider: _Provider, replica: Replica) -> bool:
        """Whether ``replica`` is one of the provider's ``min_replicas`` (the lowest-numbered live ones)."""
        keep = provider.manifest.lifecycle.min_replicas
        if not keep or replica.version != provider.version or replica.retire is not None:
            return False
        warm = sorted(r.index for r in provider.replicas.values()
                      if r.live and r.version == provider.version and r.retire is None)
        return replica.index in warm[:keep]

    def _keep_warm(self) -> None:
        """Top every provider up to its min_replicas (at start, after a death, an eviction, a manifest change)."""
        if not self._kept_warm_loaded:
            self._kept_warm_loaded = True
            self._load_kept_warm()
        if self.admission.waiting():
            return  # requests wait for GPU memory: a warm-up must not take it before them
        wanted = []
        with self.lock:
            for slug, provider in self.providers.items():
                keep = provider.manifest.lifecycle.min_replicas
                if not keep or slug in self._warming or provider.breaker.remaining_s() > 0:
                    continue
                live = sum(r.live and r.version == provider.version and r.retire is None
                           for r in provider.replicas.values())
                if live < keep:
                    self._warming.add(slug)
                    wanted.append((slug, str(provider.source.parent.parent), keep))
        for args in wanted:
            threading.Thread(target=self._warm_kept, args=args, name=f"keep-warm-{args[0]}", daemon=True).start()

    def _warm_kept(self, slug: str, manifests: str, keep: int) -> None:
        try:
            self.warm(slug, manifests, keep, why="min_replicas", wait=False)
        except ResidentPoolError as exc:
            (log.info if exc.reason == "no_room" else log.warning)(
                "%s: could not keep %d worker(s) warm (min_replicas): %s", slug, keep, exc.headline)
        finally:
            with self.lock:
                self._warming.discard(slug)

    def _load_kept_warm(self) -> None:
        """The providers of the pool's own manifests folder that ask for warm workers from the start."""
        for path in sorted(self.manifests.glob("*/manifest.toml")):
            try:
                if load_manifest(path).lifecycle.min_replicas:
                    self._provider(path.parent.name, None)
            except ResidentPoolError as exc:
                log.warning("%s: not kept warm: %s", path, exc)


def _stamp(path: Path) -> tuple[int, ...]:
    try:
        info = path.stat()
    except OSError:
        return (0, 0, 0)
    return (info.st_ino, info.st_mtime_ns, info.st_size)


def _variant(raw: Any) -> dict[str, Any] | None:
    """Which build of the provider a client asks for; None for the one its manifest declares."""
    if raw is None:
        return None
    def slug_like(value: Any) -> bool:
        return isinstance(value, str) and bool(SLUG.fullmatch(value))

    if (not isinstance(raw, dict) or set(raw) - {"name", "kit_mode", "without_kit"} or not slug_like(raw.get("name"))
            or not (raw.get("kit_mode") is None or slug_like(raw["kit_mode"]))
            or not isinstance(raw.get("without_kit", False), bool)):
        raise ResidentPoolError("variant must be {name, kit_mode, without_kit}: a slug-like name and kit mode, "
                                "and a boolean", reason="bad_request")
    return {"name": raw["name"], "kit_mode": raw.get("kit_mode"), "without_kit": raw.get("without_kit", False)}


def _describe_holder(holder: dict[str, str]) -> str:
    """``flow run 'nimble-fox' (task predict-chunk[0-63])``, or whatever the client said."""
    if "flow_run" in holder:
        text = f"flow run {holder['flow_run']!r}"
        if holder.get("task_run"):
            text += f" (task {holder['task_run']})"
        return text
    return ", ".join(f"{key} {value}" for key, value in holder.items())


def _holder(raw: Any) -> dict[str, str]:
    """Who a lease is for (a flow run's name, id and URL), as the client says; short strings only."""
    if raw is None:
        return {}
    if not isinstance(raw, dict) or len(raw) > _HOLDER_KEYS or not all(
            isinstance(k, str) and isinstance(v, str) and len(k) + len(v) <= _HOLDER_CHARS for k, v in raw.items()):
        raise ResidentPoolError(f"holder must be a mapping of at most {_HOLDER_KEYS} short strings",
                                reason="bad_request")
    return dict(raw)


def _round(value: float | None) -> float | None:
    return round(value, 1) if value is not None else None


def _budgets_by_device(replicas) -> dict[int, float]:
    freed: dict[int, float] = {}
    for replica in replicas:
        device = replica.process.device
        if device is not None and device.isdigit() and replica.vram_budget_gb:
            freed[int(device)] = freed.get(int(device), 0.0) + replica.vram_budget_gb
    return freed

