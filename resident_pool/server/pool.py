"""The host pool: one long-lived process per host and user that owns the workers.

Clients lease a worker over the pool's socket and then talk to the worker's socket
directly; the pool never copies a payload. This module puts the parts together: the
decision core (``core.PoolState``) decides every change of a replica; the runtime
(``runtime.Runtime``) carries its actions out; the wire (``wire.Wire``) only carries
messages; the observer reads what they hand it. One loop turns the core's clock.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any

from ..admission import Admission, Ledger, read_devices
from ..admission.orphans import Orphans
from ..admission.remote import connect_service
from ..errors import ResidentPoolError
from ..host.paths import Paths
from ..messages import Acquire, LeaseGrant, Release, StopWorkers, Used, Variant, Warm
from ..providers.hibernate import CudaCheckpoint, Hibernator
from ..providers.jit_cache import JitSizes
from ..providers.worker_process import HEARTBEAT_INTERVAL_S
from ..providers.zygote import Zygotes
from ..settings import Settings, settings
from ..version import __version__
from . import actions as c
from . import events as ev
from .actions import Policy, Timings
from .core import PoolState, stopping_error
from .corelog import CoreLog
from .handles import Waiter
from .lifecycle import STOP_ATTEMPTS
from .observing import Observer
from .registry import Loaded, Registry, spec_of
from .runtime import Runtime
from .status import StatusFacts, build_status, describe_holder, waiting
from .wire import Connection, Wire

_ASKS = 3  # a request (or a warm-up) asked again when its provider was forgotten meanwhile: once is enough
MANIFEST_WATCH_S = 1.0  # how often the manifests served are looked at for edits (a stat of two files each)

__all__ = ["PoolServer", "policy_from", "timings_from"]

log = logging.getLogger("resident_pool.pool")


def policy_from(config: Settings, service: dict[str, Any] | None = None) -> Policy:
    """The admission rules as the settings say; where the host admission service is in force, its own (``service``:
    its hello), so this pool orders its requests as the service orders every user's."""
    if service:
        return Policy(aging_s=float(service["aging_s"]), backfill=bool(service["backfill"]),
                      classes=tuple(service["classes"]) or Policy().classes, poll_s=min(config.tick_s, 0.25))
    return Policy(aging_s=config.aging_s, backfill=config.backfill, poll_s=min(config.tick_s, 0.25))


def timings_from(config: Settings, quiet_exit_s: float | None = None) -> Timings:
    return Timings(liveness_timeout_s=config.liveness_timeout_s,
                   drain_grace_s=config.drain_grace_s, breaker_cooldown_s=config.breaker_cooldown_s,
                   quiet_exit_s=config.quiet_exit_s if quiet_exit_s is None else quiet_exit_s)


