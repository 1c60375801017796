"""The host-wide admission service: `resident-pool admission-service`, one process for every user's pool.

It serves ``host.HostLedger`` on a socket of mode 0660 owned by the configured group (users
not in it cannot connect), names each asking pool by the kernel's peer credentials, and keeps
the ledger in its state folder across restarts. One thread per connection reads requests; one
lock guards the ledger; pushes (``wake``, ``recall``) go out on a thread of their own, never
blocking on a pool that does not read. Hostile input gets an error reply and, past the line
cap, a closed connection; no message can name another user or another pool.
"""

from __future__ import annotations

import grp
import logging
import os
import pwd
import select
import signal
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import ResidentPoolError
from ..protocol import ProtocolError, bind_unix, recv_line, send_line
from .config import ServiceConfig
from .devices import Device, devices_from
from .host import HostLedger, Peer, Procs, Push, Refused
from .remote import LINE_BYTES, peer_credentials

__all__ = ["AdmissionService"]

log = logging.getLogger("resident_pool.admission")
SEND_TIMEOUT_S = 2.0  # a reply to a pool that does not read for this long closes its connection
RECLAIM_S = 1.0  # how often dead pools' and workers' entries are looked for, with nobody asking


def _answers(path: Path) -> bool:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(str(path))
        return True
    except OSError:
        return False
    finally:
        probe.close()


class _Client:
    def __init__(self, sock: socket.socket, peer: Peer, number: int) -> None:
        self.sock = sock
        self.peer = peer
        self.number = number
        self.lock = threading.Lock()

    def send(self, message: dict[str, Any]) -> bool:
        """Send unless the pool stopped reading; False when the connection is no good any more."""
        with self.lock:
            try:
                if not select.select([], [self.sock], [], SEND_TIMEOUT_S)[1]:
                    return False
                send_line(self.sock, message)
                return True
            except OSError:
                return False


