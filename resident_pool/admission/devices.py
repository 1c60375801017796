"""The host's GPU devices and their memory: from NVML, fake NVML readings (tests, drills), or a declared capacity."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..settings import Settings

__all__ = ["GIB", "Device", "declared", "devices_from", "read_devices", "rooms"]

GIB = 1024**3


@dataclass(frozen=True)
class Device:
    index: int
    total_gb: float
    free_gb: float | None = None  # None: not measured (a declared capacity)
    # GB each process uses on it, where NVML lists them (None: not read); what a booked budget shows of itself
    used_gb: Mapping[int, float] | None = field(default=None, compare=False)


def declared(text: str) -> list[Device]:
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
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            devices.append(Device(index, memory.total / GIB, memory.free / GIB, _nvml_processes(pynvml, handle)))
        return devices
    finally:
        pynvml.nvmlShutdown()


def _nvml_processes(pynvml: Any, handle: Any) -> dict[int, float] | None:
    """GB per process on one device; None where the driver does not say (some containers, MIG)."""
    try:
        used: dict[int, float] = {}
        for process in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if process.usedGpuMemory is None:
                return None
            used[process.pid] = used.get(process.pid, 0.0) + process.usedGpuMemory / GIB
        return used
    except pynvml.NVMLError:
        return None


def _fake_nvml(path: str) -> list[Device]:
    """Readings from a JSON file, for tests and drills: {"devices": [{"total_gb": 80, "free_gb": 70}]}, with
    ``"processes": [{"pid": N, "used_gb": X}]`` per device where per-process readings are wanted."""
    data = json.loads(Path(path).read_text())
    return [Device(i, float(d["total_gb"]), float(d["free_gb"]),
                   {int(p["pid"]): float(p["used_gb"]) for p in d["processes"]} if "processes" in d else None)
            for i, d in enumerate(data["devices"])]


def read_devices(config: Settings) -> tuple[list[Device], str]:
    """The devices and where their numbers came from: fake readings, NVML, else the declared capacity (as
    ``config`` says)."""
    return devices_from(str(config.fake_nvml) if config.fake_nvml else None, config.gpu_capacity_gb)


def devices_from(fake_nvml: str | None, capacity: str | None,
                 capacity_name: str = "RESIDENT_POOL_GPU_CAPACITY_GB") -> tuple[list[Device], str]:
    """Fake NVML readings where given, else NVML, else the declared ``capacity``; and where they came from."""
    if fake_nvml:
        return _fake_nvml(fake_nvml), f"fake NVML readings from {fake_nvml}"
    devices = _nvml_devices()
    if devices:
        return devices, "NVML"
    if capacity:
        return declared(capacity), capacity_name
    return [], f"none: NVML is not readable and {capacity_name} is not set"


def rooms(devices: list[Device], booked: Iterable[Mapping[str, Any]], headroom_gb: float) -> dict[int, float]:
    """Room per device, the one rule of the per-user ledger and the host service alike: its capacity less headroom
    and what is booked there, and (where NVML reads) no more than its free memory less headroom and less what is
    booked but not visible in NVML yet (memory held outside the ledger counts, and is never counted free twice).

    ``booked``: entries with ``device``, ``budget_gb``, ``pid`` and ``loaded``. An entry's part not yet visible is
    its budget less what its processes (its pid and that pid's process group) use, where NVML lists them; where it
    does not, the whole budget until its worker has loaded (then NVML's free memory shows it)."""
    held: dict[int, float] = {}
    pending: dict[int, float] = {}
    used = {device.index: device.used_gb for device in devices}
    for entry in booked:
        index, budget = int(entry["device"]), float(entry["budget_gb"])
        held[index] = held.get(index, 0.0) + budget
        pending[index] = pending.get(index, 0.0) + _not_visible(entry, budget, used.get(index))
    found = {}
    for device in devices:
        room = device.total_gb - headroom_gb - held.get(device.index, 0.0)
        if device.free_gb is not None:
            room = min(room, device.free_gb - headroom_gb - pending.get(device.index, 0.0))
        found[device.index] = round(room, 6)
    return found


def _not_visible(entry: Mapping[str, Any], budget_gb: float, used: Mapping[int, float] | None) -> float:
    """The part of a booked budget NVML's free memory does not show yet."""
    pid = int(entry.get("pid") or 0)
    if used is not None and pid > 0:
        mine = [gb for process, gb in used.items() if process == pid or _group(process) == pid]
        if mine:
            return max(0.0, budget_gb - sum(mine))
    return 0.0 if entry.get("loaded") else budget_gb


def _group(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None  # gone since NVML listed it, or in another pid namespace
