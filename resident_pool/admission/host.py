"""The host admission service's ledger and line: one for every user's pool on the host.

Who asks is the kernel's word (SO_PEERCRED: the pool's pid, uid, gid), never the message's.
An entry belongs to one pool of one user: only that pool changes or releases it, and an
entry whose process is gone (the worker's pid, or the pool's while the worker starts) is
reclaimed. Requests that cannot be placed wait in one line across users, in
``priority.in_order``'s order (the pool's own decision core keeps the same); a request that
fits now may be backfilled ahead of a head that does not, and its pool is asked to give
that memory back (``recall``) as soon as the head could use it. Quotas per user and per
group, and the classes each may claim, come from the configuration. No sockets here: the
service (``service.py``) calls these methods under one lock and sends what they return.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .. import priority as order
from ..host.lines import shown
from ..messages import SLUG
from .config import Limits, ServiceConfig
from .devices import Device, rooms

RECLAIM_READS_S = 0.5  # a status read looks at the entries' processes at most this often

__all__ = ["Entry", "HostLedger", "Peer", "Procs", "Refused"]

log = logging.getLogger("resident_pool.admission")
KEY = re.compile(r"[a-z0-9][a-z0-9_-]{0,39}(~[a-z0-9][a-z0-9_-]{0,39})?\[\d{1,4}\]")
RECALL_AGAIN_S = 5.0  # a recall not yet answered is said again this often (a push may be lost with its connection)
# A pool tries its waiting request again every tick (0.25 s) and on every wake: one not heard of this long is
# dropped from the line, so a stopped (SIGSTOP) or wedged pool's request cannot hold the head of it for ever.
STALE_S = 10.0
_MAX_DEPTH = 32  # a worker is the pool's child, or its zygote's: never this deep
Push = tuple[tuple[int, int], dict[str, Any]]  # (uid, pool pid): the message


class Refused(Exception):
    """A request the service answers with an error: ``reason`` and the sentence."""

    def __init__(self, message: str, reason: str = "bad_request") -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class Peer:
    """The process at the other end of a connection, as the kernel names it."""

    pid: int
    uid: int
    gid: int
    user: str
    groups: tuple[str, ...]


class Procs:
    """What the service reads of other processes (``/proc``); a test injects its own."""

    @staticmethod
    def _stat(pid: int) -> list[str] | None:
        """The fields of ``/proc/<pid>/stat`` after the command name (which may hold spaces): state first."""
        try:
            with open(f"/proc/{pid}/stat") as stat:
                return stat.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            return None

    def start_time(self, pid: int) -> int | None:
        """The pid's start time in clock ticks since boot (tells a reused pid from the one recorded)."""
        fields = self._stat(pid)
        try:
            return int(fields[19]) if fields else None
        except (ValueError, IndexError):
            return None

    def owner(self, pid: int) -> int | None:
        try:
            return os.stat(f"/proc/{pid}").st_uid
        except OSError:
            return None

    def alive(self, pid: int, started: int | None) -> bool:
        """Running, and the process recorded: a zombie nobody reaped yet (its pool died) holds no memory."""
        fields = self._stat(pid)
        if not fields or fields[0] in ("Z", "X"):
            return False
        now = self.start_time(pid)
        return now is not None and (started is None or now == started)

    def parent(self, pid: int) -> int | None:
        fields = self._stat(pid)
        try:
            return int(fields[1]) if fields else None
        except (ValueError, IndexError):
            return None


