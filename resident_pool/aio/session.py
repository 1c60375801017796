"""A leased worker for coroutines: ``await session.predict(payload)``."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from .. import arrays
from ..client import _Process
from ..errors import ResidentPoolError, WorkerRequestError, error_from_dict
from ..lease import EXITING, RECALLED_RETRIES, Held, failure
from ..messages import Release
from ..protocol import COPY, Inbox, ProtocolError
from . import streams
from .links import Link

__all__ = ["AsyncSession"]


class Pooled(Protocol):
    """What a session asks of its AsyncPool: its settings, and an op on a connection, answered or raised."""

    config: Any

    async def _call(self, link: Link, message: dict[str, Any]) -> dict[str, Any]: ...


class AsyncSession(Held):
    """A leased worker: requests go straight to its socket, one at a time (calls made together from several
    coroutines wait their turn: a worker connection carries one request at a time), on the loop that opened it."""

    def __init__(self, pool: Pooled, link: Link, lease: dict[str, Any], wait: dict[str, Any] | None = None,
                 max_attachment_bytes: int | None = None,
                 reacquire: Callable[[Link], Awaitable[tuple[Link, dict[str, Any], dict[str, Any] | None]]] | None
                 = None) -> None:
        self.pool = pool
        cap = pool.config.max_attachment_bytes
        self.max_attachment_bytes = cap if max_attachment_bytes is None else min(cap, max_attachment_bytes)
        self._reacquire = reacquire
        self._link = link  # the connection its lease is bound to: its release goes there, a recall comes on it
        self.recalls = 0  # leases given back on the pool's recall, each followed by a new one
        self._forks = _Process.forks
        self._inbox: Inbox | None = None
        self._turn = asyncio.Lock()
        self._hold(lease, wait)
        self._ended = False

    # -- how it talks --------------------------------------------------------------------------------------------
    def _key(self) -> tuple[str, int, int]:
        # The cap is told to the worker once per connection: a session with another cap needs its own.
        return (self.lease["socket"], self.pid, self.max_attachment_bytes)

    def _cached_worker(self) -> tuple[socket.socket, Inbox] | None:
        return self._link.workers.get(self._key())

    def _forget_worker(self) -> None:
        cached = self._link.workers.pop(self._key(), None)
        if cached is not None:
            cached[0].close()
            cached[1].close()

    def _opened_here(self) -> bool:
        return self._forks == _Process.forks

    def _tell(self, message: dict[str, Any]) -> None:
        self._link.tell(message)

    async def _worker(self) -> tuple[socket.socket, Inbox]:
        key = self._key()
        cached = self._link.workers.get(key)
        if cached is None:
            for old in [k for k in self._link.workers if k[0] == key[0]]:
                sock, inbox = self._link.workers.pop(old)
                sock.close()
                inbox.close()
            # A worker's reused buffers are copied out before anything reads them: it may still change them.
            inbox = Inbox(self.max_attachment_bytes, self.pool.config.attach_min_bytes, reused=COPY)
            cached = self._link.workers[key] = (await streams.connect(self.lease["socket"]), inbox)
        return cached

    # -- calls ---------------------------------------------------------------------------------------------------
    async def predict(self, payload: Any) -> Any:
        self._check_usable()
        async with self._turn:
            self._check_usable()  # ended while this call waited its turn
            for _ in range(RECALLED_RETRIES):
                if self._renews():
                    await self._renew_if_recalled()
                try:
                    return await self._predict_once(payload)
                except WorkerRequestError as error:
                    # A backfilled lease the pool took back at its worker (the request was refused, not run): it
                    # waits again in its class, unseen by the caller, as AsyncPool.predict's kept lease does.
                    if error.reason != "lease_recalled" or not self._renews():
                        raise
                    await self._renew()
            raise self._taken_back_too_often()

    async def _predict_once(self, payload: Any) -> Any:
        request_id = next(_Process.request_ids)  # unique in this process: a reply to another request is never taken
        timeout = self.lease["request_timeout_s"]
        try:
            sock, inbox = await self._worker()
            self._inbox = inbox  # for trim, after the call
            if inbox.peer is None:
                await streams.negotiate(sock, inbox, timeout)
            if inbox.slabs is None and arrays.reuses(inbox.peer):
                inbox.slabs = arrays.Slabs()  # this session's reused buffers, on its connection to the worker
        except BaseException as exc:
            error = await self._failed(exc, timeout, sent=False)
            if error is None:
                raise
            raise error  # noqa: B904 - its cause is set by _failure_error (None where the exchange's adds nothing)
        # Encoded before a byte of it goes: a payload that cannot be sent (a dtype the protocol does not
        # carry, NaN, over a cap) raises here as the caller's mistake, and the session goes on as it was.
        encoded = arrays.encode(self._request(request_id, payload), inbox.peer, inbox.attach_min_bytes,
                                slabs=inbox.slabs)
        try:
            reply = self._answered(await streams.complete(sock, inbox, *encoded, request_id, timeout), request_id)
        except BaseException as exc:
            error = await self._failed(exc, timeout, sent=True)
            if error is None:
                raise
            raise error  # noqa: B904 - its cause is set by _failure_error (None where the exchange's adds nothing)
        result = self._outcome(reply)
        if result is EXITING:
            answer = await self._end("exiting", reply)
            raise error_from_dict(answer["error"]) if answer.get("error") else self._failed_error(reply)
        return result

    async def _failed(self, exc: BaseException, timeout: float, sent: bool) -> BaseException | None:
        """What a broken, timed-out or interrupted exchange with the worker does to this session (lease.failure), and
        the library's error the caller hears; None: ``exc`` itself goes on (an interruption). A cancelled task's
        request is abandoned (its connection dropped, the pool drains the worker), as an interrupted one is in the
        blocking client. ``sent=False``: no request had gone yet."""
        kind = failure(exc)
        answer = await self._end(kind) if self._dropped(kind) else {}
        return self._failure_error(kind, exc, sent, timeout, answer)

    async def _end(self, outcome: str, reply: dict[str, Any] | None = None) -> dict[str, Any]:
        """End the lease with ``outcome`` and return what the pool says to it (an error, where there was one)."""
        self._ended = True
        message = Release(self.lease["lease"], outcome, self._unnoticed, reply).to_message()
        try:
            return await self.pool._call(self._link, message)
        except ResidentPoolError:
            raise
        except (OSError, ProtocolError):
            return {}  # the pool is gone, and the lease with its connection: the caller hears what the worker did

    async def _renew_if_recalled(self) -> None:
        """A backfilled lease the pool asked back (its ``recall`` line) is given back before the next request,
        which waits again in its class, maybe for another worker (client.Session's rule)."""
        if not self._renews():
            return
        self._link.poll()
        if self._link.recalled.pop(self.lease["lease"], None) is not None:
            await self._renew()

    async def _renew(self) -> None:
        """Give the recalled lease back (the pool may have ended it already: then the release finds nothing) and
        wait for a new one in this session's class."""
        self._forget_worker()
        self._link.recalled.pop(self.lease["lease"], None)
        self._link.tell(Release(self.lease["lease"], "ok", self._unnoticed).to_message())
        try:
            self._link, lease, wait = await self._reacquire(self._link)
        except BaseException:
            self._ended = True  # no lease now: the next call says so
            raise
        self._ended = False
        self._hold(lease, wait)
        self.recalls += 1
