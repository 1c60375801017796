"""A small line server: one thread accepts, reads capped lines, and sends replies with a deadline and a bound.

A service that many local users reach (the host admission service) must not be held by one
that stops reading: nothing here blocks on a peer. Each connection has an outbox; a reply is
sent as far as the socket takes it and the rest waits there, never more than
``max_queued_bytes``, never unread for more than ``send_timeout_s``: past either, the
connection is dropped and its owner is told why. A connection whose replies wait is not read
until they are sent, so a peer that pipelines requests without reading gets no more work done
than it takes back. At the descriptor limit a reserved descriptor is let go to tell one client
why it is turned away. Every exception in the loop is logged and the loop goes on.

The owner gives a ``Handler``: it hears of each connection (and may refuse it), each line, each
close with its reason, and a tick. ``send`` may be called from any thread (a reply computed
elsewhere, a push), so a pool's wire could run its long ops on a bounded pool of its own.
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import selectors
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..protocol import RECV_CHUNK, ProtocolError, encode_line, pop_line

__all__ = ["Credentials", "Handler", "Line", "LineServer", "peer_credentials", "shown"]

log = logging.getLogger("resident_pool.lines")

SEND_TIMEOUT_S = 2.0  # a peer that takes none of its replies for this long is dropped
QUEUED_BYTES = 1024 * 1024  # what may wait for one peer beyond what its socket holds
LINES_PER_TURN = 64  # lines of one connection handled before the others get a turn
# What one user's lines may take of a turn before the next user's are handled (at least one line each): the
# service's one thread is shared per user, not per connection, whatever a user's lines cost.
USER_TURN_S = 0.005
_ACCEPTS_PER_TURN = 64
_ACCEPT_BACKOFF_S = 0.1  # after an accept failed for a reason other than the descriptor limit
_SELECT_S = 0.25


def shown(value: Any, limit: int = 60) -> str:
    """``repr(value)``, cut to ``limit`` characters: a peer's text quoted in a reply never outgrows it."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


@dataclass(frozen=True)
class Credentials:
    """The process at the other end of an AF_UNIX connection, as the kernel says (SO_PEERCRED)."""

    pid: int
    uid: int
    gid: int


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of an AF_UNIX socket, as the kernel says."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", raw)


@dataclass(eq=False)
class Line:
    """One connection: its peer, what it sent short of a whole line, and what waits to be sent to it."""

    number: int
    sock: socket.socket
    peer: Credentials
    inbox: bytearray = field(default_factory=bytearray)
    outbox: bytearray = field(default_factory=bytearray)
    waiting_since: float | None = None  # monotonic: when the outbox last had nothing taken from it
    closing: bool = False  # send what is queued, then close (after a line that broke the framing)
    closed: str | None = None  # why it ended
    events: int = selectors.EVENT_READ  # what the selector watches it for now
    data: Any = None  # the owner's


class Handler(Protocol):
    """What a ``LineServer`` tells its owner; each is called on the server's thread."""

    def opened(self, line: Line) -> dict[str, Any] | None:
        """A new connection: None serves it; a message is sent to it, then it is closed (a refusal)."""

    def received(self, line: Line, message: dict[str, Any]) -> dict[str, Any] | None:
        """One line, as a JSON object: the reply, or None (none, or one sent later with ``LineServer.send``)."""

    def bad_line(self, line: Line, error: ProtocolError) -> dict[str, Any]:
        """The reply to a line that is not a JSON object or is over the cap."""

    def closed(self, line: Line, why: str, dropped: bool) -> None:
        """The connection ended: ``dropped`` when the server ended it because the peer did not read."""

    def tick(self, now: float) -> None:
        """Called about every ``tick_s`` on the server's thread."""


