"""A pool's side of the host-wide admission service: one connection, requests answered by id, pushes beside.

The service keeps one ledger for every user's pool on the host (``service``). A pool asks it
to place a budget before starting a worker, tells it the worker's pid once spawned, and gives
the budget back when the worker stops; the service pushes ``wake`` when memory was given
back (the pool's waiting starts try again) and ``recall`` when a backfilled worker of this
pool must give its memory back to another pool's request.
"""

from __future__ import annotations

import itertools
import logging
import os
import pwd
import queue
import socket
import threading
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import AdmissionRefused, ResidentPoolError
from ..host.lines import peer_credentials
from ..protocol import ProtocolError, recv_line, send_line
from ..settings import Settings
from .devices import Device
from .gate import Placement

__all__ = ["DEFAULT_SOCKET", "ServiceClient", "connect_service", "peer_credentials", "probe_service",
           "service_socket"]

log = logging.getLogger("resident_pool.admission")
DEFAULT_SOCKET = "/run/resident-pool/admission.sock"
LINE_BYTES = 64 * 1024  # the service's messages are small; a longer line is not the service's
CALL_TIMEOUT_S = 10.0


def service_socket(config: Settings) -> str | None:
    """The service's socket, where it is in force: ``off``; a path; ``auto``: in force where the service's
    configuration file exists (``RESIDENT_POOL_ADMISSION_CONFIG``), at the socket it names. That file survives a
    restart of the service, its socket does not: a pool started while the service restarts then says the service
    does not answer (or waits for it), never admits through its own ledger for its whole life beside it. Without
    the file, the default socket where it exists (a service run with its configuration elsewhere)."""
    value = config.admission_service
    if value == "off":
        return None
    if value != "auto":
        return value
    named = _configured_socket(config.admission_config)
    if named is not None:
        return named
    return DEFAULT_SOCKET if os.path.exists(DEFAULT_SOCKET) else None


