"""The asyncio client's connections to the pool, and the kept leases ``AsyncPool.predict`` shares, per event loop.

The pool answers the ops of one connection in order, one after another, and binds each lease to the connection
that acquired it: its release goes there, its recall comes there, and it ends when that connection closes. A
coroutine waiting on a connection for admission would hold up the release of any other lease on it; so each lease
has a connection of its own for as long as it lasts (a ``Link``), and a connection that holds none serves the next
acquire or a short op such as ``status``. Coroutines never share a connection at the same moment, to the pool or
to a worker: each has one op in flight on it, or none.
"""

from __future__ import annotations

import asyncio
import heapq
import inspect
import itertools
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any, Generic, Protocol, TypeVar

from .. import priority as order
from ..client import admission_wait, heard
from ..errors import ResidentPoolError, error_from_dict
from ..protocol import RECV_CHUNK, Inbox, encode_line, pop_line
from . import streams

__all__ = ["Lane", "Leased", "Link", "Local"]

# Idle connections to the pool kept per loop for the next acquire or op; more are closed as they come back.
IDLE_LINKS = 4


class Link:
    """One connection to the pool, used by one coroutine at a time, and the worker connections made beside it."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray()
        self.recalled: dict[int, str] = {}  # leases the pool asked back (backfilled ones), and why
        # Worker connections, by (socket, pid, attachment cap): a lease acquired again on this connection for the
        # same worker goes on using its connection (and the buffers it negotiated).
        self.workers: dict[tuple[str, int, int], tuple[socket.socket, Inbox]] = {}
        self.closed = False

    async def call(self, message: dict[str, Any], timeout: float,
                   on_wait: Callable[[dict[str, Any]], Any] | None = None) -> dict[str, Any] | None:
        """Send an op and return the pool's answer (None: it closed the connection instead); what it says unasked
        meanwhile is heard (a recall), and an admission wait's progress goes to ``on_wait`` (awaited if it is a
        coroutine function). Anything that goes wrong half way (a timeout, a cancelled task) closes the connection:
        what was half said or left unread on it cannot be told from the next answer."""
        if self.closed:
            raise ConnectionResetError("this connection to the pool was closed")
        try:
            await streams.send(self.sock, encode_line(message), timeout)
            reply = await streams.recv_line(self.sock, self.buf, timeout)
            while reply is not None and heard(reply, self.recalled):
                wait = admission_wait(reply)
                if wait is not None and on_wait is not None:
                    said = on_wait(wait)
                    if inspect.isawaitable(said):
                        await said
                reply = await streams.recv_line(self.sock, self.buf, timeout)
        except BaseException:
            self.close()
            raise
        return reply

    def tell(self, message: dict[str, Any]) -> None:
        """Send a short line that has no answer (a release, a notice) without waiting. One that cannot go at once
        closes the connection: the pool then ends its lease as it would a client's that went away."""
        if not self.closed and not streams.send_now(self.sock, encode_line(message)):
            self.close()

    def poll(self) -> None:
        """Hear what the pool sent unasked since the last op (a recall), without waiting."""
        while not self.closed:
            line = pop_line(self.buf)
            if line is not None:
                heard(line, self.recalled)
                continue
            try:
                chunk = self.sock.recv(RECV_CHUNK)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                chunk = b""
            if not chunk:
                self.close()  # the pool went away: the next call says so
                return
            self.buf += chunk

    def drop_workers(self) -> None:
        for sock, inbox in self.workers.values():
            sock.close()
            inbox.close()
        self.workers.clear()

    def close(self) -> None:
        self.closed = True
        self.drop_workers()
        self.sock.close()

    def __del__(self) -> None:
        # A link dropped without close() (its loop ended, a client never closed): its descriptors close here
        # quietly, as the kernel would close them at exit, and the pool ends its lease.
        try:
            self.close()
        except Exception:  # noqa: BLE001, S110 - a finalizer must not raise; the descriptors go at exit anyway
            pass


class Leased(Protocol):
    """What a lane knows of a lease (an AsyncSession's)."""

    lease: dict[str, Any]
    _ended: bool

    def release(self) -> None: ...


L = TypeVar("L", bound=Leased)


