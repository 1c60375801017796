"""A standalone worker's states and the moves allowed between them; no internal imports."""

from __future__ import annotations

import enum

__all__ = ["WORKER_EDGES", "WorkerState"]


class WorkerState(enum.StrEnum):
    """A standalone ``ResidentWorker``'s state."""

    STOPPED = "stopped"  # never started, or stopped on purpose
    STARTING = "starting"
    READY = "ready"
    BUSY = "busy"
    STOPPING = "stopping"
    EXITED = "exited"  # the process ended on its own (or was replaced after a timeout)
    FAILED = "failed"  # the last start failed


# The only moves a standalone worker may make; anything else is a bug and raises.
WORKER_EDGES: dict[WorkerState, frozenset[WorkerState]] = {
    WorkerState.STOPPED: frozenset({WorkerState.STARTING}),
    # A stop from another thread may come while a start runs; the start then ends without READY.
    WorkerState.STARTING: frozenset({WorkerState.READY, WorkerState.FAILED, WorkerState.STOPPING}),
    # EXITED: found dead (or without its socket) before a request.
    WorkerState.READY: frozenset({WorkerState.BUSY, WorkerState.STOPPING, WorkerState.EXITED}),
    # EXITED: it died, said it was exiting, or outran its timeout and was replaced.
    WorkerState.BUSY: frozenset({WorkerState.READY, WorkerState.STOPPING, WorkerState.EXITED}),
    WorkerState.STOPPING: frozenset({WorkerState.STOPPED}),
    # The next request starts it again; a stop still cleans up after it.
    WorkerState.EXITED: frozenset({WorkerState.STARTING, WorkerState.STOPPING}),
    WorkerState.FAILED: frozenset({WorkerState.STARTING, WorkerState.STOPPING}),
}
