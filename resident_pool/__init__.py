"""resident-pool: keep model workers warm, within a GPU memory budget."""

from __future__ import annotations

from typing import Any

from .aio import AsyncPool, AsyncSession
from .client import Pool, Session
from .errors import (
    AdmissionRefused,
    AdmissionTimeout,
    GoldenMismatch,
    KitUnavailable,
    ManifestError,
    PoolStopping,
    RequestTimeout,
    ResidentPoolError,
    StateDirError,
    WorkerRequestError,
    WorkerStartError,
)
from .exits import EXIT_HINTS, exit_hint
from .host.procs import child_env
from .version import __version__

__all__ = [
    "EXIT_HINTS",
    "AdmissionRefused",
    "AdmissionTimeout",
    "AsyncPool",
    "AsyncSession",
    "GoldenMismatch",
    "KitUnavailable",
    "ManifestError",
    "Pool",
    "PoolStopping",
    "RequestTimeout",
    "ResidentPoolError",
    "ResidentWorker",
    "Session",
    "StateDirError",
    "WorkerRequestError",
    "WorkerStartError",
    "__version__",
    "child_env",
    "exit_hint",
]


def __getattr__(name: str) -> Any:
    # The standalone supervisor is the server side: a client that never asks for it never loads it.
    if name == "ResidentWorker":
        from .providers.supervisor import ResidentWorker

        return ResidentWorker
    raise AttributeError(f"module 'resident_pool' has no attribute {name!r}")
