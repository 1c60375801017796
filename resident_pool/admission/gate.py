"""Placing GPU budgets on devices: in this user's ledger, or through the host-wide admission service.

The pool's decision core decides who may try placement and when (its GPU line); this
class only does the I/O of one try: read the devices and what is held, and book the budget
where it fits (most room first), or say how much room there was. A standalone worker (no
pool) waits here instead, in ``priority.in_order``'s order, the one every line keeps.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .. import priority as order
from ..errors import AdmissionRefused, AdmissionTimeout, ResidentPoolError
from ..host.procs import pid_alive
from .devices import Device, rooms
from .ledger import Ledger
from .orphans import WAITS as ORPHAN_WAITS
from .orphans import Orphans

__all__ = ["Admission", "Placement"]

log = logging.getLogger("resident_pool.admission")
# A standalone worker's wait: another process may change the ledger; in-process releases wake it at once.
_POLL_S = 0.1


@dataclass(frozen=True)
class Placement:
    """One try's outcome: the device it was placed on, or None and the room it found."""

    device: int | None
    rooms: dict[int, float]
    backfilled: bool = False
    why: str | None = None  # not placed: what it waits for, in words


@dataclass
class _Waiter:
    slug: str
    replica: int
    budget_gb: float
    priority: str = order.DEFAULT
    arrived: float = field(default_factory=time.monotonic)
    wall: float = field(default_factory=time.time)


