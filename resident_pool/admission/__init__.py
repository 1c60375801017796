"""GPU admission: device capacity, the host's ledger of what is held, and the waiting queue."""

from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from filelock import FileLock

from ..errors import AdmissionRefused, AdmissionTimeout, ResidentPoolError
from ..host.procs import pid_alive
from ..settings import settings

__all__ = ["Admission", "Device", "Ledger", "read_devices"]

log = logging.getLogger("resident_pool.admission")
GIB = 1024**3
# Another process may change the ledger; in-process releases wake waiters at once.
_POLL_S = 0.1


@dataclass(frozen=True)
class Device:
    index: int
    total_gb: float
    free_gb: float | None = None  # None: not measured (a declared capacity)


def _declared(text: str) -> list[Device]:
    """``80`` (one device) or ``0:80,1:80``."""
    devices = []
    for number, part in enumerate(p.strip() for p in text.split(",") if p.strip()):
        index, _, size = part.rpartition(":")
        devices.append(Device(int(index) if index else number, float(size)))
    return devices


def _nvml_devices() -> list[Device] | None:
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return None
    try:
        devices = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            memory = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(index))
            devices.append(Device(index, memory.total / GIB, memory.free / GIB))
        return devices
    finally:
        pynvml.nvmlShutdown()


def _fake_nvml(path: str) -> list[Device]:
    """Readings from a JSON file, for tests and drills: {"devices": [{"total_gb": 80, "free_gb": 70}]}."""
    data = json.loads(Path(path).read_text())
    return [Device(i, float(d["total_gb"]), float(d["free_gb"])) for i, d in enumerate(data["devices"])]


def read_devices() -> tuple[list[Device], str]:
    """The devices and where their numbers came from: NVML, else the declared capacity."""
    config = settings()
    if config.fake_nvml:
        return _fake_nvml(str(config.fake_nvml)), f"fake NVML readings from {config.fake_nvml}"
    devices = _nvml_devices()
    if devices:
        return devices, "NVML"
    declared = config.gpu_capacity_gb
    if declared:
        return _declared(declared), "RESIDENT_POOL_GPU_CAPACITY_GB"
    return [], "none: NVML is not readable and RESIDENT_POOL_GPU_CAPACITY_GB is not set"


class Ledger:
    """What is held on each device, shared by every process that uses this file.

    Each entry: slug, replica, device, budget_gb, pid (the worker, or the pool
    while the worker starts), owner (the pool), since. An entry whose pid is
    dead is reclaimed on read, so a killed holder frees its budget at once.
    """

    def __init__(self, path: Path, audit: Path | None = None) -> None:
        """``audit``: an append-only trail of every state the ledger takes, for audits and tests."""
        self.path = path
        self.lock = FileLock(str(path) + ".lock")
        self.audit = audit

    def _read(self) -> list[dict[str, Any]]:
        try:
            entries = json.loads(self.path.read_text())
        except FileNotFoundError:
            return []
        except ValueError:
            log.warning("ledger %s is not JSON; starting it afresh", self.path)
            return []
        return [entry for entry in entries if isinstance(entry, dict)]

    def _write(self, entries: list[dict[str, Any]]) -> None:
        handle, temp = tempfile.mkstemp(dir=self.path.parent, prefix=".ledger.")
        with os.fdopen(handle, "w") as out:
            json.dump(entries, out)
        os.replace(temp, self.path)
        if self.audit:
            with open(self.audit, "a") as trail:
                trail.write(json.dumps({"t": time.time(), "entries": entries}) + "\n")

    def _ensure_dir(self) -> None:
        # The state directory can be deleted under a running pool; the lock needs its folder back.
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)

    def entries(self) -> list[dict[str, Any]]:
        """Live entries; dead ones are removed from the file as they are found."""
        self._ensure_dir()
        with self.lock:
            return self._reclaim()

    def _reclaim(self) -> list[dict[str, Any]]:
        entries = self._read()
        live = [entry for entry in entries if pid_alive(int(entry.get("pid", 0)))]
        if len(live) != len(entries):
            self._write(live)
        return live

    def change(self, edit: Callable[[list[dict[str, Any]]], list[dict[str, Any]] | None]) -> list[dict[str, Any]]:
        """Apply ``edit`` to the live entries under the lock; it returns the new list or None to keep."""
        self._ensure_dir()
        with self.lock:
            entries = self._reclaim()
            new = edit(entries)
            if new is not None:
                self._write(new)
                return new
            return entries


@dataclass
class _Ticket:
    slug: str
    replica: int
    budget_gb: float
    device: int | None = None  # placed on this device only
    arrived: float = field(default_factory=time.monotonic)
    wall: float = field(default_factory=time.time)