class Lane(Generic[L]):
    """The kept leases of one provider on one loop, shared by the coroutines calling ``AsyncPool.predict``.

    A call takes a lease no call is using. When none is free, it waits for one to be handed over (classes in
    priority order, first come first served within one), or, when no acquire of its class is under way, acquires
    one more itself: the pool is asked for another replica one at a time per class, never once per waiting call.
    An acquire the pool could grant only by taking back one of this lane's own leases (every replica it may run is
    held here) tells the lane it is full: for ``FULL_S`` then, calls wait for the leases it holds.
    """

    FULL_S = 1.0

    def __init__(self) -> None:
        self.leases: list[L] = []
        self.busy: set[L] = set()
        self.waiters: list[tuple[int, int, asyncio.Future[L | None]]] = []
        self.acquiring: set[str] = set()  # classes with an acquire under way
        self.lost = 0  # leases that ended (taken back, their worker gone), so far
        self.full_until = 0.0
        self._order = itertools.count()

    async def take(self, priority: str, acquire: Callable[[], Awaitable[L]]) -> L:
        """A lease for one call, in use until ``give``: a free one, one handed over, or a new one (``acquire``)."""
        rank, arrived = order.rank(priority), next(self._order)
        while True:
            free = next((lease for lease in self.leases if lease not in self.busy), None)
            if free is not None:
                self.busy.add(free)
                return free
            if priority not in self.acquiring and (not self.leases or time.monotonic() >= self.full_until):
                return await self._acquire(priority, acquire)
            handed = await self._wait(rank, arrived)
            if handed is not None:
                return handed

    def give(self, lease: L) -> None:
        """The call is over: the lease goes to the first waiter, or is free; one that ended leaves the lane."""
        self.busy.discard(lease)
        if lease._ended:
            if lease in self.leases:
                self.leases.remove(lease)
                self.lost += 1
            self._wake()  # a waiter may now acquire another
            return
        while self.waiters:
            waiter = heapq.heappop(self.waiters)[2]
            if not waiter.done():
                self.busy.add(lease)
                waiter.set_result(lease)
                return

    def idle(self) -> list[L]:
        """The leases no call is using."""
        return [lease for lease in self.leases if lease not in self.busy]

    async def _acquire(self, priority: str, acquire: Callable[[], Awaitable[L]]) -> L:
        self.acquiring.add(priority)
        lost = self.lost
        try:
            lease = await acquire()
        except ResidentPoolError as error:
            self.acquiring.discard(priority)
            if self.leases:  # the others wait for these; asking again at once would fail alike
                self.full_until = time.monotonic() + self.FULL_S
                self._wake(priority)
            else:  # nothing to hand over: whoever waited in this class waited for this answer
                self._fail(priority, error)
            raise
        except BaseException:  # cancelled, or the pool could not be reached: another of its class asks anew
            self.acquiring.discard(priority)
            self._wake(priority)
            raise
        self.acquiring.discard(priority)
        if lease.lease.get("kept"):  # a worker per lease (mode = "subprocess") serves one call, never the lane
            if self.lost != lost:
                self.full_until = time.monotonic() + self.FULL_S
            self.leases.append(lease)
            self.busy.add(lease)
        self._wake(priority)
        return lease

    async def _wait(self, rank: int, arrived: int) -> L | None:
        """A lease handed over, or None: woken to look again (an acquire ended, a lease left)."""
        waiter: asyncio.Future[L | None] = asyncio.get_running_loop().create_future()
        entry = (rank, arrived, waiter)
        heapq.heappush(self.waiters, entry)
        try:
            return await waiter
        except BaseException:
            if entry in self.waiters:
                self.waiters.remove(entry)
                heapq.heapify(self.waiters)
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                handed = waiter.result()
                if handed is not None:  # handed over as this call was cancelled: on to the next
                    self.give(handed)
            raise

    def _wake(self, priority: str | None = None) -> None:
        """Wake the first waiter (of ``priority``'s class, where given) to look again."""
        rank = None if priority is None else order.rank(priority)
        for entry in sorted(self.waiters):
            if rank is None or entry[0] == rank:
                self.waiters.remove(entry)
                heapq.heapify(self.waiters)
                if not entry[2].done():
                    entry[2].set_result(None)
                return

    def _fail(self, priority: str, error: ResidentPoolError) -> None:
        """Every waiter of ``priority``'s class gets ``error`` (a copy each: one exception raised in many tasks
        would gather all their tracebacks)."""
        rank = order.rank(priority)
        for entry in [entry for entry in self.waiters if entry[0] == rank]:
            self.waiters.remove(entry)
            if not entry[2].done():
                entry[2].set_exception(error_from_dict(error.to_dict()))
        heapq.heapify(self.waiters)


class Local:
    """What one AsyncPool holds on one event loop: its connections to the pool, and its kept leases by provider."""

    def __init__(self) -> None:
        self.idle: list[Link] = []
        self.links: set[Link] = set()  # every open one, idle or holding a lease
        self.lanes: dict[str, Lane[Any]] = {}
        self.starting = asyncio.Lock()  # one start of a pool at a time, for every coroutine that found none

    def lane(self, slug: str) -> Lane[Any]:
        lane = self.lanes.get(slug)
        if lane is None:
            lane = self.lanes[slug] = Lane()
        return lane

    def park(self, link: Link) -> None:
        """A link that holds no lease now: kept for the next acquire or op, or closed past IDLE_LINKS."""
        if link.closed:
            self.links.discard(link)
        elif len(self.idle) < IDLE_LINKS:
            link.drop_workers()  # the next lease on it may be another worker's: no connection is left idle
            self.idle.append(link)
        else:
            self.links.discard(link)
            link.close()

    def close(self) -> None:
        """Give every kept lease back (not abandoned, which would cost its worker a ping), close every link."""
        for lane in self.lanes.values():
            for lease in lane.idle():
                lease.release()
        self.lanes.clear()
        self.idle.clear()
        for link in list(self.links):
            link.close()
        self.links.clear()

    def disown(self) -> None:
        """In a forked child: these links and leases are the parent's; nothing is sent, only this process's copies
        of the descriptors close."""
        for lane in self.lanes.values():
            for lease in lane.leases:
                lease._ended = True
        self.lanes.clear()
        self.idle.clear()
        for link in list(self.links):
            link.close()
        self.links.clear()