class PoolServer:
    """One pool: its socket, its core, its runtime and its observer, and the loop that keeps time."""

    def __init__(self, manifests: Path, quiet_exit_s: float | None = None, config: Settings | None = None) -> None:
        config = config or settings()
        self.config = config
        self.paths = Paths.of(config)
        self.manifests = manifests.resolve()
        self.state_dir = self.paths.state_dir()
        self.socket_path = self.paths.pool_socket()
        self.timings = timings_from(config, quiet_exit_s)
        self.tick_s = config.tick_s
        self.started = time.time()
        self.finished = threading.Event()
        self._signal: int | None = None
        self._last_beat = 0.0
        self.ledger = Ledger(self.paths.ledger_path(), audit=config.ledger_audit)
        self.registry = Registry(self.manifests)
        # The runtime the host admission service wakes is made below: a lambda reaches it once it is there.
        self.service = connect_service(config, on_wake=self._memory_freed,
                                       on_recall=lambda slug, index, why: self.runtime.recall_worker(  # noqa: PLW0108
                                           slug, index, why))
        started = time.monotonic()
        policy = policy_from(config, self.service.info if self.service is not None else None)
        self.core = PoolState(self.timings, started, policy)
        self.admission = Admission(self.ledger, devices=lambda: read_devices(config),
                                   headroom_gb=config.gpu_headroom_gb, holder_of=self._holder_of, service=self.service,
                                   orphans=Orphans(self.paths.workers_dir(), config.kill_grace_s))
        self.zygotes = Zygotes(self.paths, config.kill_grace_s)  # fork servers: one per environment with a preload
        self.hibernator = Hibernator(CudaCheckpoint(config.libcuda))  # for [lifecycle] evict = "hibernate"
        self.jit_sizes = JitSizes()
        self.observer = Observer(config, self.paths, self.manifests, self.socket_path,
                                 lambda: self.runtime.snapshot(),  # noqa: PLW0108 - the runtime is made below
                                 lambda rid, cause, why: self.runtime.retire(rid, cause, why),  # noqa: PLW0108
                                 self.finished)
        self.runtime = Runtime(self.core, self.registry, self.admission, self.zygotes, self.hibernator,
                               self.paths, self.observer, config)
        self.runtime.on_exit = self.begin_stop
        if config.core_log is not None:
            self.runtime.core_log = CoreLog(config.core_log, self.timings, policy, started,
                                            int(config.core_log_max_mb * 2**20))
        self.wire = Wire(self.socket_path, {
            "hello": self._op_hello, "acquire": self._op_acquire, "release": self._op_release,
            "status": lambda m, conn: {"ok": True, **self.status()},
            "waiting": lambda m, conn: {"ok": True, "waiting": waiting(*self.runtime.snapshot())},
            "stop": self._op_stop, "shutdown": self._op_shutdown, "warm": self._op_warm, "used": self._op_used,
            "metrics": lambda m, conn: {"ok": True, "text": self.observer.metrics.render()},
        }, frozenset({"acquire", "stop", "warm"}), self._closed, config.max_connections, config.keepalive_s,
            self.tick_s, str(self.paths.log_dir() / "pool.log"))
        self._kept_warm_loaded = False
        self._watched = 0.0
        self._unreadable: dict[str, str] = {}  # providers whose edited manifest does not read: what was said

    @property
    def draining(self) -> bool:
        return self.runtime.view().stopping is not None

    # -- serving --------------------------------------------------------------------------------------
    def serve_forever(self) -> None:
        self.wire.bind()
        (self.state_dir / "pool.pid").write_text(str(os.getpid()))
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(signum, self._record_signal)
        signal.set_wakeup_fd(self.wire.wake_fd)  # a signal ends the wait for a client: it is acted on at once
        log.info("pool %d (resident-pool %s) serving %s (manifests %s)", os.getpid(), __version__,
                 self.socket_path, self.manifests)
        threading.Thread(target=self._maintain_loop, name="maintain", daemon=True).start()
        if self.admission.orphans is not None:
            self.admission.orphans.start()  # a previous pool's idle workers give their memory back now
        self.observer.start()
        try:
            self.wire.serve_until(self.finished, self._act_on_signal)
        finally:
            signal.set_wakeup_fd(-1)
            self.observer.stop()
            self.wire.close()
            if self.runtime.core_log is not None:
                self.runtime.core_log.close()
            log.info("pool %d stopped", os.getpid())

    def _act_on_signal(self) -> None:
        if self._signal is not None:
            self.begin_stop(f"signal {signal.Signals(self._signal).name}")

    def _record_signal(self, signum: int, frame: FrameType | None) -> None:
        self._signal = signum  # only record it: the accept loop, woken by the signal, acts on it

    def _memory_freed(self) -> None:
        """The host admission service says memory was given back: whoever waits for it tries again."""
        self.runtime.report(ev.MemoryFreed())

    def begin_stop(self, why: str, now: bool = False) -> None:
        """Stop taking leases, let leased requests finish (up to drain_grace_s), stop every worker, exit."""
        if self.draining:
            return
        view = self.runtime.view()
        log.info("stopping (%s): draining %d lease(s), up to %g s", why, len(view.leases),
                 self.timings.drain_grace_s)
        with self.runtime.lock:
            targets = [replica.rid for replica in view.replicas]
        self.runtime.report(ev.ShutdownAsked(why, now))

        def stop_everything() -> None:
            try:
                self.runtime.wait_gone(targets, self._stop_bound())
                self.zygotes.stop_all()
            finally:
                self.finished.set()
                self.wire.wake()

        threading.Thread(target=stop_everything, name="drain", daemon=True).start()

    def _stop_bound(self) -> float:
        """How long a stop may take in all: the drain grace, then a stop and its escalations, then a tick."""
        t = self.timings
        return t.drain_grace_s + t.stop_overdue_s * (STOP_ATTEMPTS + 1) + t.report_margin_s

    # -- the clock ------------------------------------------------------------------------------------------
    def _maintain_loop(self) -> None:
        while not self.finished.is_set():
            try:
                self._maintain()
            except Exception:  # one bad pass must not end retirement for good; logged with its traceback
                log.exception("maintenance pass failed")
            self.finished.wait(self.tick_s)

    def _maintain(self) -> None:
        if not self.wire.socket_is_ours() and not self.finished.is_set():  # the exit removes it before its replies
            # The state directory was deleted or another pool took the socket: no client can
            # reach this pool, so its workers would only hold memory. Stand down.
            log.warning("socket %s is gone or no longer ours; stopping every worker and exiting", self.socket_path)
            self.begin_stop("its socket is gone", now=True)
            return
        now = time.monotonic()
        # A tick early rather than a tick late: passes land on tick steps, and a beat due at 2.0 s
        # but made at 2.2 s lets a worker told "stale after 2 s" think its pool is gone.
        beat = now - self._last_beat >= HEARTBEAT_INTERVAL_S - self.tick_s
        if beat:
            self._last_beat = now
        if not self._kept_warm_loaded:
            self._kept_warm_loaded = True
            for slug in self.registry.kept_warm():
                self._provider(slug, None)
        self.wire.reserve_again()
        self._watch_manifests(now)
        self.runtime.maintain(beat, self.wire.connections)
        self._maintain_zygotes(now)
        self.observer.tick(now, self.wire.accept_tick)

    def _watch_manifests(self, now: float) -> None:
        """A manifest or worker script edited while its workers run is read again now, not at the next acquire (a
        kept lease never makes one): a new version drains the old, whose kept leases are recalled, so new requests
        reach the new version within about MANIFEST_WATCH_S. One that no longer reads is said once; the old serves."""
        if now - self._watched < MANIFEST_WATCH_S:
            return
        self._watched = now
        for known in self.registry.changed():
            if known.variant is not None and known.key not in self.runtime.view().providers:
                self.registry.forget(known.key)  # a check's run that ended: never read back in, nor kept warm
                continue
            try:
                self._provider(known.slug, str(known.source.parent.parent), known.variant)
            except ResidentPoolError as exc:
                if self._unreadable.get(known.key) != exc.headline:
                    self._unreadable[known.key] = exc.headline
                    log.warning("%s changed on disk but cannot be read (%s); its workers serve as they were",
                                known.source, exc.headline)
            else:
                self._unreadable.pop(known.key, None)

    def _maintain_zygotes(self, now: float) -> None:
        """A zygote retires once no worker of its provider has been in use for the provider's idle timeout:
        with the last worker retired for idleness, but not with one admission evicted."""
        view = self.runtime.view()
        activity: dict[str, float] = {}
        timeouts = {}
        for key in view.providers:
            loaded = self.registry.get(key)
            if loaded is not None:
                timeouts[key] = loaded.manifest.lifecycle.idle_timeout_s
        for replica in view.replicas:
            used = now - replica.idle_s if replica.idle else now  # the core says what idle is
            activity[replica.key] = max(activity.get(replica.key, 0.0), used)
        self.zygotes.maintain(activity, timeouts, now)

    # -- providers ----------------------------------------------------------------------------------------
    def _provider(self, slug: str, manifests: str | None, variant: Variant | None = None) -> Loaded:
        """Read ``slug``'s manifest as it is now and tell the core."""
        key = f"{slug}~{variant.name}" if variant else slug
        serving = any(r.key == key and not r.ending for r in self.runtime.view().replicas)
        loaded = self.registry.load(slug, manifests, variant, serving=serving)
        # Kept in the registry as the core decided, under its lock: a Forget of a variant decided before this read
        # (settled under the lock too) cannot take away what a start of the provider read anew needs.
        self.runtime.report(ev.ManifestRead(key, slug, loaded.version, loaded.fingerprint, spec_of(loaded.manifest),
                                            variant is not None), noted=lambda _: self.registry.keep(loaded))
        return loaded

    # -- ops ----------------------------------------------------------------------------------------------------
    def _op_hello(self, message: dict[str, Any], connection: Connection) -> dict[str, Any]:
        idle = self.runtime.view().resting
        return {"ok": True, "pid": os.getpid(), "version": __version__, "manifests": str(self.manifests),
                "idle": idle, "draining": self.draining}

    def _op_acquire(self, message: dict[str, Any], connection: Connection) -> dict[str, Any]:
        return self.acquire(Acquire.parse(message), connection).to_message()

    def acquire(self, ask: Acquire, connection: Connection) -> LeaseGrant:
        """Lease a ready replica of ``ask.slug``, starting one if the provider may have another."""
        if self.draining:
            raise stopping_error()
        asked = time.monotonic()
        waiter = Waiter(threading.Event(), connection.progress, tell=connection.tell, connection=connection.id)

        def wait_for(decision: ev.Decision) -> None:  # under the lock, before any answer to its ticket is given
            if decision.ticket is not None:
                self.runtime.waiters[decision.ticket] = waiter

        for _ in range(_ASKS):
            key = self._provider(ask.slug, ask.manifests, ask.variant).key
            decision = self.runtime.report(ev.ClientAsked(key, connection.id, ask.holder or {}, ask.priority,
                                                          ask.keep), noted=wait_for)
            if decision.error is None or decision.error.reason != "provider_gone":
                break  # else: a check's variant ended between the two reports; read again, ask again
        if decision.error is not None:
            raise decision.error
        ticket = decision.ticket
        assert ticket is not None
        try:
            while not waiter.event.wait(self.tick_s):
                if connection.gone():  # its place in the queue must not hold up the rest
                    self.runtime.report(ev.TicketGone(ticket))
                    raise ResidentPoolError(f"{ask.slug}: the client waiting for a replica went away",
                                            slug=ask.slug, reason="client_gone")
        finally:
            with self.runtime.lock:
                self.runtime.waiters.pop(ticket, None)
        answer = waiter.answer
        if isinstance(answer, c.Refuse):
            raise answer.error
        assert isinstance(answer, c.Grant)
        grant = self.runtime.grant(answer, key)
        self.observer.on_lease(grant.priority, time.monotonic() - asked)
        return grant

    def _op_release(self, message: dict[str, Any], connection: Connection) -> dict[str, Any] | None:
        release = Release.parse(message)
        return self.runtime.release(release, connection.id)

    def _op_used(self, message: dict[str, Any], connection: Connection) -> None:
        used = Used.parse(message)
        self.runtime.report(ev.LeaseUsed(used.lease, connection.id, used.served, used.queue_wait_s))
        # no answer: the client does not wait for one

    def _op_stop(self, message: dict[str, Any], connection: Connection) -> dict[str, Any]:
        ask = StopWorkers.parse(message)
        return {"ok": True, "stopped": self.stop(ask.slug, now=ask.now)}

    def _op_shutdown(self, message: dict[str, Any], connection: Connection) -> dict[str, Any]:
        self.begin_stop("a client asked it to shut down")
        return {"ok": True, "pid": os.getpid()}

    def _op_warm(self, message: dict[str, Any], connection: Connection) -> dict[str, Any]:
        ask = Warm.parse(message)
        return {"ok": True, **self.warm(ask.slug, ask.manifests, ask.replicas)}

    def _closed(self, connection: Connection) -> None:
        self.runtime.report(ev.ConnectionClosed(connection.id))
        self.runtime.forget_connection(connection.id)

    def stop(self, slug: str | None, now: bool = False, why: str = "stopped by `resident-pool stop`") -> list[str]:
        """Stop ``slug``'s replicas (every provider's when None): leased ones drain first, up to drain_grace_s."""
        targets = list(self.runtime.report(ev.StopAsked(slug, now, why)).replicas)
        view = self.runtime.view()
        names = [replica.name for replica in view.replicas if replica.rid in targets]
        self.runtime.wait_gone(targets, self._stop_bound())
        self.zygotes.retire(slug, why)
        return names

    def warm(self, slug: str, manifests: str | None, replicas: int) -> dict[str, Any]:
        """Start workers of ``slug`` until ``replicas`` of its current version are live; wait for them to answer."""
        if self.draining:
            raise stopping_error()
        for _ in range(_ASKS):
            loaded = self._provider(slug, manifests)
            decision = self.runtime.report(ev.WarmAsked(loaded.key, replicas))
            if decision.error is None or decision.error.reason != "provider_gone":
                break
        if decision.error is not None:
            raise decision.error
        starting = list(decision.replicas)
        errors = self.runtime.wait_started(starting, self._stop_bound() + loaded.manifest.lifecycle.start_timeout_s
                                           + loaded.manifest.lifecycle.admission_timeout_s)
        if errors and len(errors) == len(starting):
            raise errors[0]
        return {"slug": slug, "already_warm": replicas - len(starting), "started": len(starting) - len(errors),
                "replicas": replicas, "errors": [e.headline for e in errors]}

    # -- what is read from outside ------------------------------------------------------------------------------
    def _holder_of(self, slug: str, index: int) -> str | None:
        """Who holds (or waits to start) ``slug``'s replica ``index``: the flow run a client named, if any."""
        for replica in self.runtime.view().replicas:
            if replica.key == slug and replica.index == index and replica.lease and replica.lease.holder:
                return describe_holder(replica.lease.holder)
        return None

    def status(self) -> dict[str, Any]:
        view, workers = self.runtime.snapshot()
        return build_status(view, StatusFacts(
            workers, self.registry, self.observer, self.zygotes, self.hibernator, self.jit_sizes, self.admission,
            self.service, self.manifests, self.socket_path, self.started, str(self.ledger.path), self.paths.cache))