class Admission:
    """Books workers' budgets on devices, in the per-user ledger or (``service``) the host's one ledger."""

    def __init__(
        self,
        ledger: Ledger,
        devices: Callable[[], tuple[list[Device], str]],
        headroom_gb: float,
        holder_of: Callable[[str, int], str | None] | None = None,
        service: Any = None,
        orphans: Orphans | None = None,
    ) -> None:
        """``devices()``: the devices and where their numbers came from (``read_devices``); ``holder_of(slug,
        replica)`` names who holds a worker (a flow run), for a wait's report; ``service``: a
        ``remote.ServiceClient``, when the host admission service is in force; ``orphans``: a previous pool's
        workers this pool asks to exit, whose state a wait's report says."""
        self.ledger = ledger
        self.devices = devices
        self.headroom_gb = headroom_gb
        self.holder_of = holder_of
        self.service = service
        self.orphans = orphans
        self._cv = threading.Condition()
        self._queue: list[_Waiter] = []  # standalone workers waiting in this process

    # -- what is in force ----------------------------------------------------------------------------
    def in_force(self) -> dict[str, Any]:
        """Which ledger admits: the host service (one for every user) or this user's own."""
        if self.service is not None:
            return {"mode": "host admission service", **self.service.describe()}
        return {"mode": "per-user ledger", "ledger": str(self.ledger.path),
                "note": "other users' pools are seen only through NVML's free memory"}

    def _devices(self) -> tuple[list[Device], float, str]:
        if self.service is not None:
            devices, headroom, source = self.service.devices()
            return devices, headroom, source
        devices, source = self.devices()
        return devices, self.headroom_gb, source

    # -- one try, for the pool's core -----------------------------------------------------------------
    def check(self, slug: str, budget_gb: float) -> None:
        """Refuse at once what no device could ever hold (or where no capacity is known)."""
        devices, headroom, source = self._devices()
        if not devices:
            raise AdmissionRefused(
                f"{slug}: needs {budget_gb:g} GB of GPU memory but no GPU capacity is known ({source}); "
                "on a CPU host declare RESIDENT_POOL_GPU_CAPACITY_GB, or set [gpu] policy = \"recommended\"",
                slug=slug)
        largest = max(d.total_gb for d in devices) - headroom
        if budget_gb > largest:
            raise AdmissionRefused(
                f"{slug}: needs {budget_gb:g} GB but the largest device holds {largest:g} GB after "
                f"{headroom:g} GB headroom ({source}); it can never be admitted here: lower "
                "vram_budget_gb or run it on a larger GPU",
                slug=slug, details={"budget_gb": budget_gb, "largest_gb": largest})

    def place(self, worker: Any, need_gb: float, device: int | None = None, priority: str = order.DEFAULT,
              backfill: bool = False, waited_s: float = 0.0, once: bool = False) -> Placement:
        """Book ``need_gb`` for ``worker`` where it fits now (most room first), or say how much room there was.

        ``once``: a warm-up, placed only where it fits now and nobody waits (the host service knows who does)."""
        if self.service is not None:
            return self.service.place(_key(worker), worker.slug, worker.replica, need_gb, device, priority,
                                      backfill, waited_s, once)
        devices, _ = self.devices()
        chosen: list[int] = []
        seen: dict[int, float] = {}

        def edit(entries):
            room = rooms(devices, entries, self.headroom_gb)
            seen.update(room)
            fits = [(gb, -index) for index, gb in room.items()
                    if (device is None or index == device) and gb >= need_gb]
            if not fits:
                return None
            index = -max(fits)[1]
            chosen.append(index)
            entries.append({"slug": worker.slug, "replica": worker.replica, "device": index, "budget_gb": need_gb,
                            "pid": os.getpid(), "owner": os.getpid(), "since": time.time(), "loaded": False})
            return entries

        self.ledger.change(edit)
        if chosen:
            return Placement(chosen[0], seen, backfill)
        return Placement(None, seen, why=_short_of(need_gb, seen, device))

    def withdraw(self, worker: Any) -> None:
        """A wait ended unplaced: the host service forgets the ask (the per-user ledger never knew it)."""
        if self.service is not None:
            self.service.withdraw(_key(worker))

    def release(self, worker: Any) -> None:
        if self.service is not None:
            self.service.release(_key(worker))
        else:
            self.ledger.change(lambda entries: [
                e for e in entries if not (e["slug"] == worker.slug and e["replica"] == worker.replica
                                           and e["owner"] == os.getpid())])
        self.wake()

    def started(self, worker: Any) -> None:
        """The worker runs: its own pid now holds the entry, so it outlives a killed pool."""
        if self.service is not None:
            self.service.started(_key(worker), worker.pid)
            return

        def edit(entries):
            for entry in entries:
                if (entry["slug"], entry["replica"], entry["owner"]) == (worker.slug, worker.replica, os.getpid()):
                    entry["pid"] = worker.pid
            return entries

        self.ledger.change(edit)

    def loaded(self, worker: Any) -> None:
        """The worker answered (its model is loaded): NVML's free memory shows its budget from now on, where NVML
        does not list its process (``devices.rooms`` counts it as not yet visible until then)."""
        if self.service is not None:
            self.service.loaded(_key(worker))
            return

        def edit(entries):
            for entry in entries:
                if (entry["slug"], entry["replica"], entry["owner"]) == (worker.slug, worker.replica, os.getpid()):
                    entry["loaded"] = True
            return entries

        self.ledger.change(edit)

    def wake(self) -> None:
        with self._cv:
            self._cv.notify_all()

    def entries(self) -> list[dict[str, Any]]:
        """What is held: this user's ledger, or every user's entries in the host service."""
        if self.service is not None:
            return self.service.entries()
        return self.ledger.entries()

    # -- what a wait is for, in words ------------------------------------------------------------------
    def describe(self, slug: str, need_gb: float, waited_s: float, ahead: list[str] | None = None,
                 why: str | None = None) -> dict[str, Any]:
        devices, headroom, source = self._devices()
        entries = self.entries()
        free = rooms(devices, entries, headroom)
        return {
            "ahead": ahead or [], "slug": slug, "needs_gb": need_gb, "waited_s": round(waited_s, 1),
            "free": {index: round(gb, 2) for index, gb in free.items()},
            "holders": [_holder_line(e) + self._held_for(e) for e in entries],
            "source": source, "why": why, "admission": self.in_force()["mode"],
        }

    def _held_for(self, entry: dict[str, Any]) -> str:
        """Who holds ``entry``, said after it: a flow run of this pool, or a worker whose pool is gone and what it
        does now (a wait for it ends when it exits, not when a holder lets go)."""
        if entry.get("user") is not None:  # the host service's: another user's holder is theirs to say
            gone = entry.get("orphaned_s")
            return f", its pool gone {gone:.0f} s: {self._orphan_words(entry['pid'])}" if gone is not None else ""
        owner = entry.get("owner")
        if isinstance(owner, int) and owner != os.getpid() and not pid_alive(owner):
            return f", a worker of pool {owner}, which is gone: {self._orphan_words(entry['pid'])}"
        holder = self.holder_of(entry["slug"], entry["replica"]) if self.holder_of is not None else None
        return f" for {holder}" if holder else ""

    def _orphan_words(self, pid: int) -> str:
        return self.orphans.says(pid) if self.orphans is not None else ORPHAN_WAITS

    def timeout_error(self, slug: str, need_gb: float, waited_s: float, ahead: list[str] | None = None
                      ) -> AdmissionTimeout:
        wait = self.describe(slug, need_gb, waited_s, ahead)
        free = ", ".join(f"GPU {i}: {gb:g} GB" for i, gb in wait["free"].items())
        holders = "; ".join(wait["holders"]) or "nobody in the pool (memory is held outside it)"
        if wait["ahead"]:
            holders += "; queued ahead of it: " + ", ".join(wait["ahead"])
        return AdmissionTimeout(
            f"{slug}: waited {wait['waited_s']:g} s for {need_gb:g} GB of GPU memory; "
            f"free now: {free}; held by: {holders}. Raise admission_timeout_s, stop a holder "
            "(`resident-pool stop SLUG`), or lower vram_budget_gb",
            slug=slug, details=wait)

    # -- a standalone worker waits here --------------------------------------------------------------------
    def admit(self, worker, timeout_s: float | None = None, device: int | None = None, wait: bool = True,
              on_wait: Callable[[dict[str, Any]], None] | None = None,
              cancelled: Callable[[], bool] | None = None, priority: str = order.DEFAULT) -> Mapping[str, str]:
        """Block until ``worker``'s budget fits on a device; return its CUDA_VISIBLE_DEVICES.

        For workers outside the pool (``ResidentWorker``): waiters of this process take turns in
        ``priority.in_order``'s order. ``on_wait(report)`` hears every few seconds what the wait is for;
        ``cancelled()`` True ends the wait (reason ``client_gone``). ``device``: only that one.
        ``wait=False``: placed only if it fits now, behind nobody; otherwise ``AdmissionTimeout`` with reason
        ``no_room`` at once.
        """
        budget = float(worker.vram_budget_gb)
        timeout_s = timeout_s if timeout_s is not None else _admission_timeout(worker)
        self.check(worker.slug, budget)
        ticket = _Waiter(worker.slug, worker.replica, budget, priority)
        deadline = ticket.arrived + timeout_s
        last_report = 0.0
        with self._cv:
            self._queue.append(ticket)
        try:
            while True:
                with self._cv:
                    first = self._in_order()[0] is ticket
                if first:
                    placement = self.place(worker, budget, device, priority)
                    if placement.device is not None:
                        return {"CUDA_VISIBLE_DEVICES": str(placement.device)}
                if not wait:
                    raise AdmissionTimeout(
                        f"{worker.slug}: no room now for {budget:g} GB of GPU memory"
                        + (" (requests wait ahead)" if not first else "")
                        + "; a warm-up does not wait, queue or evict: it tries again later",
                        slug=worker.slug, reason="no_room")
                now = time.monotonic()
                if now >= deadline:
                    raise self.timeout_error(worker.slug, budget, now - ticket.arrived, self._ahead(ticket))
                if cancelled is not None and cancelled():
                    raise ResidentPoolError(f"{worker.slug}: the client waiting for admission went away",
                                            slug=worker.slug, reason="client_gone")
                if on_wait is not None and now - last_report >= 5.0:
                    last_report = now
                    on_wait(self.describe(worker.slug, budget, now - ticket.arrived, self._ahead(ticket)))
                with self._cv:
                    self._cv.wait(min(_POLL_S, deadline - now))
        finally:
            with self._cv:
                self._queue.remove(ticket)
                self._cv.notify_all()

    def _in_order(self) -> list[_Waiter]:
        return order.in_order(self._queue, time.monotonic(), 0.0, lambda w: w.priority, lambda w: w.arrived)

    def _ahead(self, ticket: _Waiter) -> list[str]:
        with self._cv:
            line = self._in_order()
        return [f"{t.slug}[{t.replica}] ({t.budget_gb:g} GB)" for t in line[: line.index(ticket)]]

    def waiting(self) -> list[dict[str, Any]]:
        """Standalone workers waiting in this process, in order."""
        now = time.monotonic()
        with self._cv:
            line = self._in_order()
        return [{"position": n, "slug": t.slug, "replica": t.replica, "needs_gb": t.budget_gb,
                 "priority": t.priority, "waited_s": round(now - t.arrived, 3), "since": t.wall}
                for n, t in enumerate(line)]


def _key(worker: Any) -> str:
    return f"{worker.slug}[{worker.replica}]"


def _holder_line(entry: dict[str, Any]) -> str:
    user = f"{entry['user']}: " if entry.get("user") is not None else ""
    backfilled = ", backfilled" if entry.get("backfilled") else ""
    return (f"{user}{entry['slug']}[{entry['replica']}] {entry['budget_gb']:g} GB on GPU {entry['device']} "
            f"(pid {entry['pid']}{backfilled})")


def _short_of(need_gb: float, seen: dict[int, float], device: int | None) -> str:
    where = {i: gb for i, gb in seen.items() if device is None or i == device}
    if not where:
        return f"no device{'' if device is None else f' {device}'} to place {need_gb:g} GB on"
    best = max(where.values())
    return f"{need_gb:g} GB needed, at most {max(best, 0.0):g} GB free on a device"


def _admission_timeout(worker) -> float:
    manifest = getattr(worker, "manifest", None)
    return manifest.lifecycle.admission_timeout_s if manifest is not None else 3600.0
