"""resident-pool: keep model workers warm, within a GPU memory budget."""

from __future__ import annotations

from .errors import (
    AdmissionRefused,
    AdmissionTimeout,
    KitUnavailable,
    ManifestError,
    ResidentPoolError,
    StateDirError,
    WorkerRequestError,
    WorkerStartError,
)
from .exits import EXIT_HINTS, exit_hint
from .supervisor import ResidentWorker, child_env

__all__ = [
    "EXIT_HINTS",
    "AdmissionRefused",
    "AdmissionTimeout",
    "KitUnavailable",
    "ManifestError",
    "ResidentPoolError",
    "ResidentWorker",
    "StateDirError",
    "WorkerRequestError",
    "WorkerStartError",
    "child_env",
    "exit_hint",
]
