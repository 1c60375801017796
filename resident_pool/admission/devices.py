"""The host's GPU devices and their memory: from NVML, fake NVML readings (tests, drills), or a declared capacity."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ..settings import settings

__all__ = ["GIB", "Device", "declared", "devices_from", "read_devices", "rooms"]

GIB = 1024**3


@dataclass(frozen=True)
class Device:
    index: int
    total_gb: float
    free_gb: float | None = None  # None: not measured (a declared capacity)


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


def rooms(devices: list[Device], held: Mapping[int, float], headroom_gb: float) -> dict[int, float]:
    """Room per device: its capacity less headroom and what the ledger holds there, and (where NVML reads) no
    more than its free memory less headroom (memory held outside the ledger counts)."""
    found = {}
    for device in devices:
        room = device.total_gb - headroom_gb - held.get(device.index, 0.0)
        if device.free_gb is not None:
            room = min(room, device.free_gb - headroom_gb)
        found[device.index] = round(room, 6)
    return found