def _configured_socket(path: Path) -> str | None:
    """The socket the service's configuration at ``path`` names (the default one where it names none, or cannot
    be read: the service then refuses to start, and the pool says it does not answer); None: no such file."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError:  # there but unreadable to this user: the service is meant to be in force
        return DEFAULT_SOCKET
    try:
        named = tomllib.loads(text).get("socket")
    except tomllib.TOMLDecodeError:
        return DEFAULT_SOCKET
    return named if isinstance(named, str) and named else DEFAULT_SOCKET


def _trusted_uids(config: Settings) -> set[int]:
    """Who may run the service a pool talks to: root, the pool's own user, and the service's own user."""
    uids = {0, os.getuid()}
    try:
        uids.add(pwd.getpwnam(config.admission_service_user).pw_uid)
    except KeyError:
        pass
    return uids


def connect_service(config: Settings, on_wake: Callable[[], None],
                    on_recall: Callable[[str, int, str], None]) -> ServiceClient | None:
    """A connected client when the service is in force (said by ``RESIDENT_POOL_ADMISSION_SERVICE``); None for the
    per-user ledger. A service in force that does not answer is an error, never a silent fall back: two users'
    pools on separate ledgers could then oversubscribe a card."""
    path = service_socket(config)
    if path is None:
        return None
    client = ServiceClient(path, on_wake, on_recall, _trusted_uids(config))
    client.hello()
    return client


def unreachable(path: str, exc: BaseException) -> ResidentPoolError:
    return ResidentPoolError(
        f"the host admission service at {path} does not answer ({type(exc).__name__}: {exc}); start it "
        "(`systemctl start resident-pool-admission`), or set RESIDENT_POOL_ADMISSION_SERVICE=off to admit "
        "through this user's own ledger (other users' pools are then seen only through NVML)",
        reason="admission_service_down")


def probe_service(config: Settings) -> None:
    """Raise what ``connect_service`` would, on a connection of its own that is closed after (no thread: the
    daemon asks this before it forks)."""
    path = service_socket(config)
    if path is None:
        return
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(CALL_TIMEOUT_S)
            sock.connect(path)
            _, uid, _ = peer_credentials(sock)
            if uid not in _trusted_uids(config):
                raise ResidentPoolError(f"the admission service socket {path} is served by uid {uid}, not root or the "
                                        "service's user: refused; check RESIDENT_POOL_ADMISSION_SERVICE",
                                        reason="peer_not_trusted")
            send_line(sock, {"op": "hello", "id": 0})
            reply = recv_line(sock, bytearray(), LINE_BYTES)
    except (OSError, ProtocolError) as exc:
        raise unreachable(path, exc) from None
    if not isinstance(reply, dict) or not reply.get("ok"):
        raise ResidentPoolError(f"the admission service at {path} refused this pool: "
                                f"{(reply or {}).get('error', 'no answer')}", reason="admission_service_down")


class ServiceClient:
    """The pool's connection to the host admission service; thread-safe."""

    def __init__(self, path: str, on_wake: Callable[[], None], on_recall: Callable[[str, int, str], None],
                 trusted_uids: set[int]) -> None:
        self.path = path
        self.on_wake = on_wake
        self.on_recall = on_recall
        self.trusted_uids = trusted_uids
        self.info: dict[str, Any] = {}
        self.classes: list[str] = []
        self._lock = threading.Lock()  # one connect at a time; sends never interleave
        self._sock: socket.socket | None = None
        self._ids = itertools.count(1)
        self._pending: dict[int, list[Any]] = {}  # id: [event, reply]
        self._pushes: queue.SimpleQueue[dict[str, Any]] = queue.SimpleQueue()
        threading.Thread(target=self._dispatch, name="admission-pushes", daemon=True).start()

    # -- the connection ---------------------------------------------------------------------------------
    def _unreachable(self, exc: BaseException) -> ResidentPoolError:
        return unreachable(self.path, exc)

    def _connected(self) -> socket.socket:
        with self._lock:
            if self._sock is not None:
                return self._sock
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.settimeout(CALL_TIMEOUT_S)
                sock.connect(self.path)
                pid, uid, _ = peer_credentials(sock)
            except OSError as exc:
                sock.close()
                raise self._unreachable(exc) from None
            if uid not in self.trusted_uids:
                sock.close()
                raise ResidentPoolError(
                    f"the admission service socket {self.path} is served by uid {uid} (pid {pid}), not root or the "
                    "service's user: refused; check RESIDENT_POOL_ADMISSION_SERVICE", reason="peer_not_trusted")
            sock.settimeout(None)
            self._sock = sock
            threading.Thread(target=self._read, args=(sock,), name="admission-service", daemon=True).start()
            return sock

    def _read(self, sock: socket.socket) -> None:
        buf = bytearray()
        try:
            while True:
                message = recv_line(sock, buf, LINE_BYTES)
                if message is None:
                    break
                if "push" in message:
                    self._pushes.put(message)
                    continue
                waiting = self._pending.get(message.get("id"))
                if waiting is not None:
                    waiting[1] = message
                    waiting[0].set()
        except (OSError, ProtocolError) as exc:
            log.warning("the admission service connection ended: %s", exc)
        finally:
            with self._lock:
                if self._sock is sock:
                    self._sock = None
            sock.close()
            for waiting in list(self._pending.values()):
                waiting[0].set()  # their reply stays None: the call says the service went away
            self._pushes.put({"push": "wake"})  # read the room again once it is back

    def _dispatch(self) -> None:
        """Pushes are handed to the pool from here, never from the reader: the pool's lock is not the reader's."""
        while True:
            message = self._pushes.get()
            try:
                if message.get("push") == "wake":
                    self.on_wake()
                elif message.get("push") == "recall":
                    self.on_recall(str(message.get("slug")), int(message.get("replica", -1)),
                                   str(message.get("why") or "another pool's request needs its memory"))
            except Exception:  # one bad push must not end the pool's hearing of the others
                log.exception("handling the admission service's %s failed", message.get("push"))

    def call(self, op: str, **fields: Any) -> dict[str, Any]:
        """One request and its reply; an error reply raises the error it names."""
        sock = self._connected()
        number = next(self._ids)
        waiting: list[Any] = [threading.Event(), None]
        self._pending[number] = waiting
        try:
            try:
                with self._lock:
                    send_line(sock, {"op": op, "id": number, **fields})
            except OSError as exc:
                raise self._unreachable(exc) from None
            if not waiting[0].wait(CALL_TIMEOUT_S):
                raise self._unreachable(TimeoutError(f"no answer to {op} in {CALL_TIMEOUT_S:g} s"))
        finally:
            self._pending.pop(number, None)
        reply = waiting[1]
        if reply is None:
            raise self._unreachable(ConnectionResetError("it closed the connection"))
        if not reply.get("ok"):
            error = reply.get("error") if isinstance(reply.get("error"), str) else str(reply)
            if reply.get("reason") == "admission_refused":
                raise AdmissionRefused(error, details=reply.get("details") or {})
            raise ResidentPoolError(error, reason=str(reply.get("reason") or "admission_service_error"))
        return reply

    # -- what the pool asks -----------------------------------------------------------------------------
    def hello(self) -> dict[str, Any]:
        self.info = self.call("hello")
        self.classes = list(self.info.get("classes") or [])
        return self.info

    def devices(self) -> tuple[list[Device], float, str]:
        if not self.info:
            self.hello()
        devices = [Device(int(d["index"]), float(d["total_gb"]), d.get("free_gb")) for d in self.info["devices"]]
        return devices, float(self.info["headroom_gb"]), f"the host admission service ({self.info['source']})"

    def place(self, key: str, slug: str, replica: int, need_gb: float, device: int | None, priority: str,
              backfill: bool, waited_s: float, once: bool = False) -> Placement:
        try:
            reply = self.call("place", key=key, slug=slug, replica=replica, need_gb=need_gb, device=device,
                              priority=priority, backfill=backfill, waited_s=waited_s, once=once)
        except AdmissionRefused:
            raise
        except ResidentPoolError as exc:
            if exc.reason != "admission_service_down":
                raise
            return Placement(None, {}, why=exc.headline)  # it waits, and tries again once the service is back
        rooms = {int(k): float(v) for k, v in (reply.get("rooms") or {}).items()}
        if reply.get("placed"):
            return Placement(int(reply["device"]), rooms, bool(reply.get("backfilled")))
        return Placement(None, rooms, why=reply.get("why"))

    def started(self, key: str, pid: int | None) -> None:
        if pid:
            self._quietly("started", key=key, pid=pid)

    def loaded(self, key: str) -> None:
        self._quietly("loaded", key=key)

    def release(self, key: str) -> None:
        self._quietly("release", key=key)

    def withdraw(self, key: str) -> None:
        self._quietly("withdraw", key=key)

    def _quietly(self, op: str, **fields: Any) -> None:
        """A report the pool cannot wait on: where the service is down, it reclaims the entry by its pid later."""
        try:
            self.call(op, **fields)
        except ResidentPoolError as exc:
            log.warning("the admission service did not take %s %s: %s", op, fields, exc.headline)

    def entries(self) -> list[dict[str, Any]]:
        try:
            return list(self.call("status").get("entries", []))
        except ResidentPoolError as exc:
            log.warning("%s", exc.headline)
            return []

    def status(self) -> dict[str, Any]:
        return self.call("status")

    def describe(self) -> dict[str, Any]:
        return {"socket": self.path, "service_pid": self.info.get("pid"), "user": self.info.get("user"),
                "classes": self.classes, "quota": self.info.get("quota"), "backfill": self.info.get("backfill"),
                "aging_s": self.info.get("aging_s")}
