"""resident-pool: keep model workers warm, within a GPU memory budget."""

from __future__ import annotations

from .client import Pool, Session
from .errors import (
    AdmissionRefused,
    AdmissionTimeout,
    GoldenMismatch,
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
    "GoldenMismatch",
    "KitUnavailable",
    "ManifestError",
    "Pool",
    "ResidentPoolError",
    "ResidentWorker",
    "Session",
    "StateDirError",
    "WorkerRequestError",
    "WorkerStartError",
    "child_env",
    "exit_hint",
]
