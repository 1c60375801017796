"""``AsyncPool``: this host's pool for asyncio code, with the blocking client's guarantees and no thread per call."""

from __future__ import annotations

import asyncio
import inspect
import os
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from .. import priority as order
from ..client import Pool, _check_priority, _Process, after_hello
from ..errors import ResidentPoolError, WorkerRequestError, error_from_dict
from ..lease import RECALLED_RETRIES
from ..messages import Acquire, StopWorkers, Variant, Warm
from ..protocol import PeerError, ProtocolError, encode_line
from ..version import __version__
from . import streams
from .links import Lane, Link, Local
from .session import AsyncSession

__all__ = ["AsyncPool"]


class AsyncPool:
    """This host's pool of resident workers, for coroutines: ``await pool.predict(slug, payload)``, ``async with
    pool.session(slug) as s: await s.predict(p)``.

    Every wait (for admission, for a worker's answer) is a socket registered on the running event loop, never a
    thread. One AsyncPool serves any number of loops (each has its own connections and kept leases); each call
    runs on its caller's loop. ``predict`` keeps its leases between calls per loop and provider, shared by the
    loop's coroutines: a call takes a lease no other call is using, waits for one to be free, or acquires one more
    (docs/asyncio.md).
    """

    def __init__(
        self,
        manifests: str | os.PathLike[str] | None = None,
        *,
        start: bool = True,
        on_wait: Callable[[dict[str, Any]], Any] | None = None,
        holder: dict[str, str] | None = None,
    ) -> None:
        """As ``Pool``'s; ``on_wait`` may be a coroutine function (it is awaited)."""
        # The blocking client's rare, blocking steps (starting a pool behind a file lock, shutting down an idle one
        # of another version) run on a thread, once for every coroutine that needs them; and its words for errors.
        # Its settings and folders are this client's too: read once, when it was made.
        self._blocking = Pool(manifests, start=start, holder=holder)
        self.config, self.paths, self.manifests = self._blocking.config, self._blocking.paths, self._blocking.manifests
        self.start = start
        self.on_wait = on_wait
        self.holder = holder
        self.socket_path = self._blocking.socket_path
        self._locals: dict[asyncio.AbstractEventLoop, Local] = {}
        self._locals_lock = threading.Lock()  # the loops may run in several threads
        self._forks = _Process.forks

    # -- this loop's connections -------------------------------------------------------------------------------------
    def _here(self) -> Local:
        if self._forks != _Process.forks:
            self._leave_parents()
        loop = asyncio.get_running_loop()
        here = self._locals.get(loop)
        if here is None:
            with self._locals_lock:
                for gone in [old for old in self._locals if old.is_closed()]:
                    self._locals.pop(gone).close()  # a loop that ended: its leases given back, its links closed
                here = self._locals[loop] = Local()
        return here

    def _leave_parents(self) -> None:
        """In a process forked since the last call: the parent's connections and leases are left to it (nothing is
        sent from here); this process connects, and acquires, anew."""
        self._forks = _Process.forks
        locals_, self._locals = self._locals, {}
        self._locals_lock = threading.Lock()  # another thread of the parent may have held it at the fork
        for here in locals_.values():
            here.disown()

    async def _link(self) -> Link:
        """A connection to the pool that holds no lease, for one op: an idle one, or a new one."""
        here = self._here()
        while here.idle:
            link = here.idle.pop()
            if not link.closed:
                return link
            here.links.discard(link)
        link = await self._connect()
        here.links.add(link)
        return link

    def _park(self, link: Link) -> None:
        self._here().park(link)

    async def _connect(self) -> Link:
        """A connection to a pool of this client's version, starting one when none runs (Pool._connect's steps)."""
        timeout = self.config.client_timeout_s
        for _ in range(3):
            sock = await self._open()
            try:
                try:
                    await streams.send(sock, encode_line({"op": "hello", "version": __version__}), timeout)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # closed on us: what it said first (too many connections) is still there to read
                hello = await streams.recv_line(sock, bytearray(), timeout)
            except TimeoutError:
                sock.close()
                raise self._blocking._unresponsive("hello") from None
            except (ConnectionResetError, BrokenPipeError):
                sock.close()  # a pool that died or gave way between connect and hello: the next one answers
                continue
            except BaseException:
                sock.close()
                raise
            try:
                step = after_hello(hello)
            except ResidentPoolError:
                sock.close()
                raise
            if step == "use":
                return Link(sock)
            sock.close()
            if step == "replace":  # an idle pool of another version: it drains at once, and one of this starts
                await asyncio.to_thread(self._blocking._call_once, {"op": "shutdown"})
            if step in ("drained", "replace"):
                await self._socket_gone()
        raise self._blocking._unreachable()

    async def _open(self) -> Any:
        try:
            return await streams.connect(str(self.socket_path))
        except PeerError as exc:
            raise ResidentPoolError(str(exc), reason="peer_not_you") from None
        except (FileNotFoundError, ConnectionRefusedError):
            if not self.start:
                raise self._blocking._no_pool() from None
        # None runs: Pool starts one (behind a file lock, so racing clients start one pool, not two) and waits for
        # its socket, on a thread, once per loop for every coroutine that found none.
        async with self._here().starting:
            sock = await asyncio.to_thread(self._blocking._open)
        sock.setblocking(False)
        return sock

    async def _socket_gone(self, wait_s: float | None = None) -> None:
        deadline = time.monotonic() + (self.config.drain_grace_s + 30.0 if wait_s is None else wait_s)
        while os.path.exists(self.socket_path) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    async def _call(self, link: Link, message: dict[str, Any],
                    on_wait: Callable[[dict[str, Any]], Any] | None = None) -> dict[str, Any]:
        """An op on ``link`` and the pool's answer; the pool's error as the library's own type. Each report of a wait
        for GPU admission heard meanwhile goes to ``on_wait`` (this client's ``on_wait`` when None)."""
        try:
            # Long ops (a cold start, a drain) send a keepalive every few seconds: silence past the
            # timeout means the pool is frozen, not busy.
            reply = await link.call(message, self.config.client_timeout_s, on_wait or self.on_wait)
        except TimeoutError:
            raise self._blocking._unresponsive(str(message.get("op"))) from None
        if reply is None:
            link.close()
            raise ConnectionResetError(f"the pool at {self.socket_path} closed the connection")
        if not reply.get("ok"):
            error = reply.get("error")
            raise error_from_dict(error if isinstance(error, dict) else {"error": str(error)})
        return reply

    async def _ask(self, message: dict[str, Any]) -> dict[str, Any]:
        """An op that leases nothing, on a connection of its own for as long as it takes."""
        link = await self._link()
        try:
            return await self._call(link, message)
        finally:
            self._park(link)

    async def _acquire(self, slug: str, variant: dict[str, Any] | None, holder: dict[str, str] | None,
                       priority: str, keep: bool = False, link: Link | None = None,
                       ) -> tuple[Link, dict[str, Any], dict[str, Any] | None]:
        """A lease of ``slug``, the connection it is bound to (``link`` where it can be; another where the pool
        went away or drains to exit, as Pool._acquire retries), and the last report of its wait for GPU admission
        (None: it did not wait for memory)."""
        message = Acquire(slug, str(self.manifests), holder or None,
                          Variant(**variant) if variant else None, priority, keep).to_message()
        heard: list[dict[str, Any]] = []  # this call's own: another coroutine's acquire keeps its own

        async def hear(wait: dict[str, Any]) -> None:
            heard.append(wait)
            said = self.on_wait(wait) if self.on_wait is not None else None
            if inspect.isawaitable(said):
                await said

        attempts = 3
        for attempt in range(attempts):
            if link is None or link.closed:
                link = await self._link()
            try:
                lease = await self._call(link, message, hear)
                return link, lease, (heard[-1] if heard else None)
            except ResidentPoolError as error:  # first: AdmissionTimeout is an OSError too, and final
                stopping = error.reason == "pool_stopping"
                if stopping:
                    link.close()  # it drains to exit; the next pool serves this request
                self._park(link)
                if not stopping or attempt == attempts - 1:
                    raise
                await self._socket_gone()
            except (OSError, ProtocolError):
                # The pool went away (killed, restarted): reconnect, or start a new one.
                link.close()
                self._park(link)
                if attempt == attempts - 1:
                    raise
            except BaseException:  # cancelled while it waited: the connection closed, and the pool drops the wait
                self._park(link)
                raise
        raise AssertionError("unreachable")

    # -- the API ---------------------------------------------------------------------------------------------------
    async def predict(self, slug: str, payload: Any, *, priority: str = order.DEFAULT) -> Any:
        """One prediction from ``slug``'s worker; starts it if none is warm. ``priority``: interactive, normal or
        batch, where the request waits when it must (for a lease of this loop's, and at the pool).

        Leases are kept between calls, per loop and provider, as ``Pool.predict`` keeps them per thread: a warm
        call is one round trip to the worker, and a lease the pool takes back is acquired again unseen.
        """
        _check_priority(priority)
        here = self._here()
        lane = here.lane(slug)

        async def acquire() -> AsyncSession:
            return AsyncSession(self, *await self._acquire(slug, None, self.holder, priority, keep=True))

        for _ in range(RECALLED_RETRIES):
            session = await lane.take(priority, acquire)
            if not session.lease.get("kept"):  # a worker per lease (mode = "subprocess"), or one that
                try:                           # cannot be asked for its lease back
                    return await session.predict(payload)
                finally:
                    session.release()
                    here.park(session._link)
            try:
                result = await session.predict(payload)
                session.notice()
            except WorkerRequestError as error:
                if error.reason != "lease_recalled":
                    raise
                continue  # taken back between calls: acquire again
            finally:
                self._handed_back(here, lane, session)
            return result
        raise WorkerRequestError(f"{slug}: its lease was taken back {RECALLED_RETRIES} times in a row; the pool is "
                                 "busy with other clients: retry", slug=slug, reason="lease_recalled")

    @staticmethod
    def _handed_back(here: Local, lane: Lane, session: AsyncSession) -> None:
        if not session._ended:
            session.trim()
        lane.give(session)
        if session._ended:
            here.park(session._link)

    @asynccontextmanager
    async def session(self, slug: str, variant: dict[str, Any] | None = None,
                      holder: dict[str, str] | None = None, *,
                      max_attachment_bytes: int | None = None,
                      priority: str = order.DEFAULT) -> AsyncIterator[AsyncSession]:
        """Hold one worker of ``slug`` for a batch (``Pool.session``'s options and rules); others wait meanwhile."""
        _check_priority(priority)
        here = self._here()
        self._give_back_kept(here, slug)  # a session of it would otherwise wait for this loop's idle kept leases
        holder = holder or self.holder

        async def reacquire(link: Link) -> tuple[Link, dict[str, Any], dict[str, Any] | None]:
            return await self._acquire(slug, variant, holder, priority, link=link)

        session = AsyncSession(self, *await self._acquire(slug, variant, holder, priority),
                               max_attachment_bytes=max_attachment_bytes, reacquire=reacquire)
        try:
            yield session
        finally:
            session.release()
            here.park(session._link)

    @staticmethod
    def _give_back_kept(here: Local, slug: str) -> None:
        lane = here.lanes.get(slug)
        for lease in lane.idle() if lane is not None else ():
            lease.release()
            lane.give(lease)
            here.park(lease._link)

    async def status(self) -> dict[str, Any]:
        reply = await self._ask({"op": "status"})
        reply.pop("ok", None)
        return reply

    async def waiting(self) -> list[dict[str, Any]]:
        return (await self._ask({"op": "waiting"}))["waiting"]

    async def stop(self, slug: str | None = None, now: bool = False) -> list[str]:
        """Stop ``slug``'s workers (every provider's when None); leased ones finish first unless ``now``."""
        return (await self._ask(StopWorkers(slug, now).to_message()))["stopped"]

    async def warm(self, slug: str, replicas: int = 1) -> dict[str, Any]:
        """Start ``slug``'s workers until ``replicas`` of them run (and answer); returns what was started."""
        reply = await self._ask(Warm(slug, replicas, str(self.manifests)).to_message())
        reply.pop("ok", None)
        return reply

    async def metrics_text(self) -> str:
        """The pool's metrics in Prometheus's text format."""
        return (await self._ask({"op": "metrics"}))["text"]

    async def shutdown(self, wait_s: float = 60.0) -> int:
        """Stop every worker and the pool process itself; returns its pid (``Pool.shutdown``)."""
        pid = (await self._ask({"op": "shutdown"}))["pid"]
        await self.aclose()
        await self._socket_gone(wait_s)
        return pid

    async def aclose(self) -> None:
        """Close this client's connections on every loop; kept leases are given back first, sessions' leases end
        with their connections. A loop running in another thread closes its own, soon after."""
        if self._forks != _Process.forks:
            self._leave_parents()  # the parent's: not given back from here
        with self._locals_lock:
            locals_, self._locals = self._locals, {}
        running = asyncio.get_running_loop()
        for loop, here in locals_.items():
            if loop is running or loop.is_closed() or not loop.is_running():
                here.close()
            else:
                loop.call_soon_threadsafe(here.close)

    async def __aenter__(self) -> AsyncPool:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
