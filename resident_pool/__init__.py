"""resident-pool: keep model workers warm, within a GPU memory budget."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

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

if TYPE_CHECKING:
    from .aio import AsyncPool, AsyncSession
    from .client import Pool, Session
    from .providers.supervisor import ResidentWorker

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

# Loaded on first use: every process of the pool imports this package (a model worker, the pool, a zygote, the CLI),
# and the clients' modules (settings, filelock, asyncio) cost a model worker 0.15 s of CPU at each start, for nothing.
_LAZY = {
    "AsyncPool": ".aio",
    "AsyncSession": ".aio",
    "Pool": ".client",
    "Session": ".client",
    "ResidentWorker": ".providers.supervisor",
}
# The modules a plain `import resident_pool` made attributes of the package while it loaded the clients at import
# (docs/arrays.md names `resident_pool.arrays.Array`): each is still reachable so, loaded when first named.
_SUBMODULES = frozenset({"aio", "arrays", "client", "lease", "messages", "priority", "protocol", "settings"})


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)  # the import binds it on the package
    raise AttributeError(f"module 'resident_pool' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
