"""The host-wide admission service: `resident-pool admission-service`, one process for every user's pool.

It serves ``host.HostLedger`` on a socket of mode 0660 owned by the configured group (users
not in it cannot connect), names each asking pool by the kernel's peer credentials, and keeps
the ledger in its state folder across restarts. One thread does everything, through
``host.lines.LineServer``: it never blocks on a pool, so a member that stops reading (or never
reads) holds nothing but its own connection, which is dropped once its replies wait too long
or too many; its waiting requests leave the line, and say why when its pool asks again.
Hostile input gets a short error reply (never the input repeated) and, past the line cap, a
closed connection; no message can name another user or another pool.
"""

from __future__ import annotations

import grp
import logging
import os
import pwd
import signal
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import ResidentPoolError
from ..host.lines import Line, LineServer, shown
from ..protocol import ProtocolError, bind_unix
from .config import ServiceConfig
from .devices import Device, devices_from
from .host import HostLedger, Peer, Procs, Push, Refused
from .remote import LINE_BYTES

__all__ = ["AdmissionService"]

log = logging.getLogger("resident_pool.admission")
RECLAIM_S = 1.0  # how often dead pools' and workers' entries are looked for, with nobody asking
DROP_NOTE_S = 600.0  # how long a dropped pool's requests, asked again, say why it had been dropped


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


class AdmissionService:
    """The socket, the ledger, and the one thread that serves every pool (a ``host.lines.Handler``)."""

    def __init__(self, config: ServiceConfig, devices: Callable[[], tuple[list[Device], str]] | None = None,
                 procs: Procs | None = None) -> None:
        self.config = config
        self.ledger = HostLedger(config, devices or (lambda: devices_from(
            config.fake_nvml, config.capacity_gb, "capacity_gb in the admission service's config")), procs)
        self.finished = threading.Event()
        self.server: LineServer | None = None
        self._listener: socket.socket | None = None
        self._dropped: dict[tuple[int, int], tuple[str, float]] = {}  # (uid, pool pid): why, when (monotonic)

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
        self.server = LineServer(self._listener, self, max_line_bytes=LINE_BYTES, tick_s=RECLAIM_S)
        self.ledger.load()
        log.info("admission service %d on %s (group %s), ledger %s", os.getpid(), path, self.config.group,
                 self.ledger.state_path)

    def serve_forever(self) -> None:
        self.bind()
        assert self.server is not None
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda *_: self.finished.set())
        try:
            self.server.serve(self.finished)
        finally:
            self.close()

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None
        if self._listener is not None:
            self._listener.close()
            self._listener = None
            try:
                os.unlink(self.config.socket)
            except FileNotFoundError:
                pass

    # -- what the line server tells ------------------------------------------------------------------------
    def opened(self, line: Line) -> dict[str, Any] | None:
        """A pool connects: named by the kernel; refused past the connection limits."""
        peer = self._peer(line)
        line.data = peer
        assert self.server is not None
        mine = sum(1 for other in self.server.lines.values() if other.peer.uid == peer.uid)
        if len(self.server.lines) >= self.config.max_connections:
            refused = "too many connections to the admission service"
        elif mine >= self.config.max_connections_per_user:
            refused = f"user {peer.user} has {mine} connections to the admission service already"
        else:
            return None
        return {"ok": False, "reason": "too_many_connections", "error": refused}

    def received(self, line: Line, message: dict[str, Any]) -> dict[str, Any]:
        return self._answer(line, message)

    def bad_line(self, line: Line, error: ProtocolError) -> dict[str, Any]:
        return {"ok": False, "reason": "bad_request", "error": f"bad request line: {error}"}

    def closed(self, line: Line, why: str, dropped: bool) -> None:
        """A pool's connection ended: its waiting requests leave the line; a dropped pool hears why when it asks
        again."""
        peer: Peer | None = line.data
        if peer is None:
            return
        if dropped:
            self._dropped[(peer.uid, peer.pid)] = (why, time.monotonic())
        self._push(self.ledger.gone(peer, line.number))

    def tick(self, now: float) -> None:
        for pool in [p for p, (_, when) in self._dropped.items() if now - when > DROP_NOTE_S]:
            del self._dropped[pool]
        self._push(self.ledger.reclaim())

    # -- one pool ------------------------------------------------------------------------------------------
    @staticmethod
    def _peer(line: Line) -> Peer:
        pid, uid, gid = line.peer.pid, line.peer.uid, line.peer.gid
        try:
            user = pwd.getpwuid(uid).pw_name
        except KeyError:
            user = str(uid)
        try:
            groups = tuple(sorted({grp.getgrgid(g).gr_name for g in os.getgrouplist(user, gid)}))
        except (KeyError, OSError):
            groups = ()
        return Peer(pid, uid, gid, user, groups)

    def _answer(self, line: Line, message: dict[str, Any]) -> dict[str, Any]:
        peer: Peer = line.data
        number = message.get("id")
        reply: dict[str, Any] = {"id": number if isinstance(number, int) else None}
        op = message.get("op")
        pushes: list[Push] = []
        try:
            now = time.monotonic()
            if op == "hello":
                reply.update(self.ledger.hello(peer))
            elif op == "place":
                answer, pushes = self.ledger.place(now, peer, line.number, message)
                reply.update(self._noted(peer, answer))
            elif op == "started":
                self.ledger.started(peer, message)
            elif op == "loaded":
                self.ledger.loaded(peer, message)
            elif op == "release":
                pushes = self.ledger.release(peer, message)
            elif op == "withdraw":
                pushes = self.ledger.withdraw(peer, message)
            elif op == "status":
                reply.update(self.ledger.status(now, peer))
            else:
                raise Refused(f"unknown admission service op {shown(op)}", reason="unknown_op")
        except Refused as exc:
            return {**reply, "ok": False, "reason": exc.reason, "error": str(exc)}
        except Exception as exc:  # a bug must not end the service for every user: said, and logged in full
            log.exception("admission service op %s failed", shown(op))
            return {**reply, "ok": False, "reason": "service_error",
                    "error": f"{type(exc).__name__}: {shown(str(exc), 200)}; the service's log has the traceback"}
        self._push(pushes)
        return {**reply, "ok": True}

    def _noted(self, peer: Peer, answer: dict[str, Any]) -> dict[str, Any]:
        """A place's answer; for a pool dropped a while ago, an unplaced one says why its requests had left the
        line (they join it again as its pool asks)."""
        pool = (peer.uid, peer.pid)
        if answer.get("placed"):
            self._dropped.pop(pool, None)
            return answer
        if pool not in self._dropped:
            return answer
        why, when = self._dropped[pool]
        ago = time.monotonic() - when
        return {**answer, "why": f"{answer.get('why')}; this pool's connection was dropped {ago:.0f} s ago: {why}; "
                "its waiting requests left the line then and joined it again as the pool asked (a pool that stops "
                "reading its connection loses its place)"}

    def _push(self, pushes: list[Push]) -> None:
        """Each push goes to every connection of the pool it names, queued: never a wait on a pool that does not
        read."""
        if not pushes or self.server is None:
            return
        for (uid, pool), message in pushes:
            for line in list(self.server.lines.values()):
                if (line.peer.uid, line.peer.pid) == (uid, pool):
                    self.server.send(line, message)