@dataclass
class Entry:
    """A budget held on a device by one worker of one user's pool."""

    uid: int
    user: str
    groups: tuple[str, ...]
    pool: int  # the pool's pid: with ``uid`` and ``key``, whose entry this is
    key: str  # the pool's name for the worker: ``slug[replica]``
    slug: str
    replica: int
    device: int
    budget_gb: float
    pid: int  # the worker once it runs, the pool while it starts
    pid_start: int | None
    priority: str
    backfilled: bool = False
    since: float = field(default_factory=time.time)
    recalled_at: float | None = None  # when its pool was asked to give it back (monotonic)
    loaded: bool = False  # its worker answered: NVML's free memory shows it (``devices.rooms``)
    pool_start: int | None = None  # the pool's start time: tells the pool from a process that took its pid
    orphaned_at: float | None = None  # monotonic: when its pool was first seen gone, its worker running on

    @property
    def owner(self) -> tuple[int, int, str]:
        return (self.uid, self.pool, self.key)

    def public(self, now: float | None = None) -> dict[str, Any]:
        """What any pool may read of it; ``orphaned_s``: how long its pool has been gone (None: it is not)."""
        orphaned = None if self.orphaned_at is None or now is None else round(now - self.orphaned_at, 3)
        return {"user": self.user, "slug": self.slug, "replica": self.replica, "device": self.device,
                "budget_gb": self.budget_gb, "pid": self.pid, "priority": self.priority,
                "backfilled": self.backfilled, "since": self.since, "loaded": self.loaded, "orphaned_s": orphaned}


@dataclass(eq=False)
class Ask:
    """A request of one pool waiting for room."""

    peer: Peer
    key: str
    slug: str
    replica: int
    need_gb: float
    device: int | None
    priority: str
    asked: str
    arrived: float  # monotonic, when the service first heard of it
    connection: int
    seen: float = 0.0  # monotonic, when its pool last asked

    @property
    def owner(self) -> tuple[int, int, str]:
        return (self.peer.uid, self.peer.pid, self.key)


@dataclass
class _Plan:
    device: int
    recall: list[Entry]
    spare_gb: float


