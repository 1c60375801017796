"""What the runtime holds beside the core's records: each replica's process, each waiting client's answer."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from ..providers.hibernate import Hibernation
from ..providers.manifest import Manifest
from ..providers.worker_process import WorkerProcess
from . import actions as c
from .registry import Loaded

__all__ = ["Admitter", "Waiter", "Worker"]


class Admitter(Protocol):
    """What admitted a worker's GPU budget (the pool's admission, or CPU-only): told when the worker is gone."""

    def release(self, worker: Any) -> None: ...  # admission's own signature: it takes any worker-like record


@dataclass(eq=False)
class Worker:
    """What the runtime holds for one replica: its process, and where its GPU budget was admitted."""

    rid: int
    slug: str
    index: int
    budget_gb: float | None
    loaded: Loaded
    process: WorkerProcess
    admitter: Admitter | None = None  # what admitted its budget, told when it is gone
    hibernation: Hibernation | None = None
    stopped_on_purpose: bool = False
    env: dict[str, str] | None = None  # what admission gave it (CUDA_VISIBLE_DEVICES)
    asked: float = 0.0  # when its start began to wait for memory (monotonic)
    reported: float = 0.0  # when its client last heard what the wait is for
    waits_for: str | None = None  # the last placement's words for what it waits for

    # Admission and the ledger know a worker by slug, replica number, budget and pid.
    @property
    def replica(self) -> int:
        return self.index

    @property
    def vram_budget_gb(self) -> float | None:
        return self.budget_gb

    @property
    def manifest(self) -> Manifest:
        return self.loaded.manifest

    @property
    def pid(self) -> int | None:
        return self.process.pid


@dataclass
class Waiter:
    """A client waiting for its ticket's answer (a Grant or a Refuse), and how to tell it of a wait."""

    event: threading.Event
    progress: Callable[[dict[str, Any]], None] | None
    answer: c.Grant | c.Refuse | None = None
    tell: Callable[[dict[str, Any]], None] | None = None  # a line to its connection (a recall of its lease)
    connection: int | None = None
