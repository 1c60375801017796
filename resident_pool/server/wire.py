"""The pool's wire: its socket, one thread per client connection, keepalives and dispatch of control ops.

It decides nothing about workers: each op goes to a handler the pool gives it, and a
connection's end is reported to the pool. Every op gets an answer, whatever goes wrong
inside it; a flood of connections or a descriptor limit turns clients away with a reason,
never takes the pool down.
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import select
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from ..errors import ResidentPoolError
from ..protocol import ProtocolError, bind_unix, ready, recv_line, send_line

__all__ = ["CONTROL_LINE_BYTES", "Connection", "Keepalives", "Wire"]

log = logging.getLogger("resident_pool.pool")

# Control messages are small; a payload never passes through the pool.
CONTROL_LINE_BYTES = 1024 * 1024
# At exit, how long the ops already read may take to be answered: the stop has ended every lease by then (a wait it
# refused is answered at once), so each is a reply on its way, not work.
REPLIES_BOUND_S = 5.0
Handler = Callable[[dict[str, Any], "Connection"], dict[str, Any] | None]


class Connection:
    """One client connection; leases are bound to it, and end with it."""

    _ids = itertools.count(1)

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.id = next(self._ids)
        self.send_lock = threading.Lock()  # a reply, a progress line and a keepalive never interleave

    def send(self, message: dict[str, Any]) -> None:
        with self.send_lock:
            send_line(self.sock, message)

    def progress(self, report: dict[str, Any]) -> None:
        """Tell the client what its request waits for; a client that is gone is noticed elsewhere."""
        self.tell({"progress": report})

    def tell(self, message: dict[str, Any]) -> None:
        """A line the client did not ask for (a wait's progress, a recall of its lease); a client that is gone is
        noticed elsewhere."""
        try:
            self.send(message)
        except OSError:
            pass

    def gone(self) -> bool:
        """Whether the client closed its end (a killed flow run) while the pool worked for it."""
        try:
            if not ready(self.sock):
                return False
            return self.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except BlockingIOError:
            return False
        except (OSError, ValueError):
            return True


class _LongOp:
    """One long op in progress on a connection: when it began, when it last told its client so."""

    def __init__(self, connection: Connection) -> None:
        self.connection = connection
        self.started = self.beaten = time.monotonic()
        self.active = True  # cleared under the connection's send lock: no keepalive follows the reply


class Keepalives:
    """While long ops run (a cold start, an admission wait, a drain), tell each client every few seconds that
    the pool lives. One thread for all of them: a thread per op cost every warm acquire a start and a join."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._ops: set[_LongOp] = set()
        self._thread: threading.Thread | None = None

    @contextmanager
    def during(self, connection: Connection) -> Iterator[None]:
        op = _LongOp(connection)
        with self._lock:
            self._ops.add(op)
            if self._thread is None:
                self._thread = threading.Thread(target=self._beat, name="keepalive", daemon=True)
                self._thread.start()
        try:
            yield
        finally:
            with connection.send_lock:
                op.active = False
            with self._lock:
                self._ops.discard(op)

    def _beat(self) -> None:
        while True:
            time.sleep(self.interval_s / 10)
            now = time.monotonic()
            with self._lock:
                due = [op for op in self._ops if now - op.beaten >= self.interval_s]
            for op in due:
                op.beaten = now
                try:
                    self._tell(op, now)
                except Exception:  # this thread beats for every client: one client's trouble never ends it
                    log.exception("keepalive to connection %s failed", op.connection.id)

    @staticmethod
    def _tell(op: _LongOp, now: float) -> None:
        with op.connection.send_lock:
            if not op.active:
                return
            sock = op.connection.sock
            # A client that does not read (stopped, at a debugger) gets no keepalive: a blocking send
            # would hold this thread, and every other client's keepalive, until it reads again.
            if not ready(sock, write=True):
                return
            try:
                send_line(sock, {"progress": {"alive_s": round(now - op.started)}})
            except OSError:
                pass  # the client is gone; its op notices on its own


def _error_reply(error: ResidentPoolError) -> dict[str, Any]:
    return {"ok": False, "reason": error.reason, "error": error.to_dict()}


class Wire:
    """Accepts connections on the pool's socket and serves each on a thread of its own."""

    def __init__(self, socket_path: str, handlers: dict[str, Handler], long_ops: frozenset[str],
                 closed: Callable[[Connection], None], max_connections: int, keepalive_s: float, tick_s: float,
                 log_hint: str) -> None:
        self.socket_path = socket_path
        self.handlers = handlers
        self.long_ops = long_ops
        self.closed = closed
        self.max_connections = max_connections
        self.keepalives = Keepalives(keepalive_s)
        self.tick_s = tick_s
        self.log_hint = log_hint  # where the pool's log is, for an op that failed unexpectedly
        self.connections = 0
        self.accept_tick = time.monotonic()  # the watchdog's sign that the accept loop turns
        self._count_lock = threading.Lock()
        self._answering = 0  # ops read and not yet answered: the pool's exit waits for their replies
        self._open: set[socket.socket] = set()  # the clients' connections (under _count_lock): their unread ops too
        self._answered = threading.Condition()
        self._listener: socket.socket | None = None
        self._inode: int | None = None
        self._reserve: int | None = None
        self._poll = select.poll()
        # Written to end a wait for a client at once (wake(), and a signal through signal.set_wakeup_fd): a pool told
        # to stop exits when its workers are gone, not a tick later, and a signal is acted on when it comes.
        self._wake: tuple[int, int] | None = None
        self._wake_lock = threading.Lock()  # a wake() from another thread never writes to a descriptor closed meanwhile

    # -- the socket ---------------------------------------------------------------------------------
    def bind(self) -> None:
        self._listener = bind_unix(self.socket_path)
        self._inode = os.stat(self.socket_path).st_ino
        self._listener.settimeout(self.tick_s)
        self._wake = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._poll.register(self._listener, select.POLLIN)
        self._poll.register(self._wake[0], select.POLLIN)
        # One descriptor held back: at the descriptor limit, it is let go to accept a client and tell it
        # why it is turned away, instead of leaving it hanging in the backlog.
        self._reserve = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)

    def socket_is_ours(self) -> bool:
        try:
            return os.stat(self.socket_path).st_ino == self._inode
        except FileNotFoundError:
            return False

    @property
    def wake_fd(self) -> int:
        """The descriptor whose writing wakes the accept loop (bound wires only)."""
        assert self._wake is not None
        return self._wake[1]

    def wake(self) -> None:
        """End the accept loop's wait now (from any thread)."""
        with self._wake_lock:
            if self._wake is None:
                return
            try:
                os.write(self._wake[1], b"w")
            except BlockingIOError:
                pass  # already woken: the pipe is full

    def serve_until(self, finished: threading.Event, each_turn: Callable[[], None]) -> None:
        """Accept clients until ``finished`` is set (``each_turn`` runs before each wait), then wait, at most
        REPLIES_BOUND_S, for the replies of the ops already read: the reply to `shutdown` itself among them, which
        the exiting process would otherwise cut off."""
        backoff = 0.0
        while not finished.is_set():
            each_turn()
            backoff = self.accept_once(backoff)
        # Accepting no more: a client that comes while the replies go out is refused at once (and a client waiting
        # for the socket to go starts the next pool), not let in to wait unanswered until the bound.
        self._stop_listening()
        deadline = time.monotonic() + REPLIES_BOUND_S
        with self._answered:
            # An op sent before the end and not yet read by its connection's thread (one scheduled late) is waited
            # for too: under load, 1 to 13 of 20 shutdowns sent at once were otherwise cut off.
            while self._answering or self._unread():
                left = deadline - time.monotonic()
                if left <= 0:
                    log.warning("exiting with %d op(s) unanswered after %g s; their clients see the connection "
                                "close", self._answering, REPLIES_BOUND_S)
                    break
                self._answered.wait(min(left, 0.01))

    def _unread(self) -> bool:
        """Whether a client's connection holds bytes its thread has not read yet (an op, or its close)."""
        with self._count_lock:
            socks = list(self._open)
        poller = select.poll()
        for sock in socks:
            try:
                poller.register(sock, select.POLLIN)
            except (OSError, ValueError):
                pass  # closed meanwhile: its thread is done
        return any(events & (select.POLLIN | select.POLLHUP) for _, events in poller.poll(0))

    def _stop_listening(self) -> None:
        if self._listener is not None:
            self._listener.close()
        if self.socket_is_ours():
            try:
                os.unlink(self.socket_path)
            except FileNotFoundError:
                pass

    def close(self) -> None:
        self._stop_listening()
        with self._wake_lock:
            if self._wake is not None:
                wake, self._wake = self._wake, None
                for fd in wake:
                    os.close(fd)
        if self._reserve is not None:
            os.close(self._reserve)
            self._reserve = None

    def accept_once(self, backoff: float) -> float:
        """Accept one connection (or return after a tick, or when woken); returns the backoff to use next time."""
        assert self._listener is not None
        self.accept_tick = time.monotonic()
        readable = {fd for fd, _ in self._poll.poll(self.tick_s * 1000)}
        if self._wake is not None and self._wake[0] in readable:
            try:
                while os.read(self._wake[0], 512):
                    pass
            except BlockingIOError:
                pass
        if self._listener.fileno() not in readable:
            return backoff
        try:
            conn, _ = self._listener.accept()
        except TimeoutError:
            return backoff
        except OSError as exc:
            if exc.errno in (errno.EMFILE, errno.ENFILE) and self._turn_away_at_the_limit():
                return backoff
            # Out of buffers, or the reserve is in use: wait for some connections to close; one flood
            # must not take down the pool and every warm worker with it.
            backoff = min(max(backoff * 2, 0.05), 1.0)
            log.warning("accept failed (%s); backing off %.2f s", exc, backoff)
            time.sleep(backoff)
            return backoff
        self._serve(conn)
        return 0.0

    def _turn_away_at_the_limit(self) -> bool:
        """At the descriptor limit: free the reserve, accept one client, tell it why, close it, re-reserve."""
        if self._reserve is None:
            return False
        os.close(self._reserve)
        self._reserve = None
        try:
            conn, _ = self._listener.accept()  # type: ignore[union-attr]
        except OSError:
            conn = None
        if conn is not None:
            log.warning("out of file descriptors with %d connections: turning a client away", self.connections)
            self._refuse(conn, ResidentPoolError(
                "the pool is out of file descriptors (too many connections or files open); it turns clients away "
                "until some close: retry, or raise its descriptor limit (LimitNOFILE in its unit)",
                reason="too_many_connections"))
        try:
            self._reserve = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            self._reserve = None  # taken back as soon as a descriptor frees: the next EMFILE backs off meanwhile
        return conn is not None

    def reserve_again(self) -> None:
        """Called each tick: take the reserve back once descriptors are free again."""
        if self._reserve is None:
            try:
                self._reserve = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                pass

    @staticmethod
    def _refuse(conn: socket.socket, error: ResidentPoolError) -> None:
        try:
            conn.settimeout(1.0)
            send_line(conn, _error_reply(error))
        except OSError:
            pass  # it did not wait to hear why
        finally:
            conn.close()

    def _serve(self, conn: socket.socket) -> None:
        with self._count_lock:
            full = self.connections >= self.max_connections
            if not full:
                self.connections += 1
        if full:
            # One thread and a buffer each: a flood of connections must not take the pool's memory.
            self._refuse(conn, ResidentPoolError(
                f"the pool serves at most {self.max_connections} connections at once "
                "(RESIDENT_POOL_MAX_CONNECTIONS); close idle clients, or raise the setting",
                reason="too_many_connections"))
            return
        try:
            threading.Thread(target=self._serve_client, args=(conn,), daemon=True).start()
        except RuntimeError as exc:  # no thread to be had: refuse this one connection, keep serving
            log.warning("cannot serve a new connection (%s); closing it", exc)
            conn.close()
            with self._count_lock:
                self.connections -= 1

    # -- one client ------------------------------------------------------------------------------------
    def _serve_client(self, sock: socket.socket) -> None:
        connection = Connection(sock)
        buf = bytearray()
        with self._count_lock:
            self._open.add(sock)
        try:
            while True:
                try:
                    message = recv_line(sock, buf, CONTROL_LINE_BYTES)
                except ProtocolError as exc:
                    connection.send(_error_reply(ResidentPoolError(f"bad request line: {exc}", reason="bad_request")))
                    if exc.recoverable:
                        continue
                    return
                if message is None:
                    return
                with self._answered:
                    self._answering += 1
                try:
                    if message.get("op") in self.long_ops:
                        with self.keepalives.during(connection):
                            reply = self.dispatch(message, connection)
                    else:
                        reply = self.dispatch(message, connection)
                    if reply is not None:
                        connection.send(reply)
                finally:
                    with self._answered:
                        self._answering -= 1
                        self._answered.notify_all()
        except OSError:
            pass  # the client went away mid-reply; its leases end below
        finally:
            with self._count_lock:
                self._open.discard(sock)
            sock.close()
            try:
                self.closed(connection)
            finally:
                with self._count_lock:
                    self.connections -= 1

    def dispatch(self, message: dict[str, Any], connection: Connection) -> dict[str, Any] | None:
        """Run one op; every op gets a reply (but a plain release), whatever goes wrong inside it."""
        op = message.get("op")
        handler = self.handlers.get(op) if isinstance(op, str) else None
        if handler is None:
            return _error_reply(ResidentPoolError(f"unknown pool op {op!r}", reason="unknown_op"))
        try:
            return handler(message, connection)
        except ResidentPoolError as exc:
            return _error_reply(exc)
        except Exception as exc:
            log.exception("pool op %s failed", op)
            return _error_reply(ResidentPoolError(
                f"the pool could not {op}: {type(exc).__name__}: {exc}; the pool's log ({self.log_hint}) has the "
                "traceback", reason="pool_error"))
