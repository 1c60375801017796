"""A standalone worker's states; no internal imports."""

from __future__ import annotations

import enum

__all__ = ["WorkerState"]


class WorkerState(enum.StrEnum):
    """A standalone ``ResidentWorker``'s state."""

    STOPPED = "stopped"  # never started, or stopped on purpose
    STARTING = "starting"
    READY = "ready"
    BUSY = "busy"
    STOPPING = "stopping"
    EXITED = "exited"  # the process ended on its own
    FAILED = "failed"  # the last start failed