class LineServer:
    """Serves one listening AF_UNIX socket on one thread; see the module's docstring."""

    def __init__(self, listener: socket.socket, handler: Handler, *, max_line_bytes: int,
                 max_queued_bytes: int = QUEUED_BYTES, send_timeout_s: float = SEND_TIMEOUT_S,
                 tick_s: float = 1.0) -> None:
        self.listener = listener
        self.handler = handler
        self.max_line_bytes = max_line_bytes
        self.max_queued_bytes = max_queued_bytes
        self.send_timeout_s = send_timeout_s
        self.tick_s = tick_s
        self.lines: dict[int, Line] = {}
        self._numbers = itertools.count(1)
        self._lock = threading.RLock()  # outboxes and registrations: ``send`` may come from another thread
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        for end in (self._wake_r, self._wake_w):
            end.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        listener.setblocking(False)
        self._selector.register(listener, selectors.EVENT_READ, None)
        self._accepting = True
        self._accept_again = 0.0
        self._pending: set[Line] = set()  # whole lines left in an inbox for a later turn
        self._turns: dict[int, int] = {}  # per user: how many turns it had (its connections take them in turn)
        self._last_tick = float("-inf")
        self._thread: int | None = None
        self._reserve: int | None = _reserve()

    # -- the loop ------------------------------------------------------------------------------------------
    def serve(self, finished: threading.Event) -> None:
        """Run until ``finished`` is set."""
        while not finished.is_set():
            self.step()

    def step(self, timeout: float = _SELECT_S) -> None:
        """One turn: accept, read, write, drop the overdue, tick. Never raises: what went wrong is logged."""
        self._thread = threading.get_ident()
        try:
            self._turn(0.0 if self._pending else timeout)
        except Exception:  # one bad turn must not end the service for every peer; it is said in full
            log.exception("the line server's turn failed; serving on")
            time.sleep(_ACCEPT_BACKOFF_S)

    def _turn(self, timeout: float) -> None:
        now = time.monotonic()
        if not self._accepting and now >= self._accept_again:
            self._accepting = True
            self._selector.register(self.listener, selectors.EVENT_READ, None)
        if self._reserve is None:
            self._reserve = _reserve()
        for key, events in self._selector.select(timeout):
            if key.fileobj is self._wake_r:
                _drain(self._wake_r)
            elif key.fileobj is self.listener:
                self._accept()
            else:
                line: Line = key.data
                if events & selectors.EVENT_WRITE:
                    self._flush(line)
                if events & selectors.EVENT_READ and line.closed is None:
                    self._read(line)
        self._handle_pending()
        now = time.monotonic()
        with self._lock:
            overdue = [line for line in self.lines.values()
                       if line.outbox and line.waiting_since is not None
                       and now - line.waiting_since > self.send_timeout_s]
        for line in overdue:
            self.drop(line, f"it did not read its replies for {self.send_timeout_s:g} s "
                            f"({len(line.outbox)} bytes waiting)", dropped=True)
        if now - self._last_tick >= self.tick_s:
            self._last_tick = now
            try:
                self.handler.tick(now)
            except Exception:
                log.exception("the line server's owner failed its tick")

    # -- accepting ----------------------------------------------------------------------------------------------
    def _accept(self) -> None:
        for _ in range(_ACCEPTS_PER_TURN):
            try:
                sock, _ = self.listener.accept()
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE) and self._turn_away():
                    continue
                log.warning("accept failed (%s); accepting again in %g s", exc, _ACCEPT_BACKOFF_S)
                self._pause_accepting()
                return
            try:
                self._open(sock)
            except Exception:  # one connection's trouble (its credentials, the owner's check) is that one's
                log.exception("a new connection could not be served; closed")
                sock.close()

    def _pause_accepting(self) -> None:
        """Stop watching the listener a moment: it stays readable, and the loop must not spin on it."""
        if self._accepting:
            self._accepting = False
            self._accept_again = time.monotonic() + _ACCEPT_BACKOFF_S
            self._selector.unregister(self.listener)

    def _turn_away(self) -> bool:
        """At the descriptor limit: let the reserve go, accept one peer, tell it why, close it, reserve again."""
        if self._reserve is None:
            return False
        os.close(self._reserve)
        self._reserve = None
        try:
            sock, _ = self.listener.accept()
        except OSError:
            return False
        log.warning("out of file descriptors with %d connections: turning a peer away", len(self.lines))
        _say_and_close(sock, {"ok": False, "reason": "too_many_connections",
                              "error": "the service is out of file descriptors; it turns peers away until some "
                                       "connections close: retry later"})
        self._reserve = _reserve()
        return True

    def _open(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        pid, uid, gid = peer_credentials(sock)
        line = Line(next(self._numbers), sock, Credentials(pid, uid, gid))
        refusal = self.handler.opened(line)
        if refusal is not None:
            _say_and_close(sock, refusal)
            return
        with self._lock:
            self.lines[line.number] = line
            self._selector.register(sock, selectors.EVENT_READ, line)

    # -- reading ---------------------------------------------------------------------------------------------------
    def _read(self, line: Line) -> None:
        if b"\n" in line.inbox:  # its waiting lines are answered before more is read
            self._watch_reads(line, False)
            self._pending.add(line)
            return
        try:
            chunk = line.sock.recv(min(RECV_CHUNK, self.max_line_bytes + 1))
        except BlockingIOError:
            return
        except OSError as exc:
            self.drop(line, f"its connection failed ({exc.strerror or exc})")
            return
        if not chunk:
            self.drop(line, "it closed its end" + (f" mid-line ({len(line.inbox)} bytes)" if line.inbox else ""))
            return
        line.inbox += chunk
        if b"\n" in line.inbox or len(line.inbox) > self.max_line_bytes:  # a line to answer, or one over the cap
            # Its whole lines are answered first, in the users' turns: until then it is not read again, and what it
            # sends meanwhile waits in its own socket, not in this process's memory.
            self._watch_reads(line, False)
            self._pending.add(line)

    def _handle_pending(self) -> None:
        """Answer the connections' waiting lines, user by user: each user's lines, from its connections in turn,
        until ``USER_TURN_S`` is spent (one line at least), then the next user's."""
        by_user: dict[int, list[Line]] = {}
        for line in sorted(self._pending, key=lambda line: line.number):
            by_user.setdefault(line.peer.uid, []).append(line)
        for uid, theirs in by_user.items():
            turn = self._turns.get(uid, 0)
            left = theirs[turn % len(theirs):] + theirs[:turn % len(theirs)]  # where its last turn stopped
            self._turns[uid] = turn + 1
            until = time.monotonic() + USER_TURN_S
            while left and time.monotonic() < until:
                for line in list(left):
                    if not self._handle(line, 1):
                        left.remove(line)
                    if time.monotonic() >= until:
                        break

    def _handle(self, line: Line, budget: int = LINES_PER_TURN) -> bool:
        """Answer up to ``budget`` whole lines; none while replies wait for the peer to read them. True when whole
        lines are left for a later turn."""
        self._pending.discard(line)
        for _ in range(budget):
            if line.closed is not None or line.closing or line.outbox:
                return False  # its replies wait: once they have gone (_flush), its lines come back to the line
            try:
                message = pop_line(line.inbox, self.max_line_bytes)
            except ProtocolError as exc:
                self.send(line, self._bad_line(line, exc))
                if not exc.recoverable:
                    self._close_when_sent(line)
                continue
            if message is None:
                self._watch_reads(line, True)
                return False
            try:
                reply = self.handler.received(line, message)
            except Exception:  # the owner's bug: this peer hears of it, the rest are served
                log.exception("a line from pid %d could not be answered", line.peer.pid)
                reply = {"ok": False, "reason": "service_error", "error": "the service failed to answer this "
                         "request; its log has the traceback"}
            if reply is not None:
                self.send(line, reply)
        if line.closed is None and b"\n" in line.inbox:
            self._pending.add(line)  # more whole lines: after the others have had a turn
            return True
        if line.closed is None and not line.outbox:
            self._watch_reads(line, True)
        return False

    def _bad_line(self, line: Line, error: ProtocolError) -> dict[str, Any]:
        try:
            return self.handler.bad_line(line, error)
        except Exception:
            log.exception("the owner failed to word a bad line's reply")
            return {"ok": False, "reason": "bad_request", "error": "bad request line"}

    def _watch_reads(self, line: Line, on: bool) -> None:
        """Read a connection only while none of its replies wait and none of its lines does: a peer that does not
        read is not read, nor one that sends faster than its lines are answered."""
        with self._lock:
            if line.closed is not None:
                return
            events = (selectors.EVENT_READ if on else 0) | (selectors.EVENT_WRITE if line.outbox else 0)
            if events == line.events:
                return
            if not events:
                self._selector.unregister(line.sock)
            elif not line.events:
                self._selector.register(line.sock, events, line)
            else:
                self._selector.modify(line.sock, events, line)
            line.events = events

    # -- sending ---------------------------------------------------------------------------------------------------
    def send(self, line: Line, message: dict[str, Any]) -> bool:
        """Queue ``message`` for ``line`` and send what the socket takes now; False when the line is gone (or has
        just been dropped for what waits for it). Any thread."""
        try:
            data = encode_line(message)
        except (TypeError, ValueError) as exc:  # the owner's bug: never a silent missing reply
            log.error("a message to pid %d could not be encoded: %s", line.peer.pid, exc)
            data = encode_line({"ok": False, "reason": "service_error", "error": "the service could not encode its "
                                "reply; its log says why", "id": message.get("id") if isinstance(
                                    message.get("id"), int) else None})
        with self._lock:
            if line.closed is not None:
                return False
            if len(line.outbox) + len(data) > self.max_queued_bytes:
                self.drop(line, f"it did not read its replies ({len(line.outbox)} bytes waiting, at most "
                                f"{self.max_queued_bytes} are kept)", dropped=True)
                return False
            if not line.outbox:
                line.waiting_since = time.monotonic()
            line.outbox += data
            self._flush(line)
            if line.closed is None and line.outbox:
                self._watch_reads(line, False)
                if threading.get_ident() != self._thread:
                    _wake(self._wake_w)
        return line.closed is None

    def _flush(self, line: Line) -> None:
        with self._lock:
            if line.closed is not None:
                return
            while line.outbox:
                try:
                    sent = line.sock.send(line.outbox)
                except BlockingIOError:
                    return
                except OSError as exc:
                    self.drop(line, f"its connection failed ({exc.strerror or exc})")
                    return
                del line.outbox[:sent]
                line.waiting_since = time.monotonic()
            line.waiting_since = None
            if line.closing:
                self.drop(line, "its line could not be framed")
                return
            self._watch_reads(line, b"\n" not in line.inbox)  # its waiting lines first
        if b"\n" in line.inbox:
            self._pending.add(line)  # pipelined lines read before its replies waited

    def _close_when_sent(self, line: Line) -> None:
        with self._lock:
            if not line.outbox:
                self.drop(line, "its line could not be framed")
            else:
                line.closing = True

    def drop(self, line: Line, why: str, dropped: bool = False) -> None:
        """End ``line``: unregister and close it, and tell the owner why. ``dropped``: the peer did not read."""
        with self._lock:
            if line.closed is not None:
                return
            line.closed = why
            self.lines.pop(line.number, None)
            self._pending.discard(line)
            try:
                self._selector.unregister(line.sock)
            except (KeyError, ValueError):
                pass
            line.sock.close()
            line.outbox.clear()
        if dropped:
            log.warning("dropped the connection of pid %d (uid %d): %s", line.peer.pid, line.peer.uid, why)
        try:
            self.handler.closed(line, why, dropped)
        except Exception:
            log.exception("the line server's owner failed to hear that a connection closed")

    def close(self) -> None:
        """Close every connection, the wake pair and the reserve; the listener is its owner's."""
        for line in list(self.lines.values()):
            self.drop(line, "the service stops")
        self._selector.close()
        self._wake_r.close()
        self._wake_w.close()
        if self._reserve is not None:
            os.close(self._reserve)
            self._reserve = None


def _reserve() -> int | None:
    try:
        return os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None  # taken again on a later turn, once descriptors are free


def _say_and_close(sock: socket.socket, message: dict[str, Any]) -> None:
    """One line, as far as the socket takes it at once, then close: a refused peer never holds the loop."""
    try:
        sock.setblocking(False)
        sock.send(encode_line(message))
    except OSError:
        pass  # it did not wait to hear why
    finally:
        sock.close()


def _wake(sock: socket.socket) -> None:
    try:
        sock.send(b"\0")
    except BlockingIOError:
        pass  # a wake is already waiting to be read


def _drain(sock: socket.socket) -> None:
    try:
        while sock.recv(4096):
            pass
    except BlockingIOError:
        pass