class Admission:
    """Admits workers onto devices; those that do not fit wait, first come first served."""

    def __init__(
        self,
        ledger: Ledger,
        evict: Callable[[float], bool] | None = None,
        devices: Callable[[], tuple[list[Device], str]] = read_devices,
        headroom_gb: float | None = None,
        holder_of: Callable[[str, int], str | None] | None = None,
    ) -> None:
        """``evict(needed_gb)`` makes room (True when it stopped an idle worker); ``holder_of(slug, replica)``
        names who holds a worker (a flow run), for a wait's report."""
        self.ledger = ledger
        self.evict = evict
        self.devices = devices
        self.headroom_gb = settings().gpu_headroom_gb if headroom_gb is None else headroom_gb
        self.holder_of = holder_of
        self._cv = threading.Condition()
        self._queue: list[_Ticket] = []

    # -- what the supervisor calls ------------------------------------------
    def admit(self, worker, timeout_s: float | None = None, device: int | None = None, wait: bool = True,
              on_wait: Callable[[dict[str, Any]], None] | None = None,
              cancelled: Callable[[], bool] | None = None) -> Mapping[str, str]:
        """Block until ``worker``'s budget fits on a device; return its CUDA_VISIBLE_DEVICES.

        ``on_wait(report)`` hears every few seconds what the wait is for; ``cancelled()`` is asked while
        it waits: True when whoever asked is gone (the wait then ends with reason ``client_gone``).

        ``device``: only that one (a hibernated worker's memory goes back where it was).
        ``wait=False`` (a warm-up of the pool's own): place it only if it fits now, behind nobody and
        evicting nobody; otherwise ``AdmissionTimeout`` with reason ``no_room`` at once.
        """
        budget = float(worker.vram_budget_gb)
        timeout_s = timeout_s if timeout_s is not None else _admission_timeout(worker)
        devices, source = self.devices()
        if not devices:
            raise AdmissionRefused(
                f"{worker.slug}: needs {budget:g} GB of GPU memory but no GPU capacity is known ({source}); "
                "on a CPU host declare RESIDENT_POOL_GPU_CAPACITY_GB, or set [gpu] policy = \"recommended\"",
                slug=worker.slug,
            )
        largest = max(d.total_gb for d in devices) - self.headroom_gb
        if budget > largest:
            raise AdmissionRefused(
                f"{worker.slug}: needs {budget:g} GB but the largest device holds {largest:g} GB after "
                f"{self.headroom_gb:g} GB headroom ({source}); it can never be admitted here: lower "
                "vram_budget_gb or run it on a larger GPU",
                slug=worker.slug, details={"budget_gb": budget, "largest_gb": largest},
            )
        ticket = _Ticket(worker.slug, worker.replica, budget, device)
        deadline = ticket.arrived + timeout_s
        last_report = 0.0
        with self._cv:
            self._queue.append(ticket)
        try:
            while True:
                with self._cv:
                    first = self._queue[0] is ticket
                if first:
                    device = self._try_place(ticket, worker)
                    if device is not None:
                        return {"CUDA_VISIBLE_DEVICES": str(device)}
                    if wait and self.evict is not None and self.evict(budget):
                        continue  # an idle worker is being stopped; its release wakes us
                if not wait:
                    raise AdmissionTimeout(
                        f"{worker.slug}: no room now for {budget:g} GB of GPU memory"
                        + (" (requests wait ahead)" if not first else "")
                        + "; a warm-up does not wait, queue or evict: it tries again later",
                        slug=worker.slug, reason="no_room")
                now = time.monotonic()
                if now >= deadline:
                    raise self._timeout(ticket, now)
                if cancelled is not None and cancelled():
                    raise ResidentPoolError(f"{worker.slug}: the client waiting for admission went away",
                                            slug=worker.slug, reason="client_gone")
                if on_wait is not None and now - last_report >= 5.0:
                    last_report = now
                    on_wait(self._describe_wait(ticket, now))
                with self._cv:
                    self._cv.wait(min(_POLL_S, deadline - now))
        finally:
            with self._cv:
                self._queue.remove(ticket)
                self._cv.notify_all()

    def release(self, worker) -> None:
        self.ledger.change(lambda entries: [
            e for e in entries if not (e["slug"] == worker.slug and e["replica"] == worker.replica
                                       and e["owner"] == os.getpid())
        ])
        self.wake()

    def started(self, worker) -> None:
        """The worker runs: its own pid now holds the entry, so it outlives a killed pool."""
        def edit(entries):
            for entry in entries:
                if (entry["slug"], entry["replica"], entry["owner"]) == (worker.slug, worker.replica, os.getpid()):
                    entry["pid"] = worker.pid
            return entries

        self.ledger.change(edit)

    def wake(self) -> None:
        with self._cv:
            self._cv.notify_all()

    # -- placement ------------------------------------------------------------
    def _try_place(self, ticket: _Ticket, worker) -> int | None:
        devices, _ = self.devices()

        def edit(entries):
            held = _held(entries)
            fits = []
            for device in devices:
                if ticket.device is not None and device.index != ticket.device:
                    continue
                room = device.total_gb - self.headroom_gb - held.get(device.index, 0.0)
                if device.free_gb is not None:
                    room = min(room, device.free_gb - self.headroom_gb)
                if room >= ticket.budget_gb:
                    fits.append((room, device.index))
            if not fits:
                return None
            _, index = max(fits)  # most room first
            chosen.append(index)
            entries.append({"slug": ticket.slug, "replica": ticket.replica, "device": index,
                            "budget_gb": ticket.budget_gb, "pid": os.getpid(), "owner": os.getpid(),
                            "since": time.time()})
            return entries

        chosen: list[int] = []
        self.ledger.change(edit)
        return chosen[0] if chosen else None

    def fits_if_freed(self, needed_gb: float, freed_gb: Mapping[int, float]) -> bool:
        """Whether ``needed_gb`` would fit on some device once ``freed_gb`` (budgets per device) is given back."""
        devices, _ = self.devices()
        held = _held(self.ledger.entries())
        for device in devices:
            freed = freed_gb.get(device.index, 0.0)
            room = device.total_gb - self.headroom_gb - held.get(device.index, 0.0) + freed
            if device.free_gb is not None:
                room = min(room, device.free_gb - self.headroom_gb + freed)
            if room >= needed_gb:
                return True
        return False

    def _describe_wait(self, ticket: _Ticket, now: float) -> dict[str, Any]:
        devices, source = self.devices()
        entries = self.ledger.entries()
        held = _held(entries)
        with self._cv:
            ahead = [f"{t.slug}[{t.replica}] ({t.budget_gb:g} GB)" for t in self._queue[: self._queue.index(ticket)]]
        return {
            "ahead": ahead,
            "slug": ticket.slug, "needs_gb": ticket.budget_gb, "waited_s": round(now - ticket.arrived, 1),
            "free": {d.index: round(min(d.total_gb - self.headroom_gb - held.get(d.index, 0.0),
                                        d.free_gb - self.headroom_gb if d.free_gb is not None else float("inf")), 2)
                     for d in devices},
            "holders": [f"{e['slug']}[{e['replica']}] {e['budget_gb']:g} GB on GPU {e['device']} (pid {e['pid']})"
                        + self._held_for(e) for e in entries],
            "source": source,
        }

    def _held_for(self, entry: dict[str, Any]) -> str:
        holder = self.holder_of(entry["slug"], entry["replica"]) if self.holder_of is not None else None
        return f" for {holder}" if holder else ""

    def _timeout(self, ticket: _Ticket, now: float) -> AdmissionTimeout:
        wait = self._describe_wait(ticket, now)
        free = ", ".join(f"GPU {i}: {gb:g} GB" for i, gb in wait["free"].items())
        holders = "; ".join(wait["holders"]) or "nobody in the pool (memory is held outside it)"
        if wait["ahead"]:
            holders += "; queued ahead of it: " + ", ".join(wait["ahead"])
        return AdmissionTimeout(
            f"{ticket.slug}: waited {wait['waited_s']:g} s for {ticket.budget_gb:g} GB of GPU memory; "
            f"free now: {free}; held by: {holders}. Raise admission_timeout_s, stop a holder "
            "(`resident-pool stop SLUG`), or lower vram_budget_gb",
            slug=ticket.slug, details=wait,
        )

    def waiting(self) -> list[dict[str, Any]]:
        now = time.monotonic()
        with self._cv:
            return [{"position": n, "slug": t.slug, "replica": t.replica, "needs_gb": t.budget_gb,
                     "waited_s": round(now - t.arrived, 3), "since": t.wall} for n, t in enumerate(self._queue)]


def _held(entries) -> dict[int, float]:
    held: dict[int, float] = {}
    for entry in entries:
        held[entry["device"]] = held.get(entry["device"], 0.0) + float(entry["budget_gb"])
    return held


def _admission_timeout(worker) -> float:
    manifest = getattr(worker, "manifest", None)
    return manifest.lifecycle.admission_timeout_s if manifest is not None else 3600.0