class HostLedger:
    """Every user's budgets on this host, the line of those waiting, and the rules that place them."""

    def __init__(self, config: ServiceConfig, devices: Callable[[], tuple[list[Device], str]],
                 procs: Procs | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.devices = devices
        self.procs = procs or Procs()
        self.clock = clock  # for the orphan grace; a test's own
        self.entries: dict[tuple[int, int, str], Entry] = {}
        self._reclaimed_at = float("-inf")
        self.asks: dict[tuple[int, int, str], Ask] = {}
        self.state_path = Path(config.state_dir) / "admission-ledger.json"

    # -- the ledger on disk ------------------------------------------------------------------------------
    def load(self) -> None:
        """The entries a previous run of the service held (their processes may still run)."""
        try:
            raw = json.loads(self.state_path.read_text())
        except FileNotFoundError:
            return
        except ValueError:
            return  # a torn file from a crash: the workers' pids are gone or will be reclaimed by NVML's reading
        for item in raw if isinstance(raw, list) else []:
            try:
                entry = Entry(**{**item, "groups": tuple(item.get("groups", ())), "recalled_at": None,
                                 "orphaned_at": None})
            except TypeError:
                continue
            self.entries[entry.owner] = entry
        self.reclaim()

    def _saved(self) -> None:
        folder = self.state_path.parent
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        temp = folder / f".admission-ledger.{os.getpid()}"
        temp.write_text(json.dumps([{**asdict(e), "recalled_at": None, "orphaned_at": None}
                                    for e in self.entries.values()]))
        os.chmod(temp, 0o600)
        os.replace(temp, self.state_path)
        if self.config.audit is not None:
            with open(self.config.audit, "a") as trail:
                trail.write(json.dumps({"t": time.time(), "entries": [e.public() for e in self.entries.values()]})
                            + "\n")

    # -- who may claim what --------------------------------------------------------------------------------
    def _limits(self, peer: Peer) -> list[tuple[str, Limits, Callable[[Entry], bool]]]:
        """The quotas that bind ``peer``: its user's (or the default), and each of its groups'."""
        found: list[tuple[str, Limits, Callable[[Entry], bool]]] = [
            (f"user {peer.user}", self.config.users.get(peer.user, self.config.default),
             lambda e: e.uid == peer.uid)]
        for group in peer.groups:
            if group in self.config.groups:
                found.append((f"group {group}", self.config.groups[group],
                              lambda e, g=group: g in e.groups))
        return found

    def classes(self, peer: Peer) -> tuple[str, ...]:
        """The classes ``peer`` may claim: its user's (or the default's), and those its groups add."""
        own = self.config.users.get(peer.user, self.config.default).classes
        allowed = set(own if own is not None else order.CLASSES)
        for group in peer.groups:
            if group in self.config.groups:
                allowed |= set(self.config.groups[group].classes or ())
        return tuple(name for name in order.CLASSES if name in allowed)

    def _over(self, peer: Peer, need_gb: float) -> str | None:
        """Why ``need_gb`` more would break one of ``peer``'s quotas now; None when it would not."""
        for name, limits, counts in self._limits(peer):
            mine = [e for e in self.entries.values() if counts(e)]
            if limits.gpu_gb is not None and sum(e.budget_gb for e in mine) + need_gb > limits.gpu_gb + 1e-9:
                return (f"{name} holds {sum(e.budget_gb for e in mine):g} of its {limits.gpu_gb:g} GB quota; "
                        f"{need_gb:g} GB more waits until some is given back")
            if limits.replicas is not None and len(mine) + 1 > limits.replicas:
                return f"{name} holds {len(mine)} of its {limits.replicas} replicas quota"
        return None

    def _never(self, peer: Peer, need_gb: float, devices: list[Device], device: int | None = None) -> str | None:
        headroom = self.config.headroom_gb
        if device is not None:  # pinned (a restore): only that device counts, and it must be there
            devices = [d for d in devices if d.index == device]
            if not devices:
                return f"asks for device {device}, which this host does not have"
        largest = max((d.total_gb for d in devices), default=0.0) - headroom
        if need_gb > largest:
            return (f"needs {need_gb:g} GB but the largest device holds {largest:g} GB after {headroom:g} GB headroom; "
                    "it can never be admitted here: lower vram_budget_gb or run it on a larger GPU")
        for name, limits, _ in self._limits(peer):
            if limits.gpu_gb is not None and need_gb > limits.gpu_gb:
                return (f"needs {need_gb:g} GB but {name}'s quota is {limits.gpu_gb:g} GB in the admission "
                        "service's configuration; ask its owner to raise it")
            if limits.replicas == 0:
                return f"{name} may hold no GPU workers (replicas = 0 in the admission service's configuration)"
        return None

    # -- the line ----------------------------------------------------------------------------------------------
    def line(self, now: float) -> list[Ask]:
        """The waiting requests that could be placed within their quotas, in the order they are served."""
        for owner in [o for o, a in self.asks.items() if now - a.seen > STALE_S]:
            del self.asks[owner]
        eligible = [a for a in self.asks.values() if self._over(a.peer, a.need_gb) is None]
        if not eligible:
            for entry in self.entries.values():  # nobody waits: nothing is held ahead of anyone any more
                entry.backfilled, entry.recalled_at = False, None
        return order.in_order(eligible, now, self.config.aging_s, lambda a: a.priority, lambda a: a.arrived)

    def _room(self) -> tuple[dict[int, float], list[Device]]:
        devices, _ = self.devices()
        return rooms(devices, [e.public() for e in self.entries.values()], self.config.headroom_gb), devices

    def _plan(self, head: Ask, free: dict[int, float]) -> _Plan | None:
        """How the head gets its memory from backfilled entries (their pools give it back after a request)."""
        for device, room in sorted(free.items(), key=lambda item: -item[1]):
            if head.device is not None and device != head.device:
                continue
            here = [e for e in self.entries.values() if e.device == device and e.backfilled]
            have = room + sum(e.budget_gb for e in here if e.recalled_at is not None)
            if have >= head.need_gb:
                return _Plan(device, [], have - head.need_gb)
            chosen = []
            for entry in sorted((e for e in here if e.recalled_at is None), key=lambda e: e.since):
                chosen.append(entry)
                have += entry.budget_gb
                if have >= head.need_gb:
                    return _Plan(device, chosen, have - head.need_gb)
        return None

    def _head_plan(self, head: Ask, free: dict[int, float]) -> _Plan | None:
        """Where the head's memory comes from: room it fits in now (none of it spare for a backfill beyond what it
        leaves), or backfilled entries to recall; None when neither (it waits for non-backfilled holders)."""
        where, _ = self._fits(head, free, None)
        if where is not None:
            return _Plan(where, [], free[where] - head.need_gb)
        return self._plan(head, free)

    @staticmethod
    def _fits(ask: Ask, free: dict[int, float], plan: _Plan | None) -> tuple[int | None, dict[int, float]]:
        """Where ``ask`` fits now (most room first), and the room per device it may take."""
        usable = {d: (min(gb, plan.spare_gb) if plan is not None and d == plan.device else gb)
                  for d, gb in free.items() if ask.device is None or d == ask.device}
        fits = [(gb, -d) for d, gb in usable.items() if gb >= ask.need_gb]
        return (-max(fits)[1] if fits else None), usable

    # -- what a pool asks --------------------------------------------------------------------------------------
    def place(self, now: float, peer: Peer, connection: int, fields: dict[str, Any]) -> tuple[dict[str, Any],
                                                                                              list[Push]]:
        """Place a budget now if the line and the quotas allow; otherwise it waits in the line (and the room it
        could take is said)."""
        pushes = self.reclaim()
        key, slug, replica, need, device, asked, once = _place_fields(fields)
        owner = (peer.uid, peer.pid, key)
        if owner in self.entries:  # placed already (a retry after a lost reply): the same answer
            entry = self.entries[owner]
            return {"placed": True, "device": entry.device, "backfilled": entry.backfilled}, pushes
        free, devices = self._room()
        never = self._never(peer, need, devices, device)
        if never is not None:
            self.asks.pop(owner, None)
            raise Refused(f"{slug}: {never}", reason="admission_refused")
        priority = order.cap(asked, self.classes(peer))
        ask = self.asks.get(owner)
        if ask is None:
            if len([a for a in self.asks.values() if a.peer.pid == peer.pid and a.peer.uid == peer.uid]) \
                    >= self.config.max_asks_per_pool:
                raise Refused(f"this pool has {self.config.max_asks_per_pool} requests waiting already "
                              "(max_asks_per_pool)", reason="too_many_asks")
            ask = Ask(peer, key, slug, replica, need, device, priority, asked, now, connection)
        ask.need_gb, ask.device, ask.priority, ask.asked, ask.connection = need, device, priority, asked, connection
        ask.seen = now
        over = self._over(peer, need)
        if over is not None:
            if not once:
                self.asks[owner] = ask
            return {"placed": False, "rooms": dict.fromkeys(free, 0.0), "why": over}, pushes
        line = [a for a in self.line(now) if a is not ask]
        if once:
            where, usable = self._fits(ask, free, None)
            if where is None or line:
                return {"placed": False, "rooms": usable, "why": "no room now, or requests wait"}, pushes
            return self._book(peer, ask, where, backfilled=False), pushes
        self.asks[owner] = ask
        line = self.line(now)
        head = line[0] if line else ask
        plan = self._head_plan(head, free)
        if plan is not None and plan.recall:
            pushes += self._recall(now, head, plan.recall)
        if head is ask:
            where, usable = self._fits(ask, free, None)
        elif self.config.backfill:
            where, usable = self._fits(ask, free, plan)
        else:
            where, usable = None, dict.fromkeys(free, 0.0)
        if where is None:
            ahead = line[: line.index(ask)] if ask in line else line
            why = ("waits behind " + ", ".join(f"{a.peer.user}'s {a.slug} ({a.need_gb:g} GB, {a.priority})"
                                              for a in ahead[:3])) if ahead else \
                f"{need:g} GB needed, at most {max(free.values(), default=0.0):g} GB free on a device"
            return {"placed": False, "rooms": usable, "why": why}, pushes
        del self.asks[owner]
        return self._book(peer, ask, where, backfilled=bool(fields.get("backfill")) or head is not ask), pushes

    def _book(self, peer: Peer, ask: Ask, device: int, backfilled: bool) -> dict[str, Any]:
        started = self.procs.start_time(peer.pid)
        entry = Entry(peer.uid, peer.user, peer.groups, peer.pid, ask.key, ask.slug, ask.replica, device, ask.need_gb,
                      peer.pid, started, ask.priority, backfilled, pool_start=started)
        self.entries[entry.owner] = entry
        self._saved()
        return {"placed": True, "device": device, "backfilled": backfilled, "priority": ask.priority}

    def _recall(self, now: float, head: Ask, entries: list[Entry]) -> list[Push]:
        pushes: list[Push] = []
        for entry in entries:
            if entry.recalled_at is not None and now - entry.recalled_at < RECALL_AGAIN_S:
                continue
            entry.recalled_at = now
            pushes.append(((entry.uid, entry.pool), {
                "push": "recall", "slug": entry.slug, "replica": entry.replica,
                "why": f"backfilled: {head.peer.user}'s {head.slug} ({head.priority}, {head.need_gb:g} GB) waits for "
                       "its memory"}))
        return pushes

    def withdraw(self, peer: Peer, fields: dict[str, Any]) -> list[Push]:
        key = _key(fields.get("key"))
        if self.asks.pop((peer.uid, peer.pid, key), None) is not None:
            return self._wake(peer)
        return []

    def release(self, peer: Peer, fields: dict[str, Any]) -> list[Push]:
        """Only the pool that holds an entry gives it back: the key is looked up under the asker's own uid and pid."""
        key = _key(fields.get("key"))
        if self.entries.pop((peer.uid, peer.pid, key), None) is None:
            return []
        self._saved()
        return self._wake(peer)

    def started(self, peer: Peer, fields: dict[str, Any]) -> None:
        """The worker runs: its pid holds the entry now (so it outlives a dead pool, by the orphan grace at most).
        Only a process the pool started (its child, or a zygote's) is taken: naming another process of its user
        (a `sleep`), another user's, or pid 1 would keep a budget held past its pool."""
        key = _key(fields.get("key"))
        pid = fields.get("pid")
        entry = self.entries.get((peer.uid, peer.pid, key))
        if entry is None:
            raise Refused(f"no entry {key} of this pool to name a worker for", reason="not_yours")
        if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 1:
            raise Refused(f"started needs the worker's pid, not {shown(pid)}")
        if self.procs.owner(pid) != peer.uid:
            raise Refused(f"pid {pid} is not a process of user {peer.user}: an entry is held only by its own "
                          "worker", reason="not_yours")
        if not self._started_by(pid, peer.pid):
            raise Refused(f"pid {pid} is not a process this pool started: an entry is held only by its own worker",
                          reason="not_yours")
        entry.pid, entry.pid_start = pid, self.procs.start_time(pid)
        self._saved()

    def _started_by(self, pid: int, pool: int) -> bool:
        """Whether ``pid`` is ``pool`` or descends from it (a worker it spawned, or one its zygote forked)."""
        for _ in range(_MAX_DEPTH):
            if pid == pool:
                return True
            if pid <= 1:
                return False
            parent = self.procs.parent(pid)
            if parent is None:
                return False
            pid = parent
        return False

    def loaded(self, peer: Peer, fields: dict[str, Any]) -> None:
        """The pool's worker answered (its model is loaded): NVML's free memory shows its budget from now on."""
        key = _key(fields.get("key"))
        entry = self.entries.get((peer.uid, peer.pid, key))
        if entry is None:
            raise Refused(f"no entry {key} of this pool to say is loaded", reason="not_yours")
        if not entry.loaded:
            entry.loaded = True
            self._saved()

    def gone(self, peer: Peer, connection: int) -> list[Push]:
        """A pool's connection closed: its waiting requests leave the line; its entries stay while their pids live."""
        for owner in [o for o, a in self.asks.items() if a.connection == connection]:
            del self.asks[owner]
        return self.reclaim() + self._wake(peer)

    def reclaim(self, unless_within_s: float = 0.0) -> list[Push]:
        """Entries whose process is gone (a dead pool, a worker that exited) are given back, and so are those whose
        pool has been gone for ``orphan_grace_s`` while their worker runs on: a worker retires by then (its orphan
        watchdog), and one that does not (a request in flight for hours) is seen only through NVML's free memory.

        ``unless_within_s``: not again so soon after the last (a read that only shows the ledger: checking every
        entry's processes on each of a member's status asks would let it buy the service's time)."""
        now = self.clock()
        if now - self._reclaimed_at < unless_within_s:
            return []
        self._reclaimed_at = now
        dead = []
        for owner, entry in self.entries.items():
            if not self.procs.alive(entry.pid, entry.pid_start):
                dead.append(owner)
            elif entry.pid != entry.pool and not self.procs.alive(entry.pool, entry.pool_start):
                if entry.orphaned_at is None:
                    entry.orphaned_at = now
                elif now - entry.orphaned_at >= self.config.orphan_grace_s:
                    log.warning("%s's %s (pid %d) outlived its pool by %g s (orphan_grace_s): its %g GB booking is "
                                "given back", entry.user, entry.key, entry.pid, self.config.orphan_grace_s,
                                entry.budget_gb)
                    dead.append(owner)
        for owner in dead:
            del self.entries[owner]
        if not dead:
            return []
        self._saved()
        return self._wake(None)

    def _wake(self, peer: Peer | None) -> list[Push]:
        """Memory came back: every pool with a waiting request tries again now."""
        waiting = {(a.peer.uid, a.peer.pid) for a in self.asks.values()}
        if peer is not None:
            waiting.discard((peer.uid, peer.pid))
        return [(who, {"push": "wake"}) for who in sorted(waiting)]

    # -- what a pool reads ---------------------------------------------------------------------------------------
    def hello(self, peer: Peer) -> dict[str, Any]:
        devices, source = self.devices()
        return {"pid": os.getpid(), "user": peer.user, "uid": peer.uid, "classes": list(self.classes(peer)),
                "quota": {name: {"gpu_gb": limits.gpu_gb, "replicas": limits.replicas}
                          for name, limits, _ in self._limits(peer)},
                "devices": [{"index": d.index, "total_gb": d.total_gb, "free_gb": d.free_gb} for d in devices],
                "headroom_gb": self.config.headroom_gb, "source": source, "aging_s": self.config.aging_s,
                "backfill": self.config.backfill}

    def status(self, now: float, peer: Peer) -> dict[str, Any]:
        self.reclaim(unless_within_s=RECLAIM_READS_S)
        free, _ = self._room()
        line = self.line(now)
        waiting = []
        for position, ask in enumerate(line):
            ranks = order.effective(ask.priority, now - ask.arrived, self.config.aging_s)
            waiting.append({"position": position, "user": ask.peer.user, "slug": ask.slug, "replica": ask.replica,
                            "priority": ask.priority, "asked": ask.asked, "ranks_as": order.CLASSES[ranks],
                            "age_s": round(now - ask.arrived, 3), "needs_gb": ask.need_gb})
        over = [{"user": a.peer.user, "slug": a.slug, "needs_gb": a.need_gb, "why": self._over(a.peer, a.need_gb)}
                for a in self.asks.values() if a not in line]
        return {"entries": [e.public(now) for e in self.entries.values()], "line": waiting, "over_quota": over,
                "free": free, "you": self.hello(peer)}


def _key(value: Any) -> str:
    if not isinstance(value, str) or not KEY.fullmatch(value):
        raise Refused(f"key {shown(value)} is not a worker's name (slug[replica])")
    return value


def _place_fields(fields: dict[str, Any]) -> tuple[str, str, int, float, int | None, str, bool]:
    key = _key(fields.get("key"))
    slug, replica, need = fields.get("slug"), fields.get("replica"), fields.get("need_gb")
    device, asked = fields.get("device"), fields.get("priority", order.DEFAULT)
    if not isinstance(slug, str) or not SLUG.fullmatch(slug.split("~")[0]):
        raise Refused(f"slug {shown(slug)} is not a provider's name")
    if not isinstance(replica, int) or isinstance(replica, bool) or not 0 <= replica < 10_000:
        raise Refused(f"replica {shown(replica)} is not a replica number")
    if not isinstance(need, int | float) or isinstance(need, bool) or not 0 < need <= 100_000:
        raise Refused(f"need_gb {shown(need)} is not a GPU budget in GB")
    if device is not None and (not isinstance(device, int) or isinstance(device, bool) or device < 0):
        raise Refused(f"device {shown(device)} is not a device number")
    if not order.is_class(asked):
        raise Refused(f"priority {shown(asked)} is not a class: one of {', '.join(order.CLASSES)}")
    return key, slug, replica, float(need), device, asked, bool(fields.get("once"))