class AdmissionService:
    """The socket, the connections and the one lock around the ledger."""

    def __init__(self, config: ServiceConfig, devices: Callable[[], tuple[list[Device], str]] | None = None,
                 procs: Procs | None = None) -> None:
        self.config = config
        self.ledger = HostLedger(config, devices or (lambda: devices_from(
            config.fake_nvml, config.capacity_gb, "capacity_gb in the admission service's config")), procs)
        self.lock = threading.Lock()
        self.clients: dict[int, _Client] = {}
        self._numbers = iter(range(1, 2**62))
        self.finished = threading.Event()
        self._listener: socket.socket | None = None

    # -- the socket ------------------------------------------------------------------------------------
    def bind(self) -> None:
        """Bind the socket 0660, group ``config.group``; refuse a group that does not exist, naming the fix."""
        try:
            gid = grp.getgrnam(self.config.group).gr_gid
        except KeyError:
            raise ResidentPoolError(f"admission service: group {self.config.group!r} does not exist; create it "
                                    f"(`groupadd --system {self.config.group}`) and add the users whose pools "
                                    "admit through the service", reason="bad_config") from None
        path = Path(self.config.socket)
        path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        folder = os.stat(path.parent)
        if folder.st_mode & 0o022 and not folder.st_mode & 0o1000:
            # Anyone who can write there can put a socket of their own in its place.
            raise ResidentPoolError(f"admission service: the socket's folder {path.parent} is writable by its group or "
                                    f"others; use a private one (the unit's /run/resident-pool), or chmod go-w it",
                                    reason="bad_config")
        if _answers(path):
            raise ResidentPoolError(f"admission service: another one already serves {path}; stop it first "
                                    "(`systemctl stop resident-pool-admission`)", reason="already_running")
        self._listener = bind_unix(str(path), mode=0o660, gid=gid)  # in its group before it is at its path
        self._listener.settimeout(0.5)
        self.ledger.load()
        log.info("admission service %d on %s (group %s), ledger %s", os.getpid(), path, self.config.group,
                 self.ledger.state_path)

    def serve_forever(self) -> None:
        self.bind()
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda *_: self.finished.set())
        threading.Thread(target=self._reclaim_loop, name="reclaim", daemon=True).start()
        try:
            while not self.finished.is_set():
                self.accept_once()
        finally:
            self.close()

    def accept_once(self) -> None:
        assert self._listener is not None
        try:
            sock, _ = self._listener.accept()
        except TimeoutError:
            return
        except OSError as exc:  # out of descriptors: wait for some to close, keep serving those connected
            log.warning("accept failed: %s", exc)
            time.sleep(0.1)
            return
        threading.Thread(target=self._serve, args=(sock,), daemon=True).start()

    def close(self) -> None:
        if self._listener is not None:
            self._listener.close()
            try:
                os.unlink(self.config.socket)
            except FileNotFoundError:
                pass

    def _reclaim_loop(self) -> None:
        while not self.finished.wait(RECLAIM_S):
            with self.lock:
                pushes = self.ledger.reclaim()
            self._push(pushes)

    # -- one pool ------------------------------------------------------------------------------------------
    def _peer(self, sock: socket.socket) -> Peer:
        pid, uid, gid = peer_credentials(sock)
        try:
            user = pwd.getpwuid(uid).pw_name
        except KeyError:
            user = str(uid)
        try:
            groups = tuple(sorted({grp.getgrgid(g).gr_name for g in os.getgrouplist(user, gid)}))
        except (KeyError, OSError):
            groups = ()
        return Peer(pid, uid, gid, user, groups)

    def _serve(self, sock: socket.socket) -> None:
        peer = self._peer(sock)
        with self.lock:
            mine = sum(1 for c in self.clients.values() if c.peer.uid == peer.uid)
            refused = ("too many connections to the admission service" if len(self.clients) >=
                       self.config.max_connections else f"user {peer.user} has {mine} connections to the admission "
                       "service already" if mine >= self.config.max_connections_per_user else None)
            client = _Client(sock, peer, next(self._numbers))
            if refused is None:
                self.clients[client.number] = client
        if refused is not None:
            client.send({"ok": False, "reason": "too_many_connections", "error": refused})
            sock.close()
            return
        buf = bytearray()
        try:
            while True:
                try:
                    message = recv_line(sock, buf, LINE_BYTES)
                except ProtocolError as exc:
                    client.send({"ok": False, "reason": "bad_request", "error": f"bad request line: {exc}"})
                    if exc.recoverable:
                        continue
                    return
                if message is None:
                    return
                reply = self._answer(client, message)
                if not client.send(reply):
                    return
        except OSError:
            pass
        finally:
            sock.close()
            with self.lock:
                self.clients.pop(client.number, None)
                pushes = self.ledger.gone(peer, client.number)
            self._push(pushes)

    def _answer(self, client: _Client, message: dict[str, Any]) -> dict[str, Any]:
        number = message.get("id")
        reply: dict[str, Any] = {"id": number if isinstance(number, int) else None}
        op = message.get("op")
        pushes: list[Push] = []
        try:
            with self.lock:
                now = time.monotonic()
                if op == "hello":
                    reply.update(self.ledger.hello(client.peer))
                elif op == "place":
                    answer, pushes = self.ledger.place(now, client.peer, client.number, message)
                    reply.update(answer)
                elif op == "started":
                    self.ledger.started(client.peer, message)
                elif op == "loaded":
                    self.ledger.loaded(client.peer, message)
                elif op == "release":
                    pushes = self.ledger.release(client.peer, message)
                elif op == "withdraw":
                    pushes = self.ledger.withdraw(client.peer, message)
                elif op == "status":
                    reply.update(self.ledger.status(now, client.peer))
                else:
                    raise Refused(f"unknown admission service op {op!r}", reason="unknown_op")
        except Refused as exc:
            return {**reply, "ok": False, "reason": exc.reason, "error": str(exc)}
        except Exception as exc:  # a bug must not end the service for every user: said, and logged in full
            log.exception("admission service op %s failed", op)
            return {**reply, "ok": False, "reason": "service_error", "error": f"{type(exc).__name__}: {exc}"}
        self._push(pushes)
        return {**reply, "ok": True}

    def _push(self, pushes: list[Push]) -> None:
        if not pushes:
            return
        with self.lock:
            targets = [(c, message) for (uid, pool), message in pushes for c in self.clients.values()
                       if (c.peer.uid, c.peer.pid) == (uid, pool)]
        if targets:
            threading.Thread(target=self._send_pushes, args=(targets,), daemon=True).start()

    @staticmethod
    def _send_pushes(targets: list[tuple[_Client, dict[str, Any]]]) -> None:
        for client, message in targets:
            client.send(message)
