"""Non-blocking sockets on the running event loop, for the asyncio client.

Each read and write is the blocking client's own (protocol.fill, pop_line, pop_message, sendmsg with SCM_RIGHTS):
tried at once, and on EAGAIN awaited with ``loop.add_reader``/``add_writer`` until the socket is ready. asyncio's
own socket calls have no recvmsg (Python 3.11), and descriptors travel beside a line only with it. A wait costs no
thread: a hundred calls waiting on their workers are a hundred registered descriptors on one loop.

A wait's ``timeout`` bounds each wait for the socket, as a blocking socket's timeout bounds each recv: silence that
long is the peer's failure (TimeoutError), however long the whole answer takes to arrive.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Sequence
from typing import Any

from .. import arrays, protocol
from ..protocol import MAX_LINE_BYTES, RECV_CHUNK, Inbox, Message

__all__ = ["complete", "connect", "negotiate", "recv_line", "recv_message", "send", "send_now"]

_WOULD_BLOCK = (BlockingIOError, InterruptedError)


async def _ready(sock: socket.socket, timeout: float | None, write: bool = False) -> None:
    """Wait until ``sock`` can be read (or written); TimeoutError after ``timeout`` seconds of waiting."""
    loop = asyncio.get_running_loop()
    waiter = loop.create_future()
    fd = sock.fileno()
    if write:
        loop.add_writer(fd, _wake, waiter)
    else:
        loop.add_reader(fd, _wake, waiter)
    timer = None if timeout is None else loop.call_later(timeout, _expire, waiter)
    try:
        await waiter
    finally:
        if write:
            loop.remove_writer(fd)
        else:
            loop.remove_reader(fd)
        if timer is not None:
            timer.cancel()


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


def _expire(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_exception(TimeoutError("timed out"))


async def connect(path: str, timeout: float = protocol.CONNECT_TIMEOUT_S) -> socket.socket:
    """A non-blocking connection to a worker or pool socket served by this user (protocol.connect's checks)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.setblocking(False)
    try:
        target = protocol.check_socket_path(path)
        async with asyncio.timeout(timeout):
            await asyncio.get_running_loop().sock_connect(sock, target)
        protocol.check_peer(sock, path)
    except BaseException:
        sock.close()
        raise
    return sock


async def send(sock: socket.socket, raw: bytes, timeout: float | None, fds: Sequence[int] = ()) -> None:
    """Send an encoded line whole, with ``fds`` passed beside its first byte."""
    view = memoryview(raw)
    done = 0
    while fds:
        try:
            done = sock.sendmsg([view], protocol.rights(fds))
            break
        except _WOULD_BLOCK:
            await _ready(sock, timeout, write=True)
    while done < len(view):
        try:
            done += sock.send(view[done:])
        except _WOULD_BLOCK:
            await _ready(sock, timeout, write=True)


def send_now(sock: socket.socket, raw: bytes) -> bool:
    """Send a short line at once, never waiting; False when it did not all go (the stream is then cut: close it)."""
    try:
        return sock.send(raw) == len(raw)
    except _WOULD_BLOCK:
        return False


async def recv_line(sock: socket.socket, buf: bytearray, timeout: float | None,
                    max_bytes: int = MAX_LINE_BYTES) -> dict[str, Any] | None:
    """protocol.recv_line, waiting on the loop."""
    scanned = 0
    while True:
        message = protocol.pop_line(buf, max_bytes, scanned)
        if message is not None:
            return message
        scanned = len(buf)
        try:
            chunk = sock.recv(min(RECV_CHUNK, max_bytes + 1 - len(buf)) or 1)
        except _WOULD_BLOCK:
            await _ready(sock, timeout)
            continue
        if not chunk:
            return protocol.closed(buf)
        buf += chunk


async def recv_message(sock: socket.socket, inbox: Inbox, timeout: float | None,
                       max_bytes: int = MAX_LINE_BYTES) -> Message | None:
    """protocol.recv_message (a line and the descriptors that came with it), waiting on the loop."""
    scanned = 0
    while True:
        message = protocol.pop_message(inbox, max_bytes, scanned)
        if message is not None:
            return message
        scanned = len(inbox)
        try:
            got = protocol.fill(sock, inbox, min(RECV_CHUNK, max_bytes + 1 - len(inbox)) or 1)
        except _WOULD_BLOCK:
            await _ready(sock, timeout)
            continue
        if not got:
            return protocol.closed(inbox)


async def complete(sock: socket.socket, inbox: Inbox, raw: bytes, fds: list[int], fresh: int | None,
                   request_id: int, timeout: float) -> dict[str, Any] | None:
    """arrays.complete, waiting on the loop: send a request ``arrays.encode`` made and return its reply."""
    try:
        await send(sock, raw, timeout, fds)
    except OSError as exc:
        raise arrays.unsent(exc) from exc
    finally:
        if fresh is not None:
            os.close(fresh)
    for _ in range(arrays.STALE_REPLIES + 1):
        reply = await recv_message(sock, inbox, timeout)
        if reply is None or not arrays.stale(reply, request_id):
            return None if reply is None else arrays.answer(inbox, reply)
    raise arrays.too_many_stale()


async def negotiate(sock: socket.socket, inbox: Inbox, timeout: float) -> None:
    """arrays.negotiate, waiting on the loop."""
    await send(sock, protocol.encode_line(arrays.offer(inbox)), timeout)
    arrays.negotiated(inbox, await recv_message(sock, inbox, timeout))
