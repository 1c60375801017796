"""Measured GPU memory per worker: NVML's per-process usage, summed over each worker's process group.

The budget a manifest declares is a promise; this is what the card says. A worker's
process group holds the worker and its children (DataLoader workers, a kit's helpers),
so their memory counts against its budget too. A docker or podman worker runs outside
the pool's process tree and is not measured (shown as unknown).
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

__all__ = ["GIB", "Peaks", "budget_advice", "group_usage", "process_usage"]

log = logging.getLogger("resident_pool.gpu_memory")
GIB = 1024**3
# NVML cannot be read here (no driver, no GPU): ask again this rarely rather than on every sample.
_RETRY_NVML_S = 60.0
# A budget this many times the measured peak, and this much above it, wastes the card.
TOO_HIGH_RATIO, TOO_HIGH_MARGIN_GB = 1.5, 2.0


def process_usage(fake_nvml: Path | None = None) -> tuple[dict[int, int] | None, str]:
    """Bytes used per pid on every device, and where the numbers came from; None where unreadable."""
    if fake_nvml is not None:
        return _fake(fake_nvml), f"fake NVML readings from {fake_nvml}"
    return _NVML.usage(), "NVML"


def _fake(path: Path) -> dict[int, int] | None:
    """``{"devices": [{"total_gb", "free_gb", "processes": [{"pid": N, "used_gb": X}]}]}``, as admission reads it."""
    try:
        data = json.loads(path.read_text())
        usage: dict[int, int] = {}
        for device in data["devices"]:
            for process in device.get("processes", ()):
                pid = int(process["pid"])
                usage[pid] = usage.get(pid, 0) + int(float(process["used_gb"]) * GIB)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("fake NVML readings %s cannot be read (%s); GPU memory is not measured", path, exc)
        return None
    return usage


class _Nvml:
    """NVML initialised once for the pool's life (an init per sample costs tens of ms)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.ready = False
        self.failed_at: float | None = None

    def usage(self) -> dict[int, int] | None:
        with self.lock:
            try:
                import pynvml
            except ImportError:
                return None
            if not self.ready:
                if self.failed_at is not None and time.monotonic() - self.failed_at < _RETRY_NVML_S:
                    return None
                try:
                    pynvml.nvmlInit()
                except pynvml.NVMLError:
                    self.failed_at = time.monotonic()
                    return None
                self.ready = True
            usage: dict[int, int] = {}
            try:
                for index in range(pynvml.nvmlDeviceGetCount()):
                    handle = pynvml.nvmlDeviceGetHandleByIndex(index)
                    for process in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                        # None where the driver withholds it (some containers, MIG without privileges).
                        if process.usedGpuMemory is not None:
                            usage[process.pid] = usage.get(process.pid, 0) + int(process.usedGpuMemory)
            except pynvml.NVMLError as exc:
                log.warning("NVML per-process reading failed (%s); GPU memory is not measured this time", exc)
                return None
            return usage


_NVML = _Nvml()


def group_usage(usage: dict[int, int], pgid: int) -> int:
    """Bytes held by the processes of group ``pgid`` (a worker and its children)."""
    total = 0
    for pid, used in usage.items():
        try:
            group = os.getpgid(pid)
        except OSError:
            continue  # gone since NVML listed it, or in another pid namespace
        if group == pgid:
            total += used
    return total


def budget_advice(budget_gb: float | None, peak_gb: float | None) -> str | None:
    """A sentence when the declared budget is far from the measured peak, else None."""
    if budget_gb is None or peak_gb is None:
        return None
    if peak_gb > budget_gb:
        return (f"measured peak {peak_gb:.2f} GB is above vram_budget_gb = {budget_gb:g}: neighbours admitted "
                f"beside it may run out of memory; raise vram_budget_gb to at least {peak_gb:.1f}")
    if budget_gb > TOO_HIGH_RATIO * peak_gb and budget_gb - peak_gb > TOO_HIGH_MARGIN_GB:
        return (f"vram_budget_gb = {budget_gb:g} is {budget_gb / max(peak_gb, 0.01):.1f}x the measured peak "
                f"{peak_gb:.2f} GB: the card is held for nothing; consider about {max(1.0, peak_gb * 1.2):.1f}")
    return None


class Peaks:
    """Each provider's measured peak, kept across pool restarts (a JSON file, replaced whole)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.lock = threading.Lock()
        self.peaks: dict[str, dict[str, Any]] = self._load()

    def _load(self) -> dict[str, dict[str, Any]]:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            log.warning("measured peaks %s cannot be read (%s); starting afresh", self.path, exc)
            return {}
        if not isinstance(data, dict):
            return {}
        return {slug: entry for slug, entry in data.items() if isinstance(entry, dict)}

    def get(self, slug: str, version: str) -> float | None:
        """The provider's peak for this version of it (new weights or code measure afresh)."""
        with self.lock:
            entry = self.peaks.get(slug)
        if entry is None or entry.get("version") != version:
            return None
        return entry.get("peak_gb")

    def observe(self, slug: str, version: str, used_gb: float, budget_gb: float | None) -> bool:
        """Record ``used_gb`` if it is a new peak; True when it was."""
        with self.lock:
            entry = self.peaks.get(slug)
            if entry is not None and entry.get("version") == version and entry.get("peak_gb", 0.0) >= used_gb:
                return False
            self.peaks[slug] = {"version": version, "peak_gb": round(used_gb, 3), "budget_gb": budget_gb,
                                "measured": time.time()}
            snapshot = dict(self.peaks)
        try:
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            handle, temp = tempfile.mkstemp(dir=self.path.parent, prefix=".gpu-peaks.")
            with os.fdopen(handle, "w") as out:
                json.dump(snapshot, out)
            os.replace(temp, self.path)
        except OSError as exc:
            log.warning("cannot record measured peaks in %s (%s); they last until the pool exits", self.path, exc)
        return True
