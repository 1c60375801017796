"""Hibernation: an idle worker's device memory checkpointed to host memory, its process kept.

Through the CUDA checkpoint API of the driver (branch 570 and later), called with ctypes
on libcuda for the worker's pid: ``cuCheckpointProcessLock`` (no new CUDA work starts;
work in flight finishes), ``cuCheckpointProcessCheckpoint`` (device memory copied to host
memory and freed: the device is given back), later ``cuCheckpointProcessRestore`` (back
onto the device it had) and ``cuCheckpointProcessUnlock``. The imports, the weights and
the captured graphs all stay in the process, so a restore costs a copy back, not a start.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

__all__ = ["LOCK_TIMEOUT_MS", "CheckpointError", "CudaCheckpoint", "Hibernation", "Hibernator"]

log = logging.getLogger("resident_pool.hibernate")

# A worker between requests has no CUDA work in flight; one that cannot be locked in this long is not idle.
LOCK_TIMEOUT_MS = 10_000
_CUDA_SUCCESS = 0
_STEPS = {
    "lock": "cuCheckpointProcessLock",
    "checkpoint": "cuCheckpointProcessCheckpoint",
    "restore": "cuCheckpointProcessRestore",
    "unlock": "cuCheckpointProcessUnlock",
}


class CheckpointError(Exception):
    """A checkpoint API call failed; the message names the call, the pid and the driver's error."""


class _LockArgs(ctypes.Structure):
    # CUcheckpointLockArgs (cuda.h, 12.8): the timeout, then reserved fields that must be zero.
    _fields_ = [("timeoutMs", ctypes.c_uint), ("reserved0", ctypes.c_uint), ("reserved1", ctypes.c_uint64 * 7)]


class CudaCheckpoint:
    """The checkpoint API of one libcuda, loaded on first use."""

    def __init__(self, library: str) -> None:
        self.library = library
        self._lib: Any = None
        self._why: str | None = None
        self._loaded = False
        self._load_lock = threading.Lock()

    def unavailable(self) -> str | None:
        """Why hibernation cannot work here (no driver, a driver without the API), or None."""
        with self._load_lock:
            if not self._loaded:
                self._loaded = True
                self._why = self._load()
        return self._why

    def _load(self) -> str | None:
        try:
            lib = ctypes.CDLL(self.library)
        except OSError as exc:
            return f"the CUDA driver library {self.library} cannot be loaded ({exc})"
        missing = [name for name in _STEPS.values() if not hasattr(lib, name)]
        if missing:
            return (f"{self.library} has no {missing[0]}: the CUDA checkpoint API needs NVIDIA driver branch 570 "
                    "or later")
        result = lib.cuInit(0)
        if result != _CUDA_SUCCESS:
            return f"cuInit failed in the pool: {self._error_name(lib, result)}"
        self._lib = lib
        return None

    @staticmethod
    def _error_name(lib: Any, code: int) -> str:
        name = ctypes.c_char_p()
        try:
            if lib.cuGetErrorName(code, ctypes.byref(name)) == _CUDA_SUCCESS and name.value:
                return f"{name.value.decode(errors='replace')} ({code})"
        except AttributeError:
            pass
        return f"CUresult {code}"

    def _call(self, step: str, pid: int, args: Any = None) -> None:
        why = self.unavailable()
        if why:
            raise CheckpointError(why)
        function = getattr(self._lib, _STEPS[step])
        result = function(ctypes.c_int(pid), ctypes.byref(args) if args is not None else None)
        if result != _CUDA_SUCCESS:
            raise CheckpointError(f"{_STEPS[step]}({pid}) failed: {self._error_name(self._lib, result)}")

    def lock(self, pid: int, timeout_ms: int = LOCK_TIMEOUT_MS) -> None:
        self._call("lock", pid, _LockArgs(timeoutMs=timeout_ms))

    def checkpoint(self, pid: int) -> None:
        self._call("checkpoint", pid)

    def restore(self, pid: int) -> None:
        self._call("restore", pid)

    def unlock(self, pid: int) -> None:
        self._call("unlock", pid)


@dataclass(frozen=True)
class Hibernation:
    """A worker's hibernation: where its memory was, when, and what the checkpoint took."""

    device: str | None
    since: float  # wall clock, for display
    checkpoint_s: float

    def describe(self) -> dict[str, Any]:
        return {"device": self.device, "since": self.since, "checkpoint_s": round(self.checkpoint_s, 3)}


class Hibernator:
    """Hibernates and restores worker processes; keeps, per provider, the last word for ``status``."""

    def __init__(self, api: CudaCheckpoint) -> None:
        self.api = api
        self._notes: dict[str, str] = {}

    def hibernate(self, process: Any) -> Hibernation:
        """Lock and checkpoint ``process``; CheckpointError (it is left unlocked where it could be) says why not."""
        why = self.api.unavailable()
        if why:
            raise CheckpointError(why)
        pid = process.pid
        started = time.monotonic()
        self.api.lock(pid)
        try:
            self.api.checkpoint(pid)
        except CheckpointError:
            try:
                self.api.unlock(pid)
            except CheckpointError as exc:
                log.warning("%s: unlock after a failed checkpoint failed too: %s", process.slug, exc)
            raise
        hibernation = Hibernation(process.device, time.time(), time.monotonic() - started)
        process.note(f"hibernated: device memory checkpointed to host memory in {hibernation.checkpoint_s:.2f} s "
                     f"through {self.api.library}; the process is kept and its next lease restores it")
        return hibernation

    def restore(self, process: Any) -> float:
        """Restore and unlock ``process``; its seconds, or CheckpointError."""
        started = time.monotonic()
        self.api.restore(process.pid)
        self.api.unlock(process.pid)
        took = time.monotonic() - started
        process.note(f"restored from hibernation in {took:.2f} s")
        return took

    def noted(self, slug: str, message: str) -> None:
        self._notes[slug] = message

    def status(self, slug: str, evict: str) -> dict[str, Any]:
        """``{"evict": "hibernate"|"stop", ...}`` and, for hibernate, whether the API answers and the last word."""
        if evict != "hibernate":
            return {"evict": evict}
        state: dict[str, Any] = {"evict": evict}
        if self.api._loaded:
            state["unavailable"] = self.api._why
        if slug in self._notes:
            state["last"] = self._notes[slug]
        return state
