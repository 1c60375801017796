"""The per-user ledger of GPU budgets: a JSON file in the state directory, guarded by a file lock."""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from filelock import FileLock

from ..host.procs import pid_alive

__all__ = ["Ledger", "held"]

log = logging.getLogger("resident_pool.admission")


class Ledger:
    """What is held on each device, shared by every process that uses this file.

    Each entry: slug, replica, device, budget_gb, pid (the worker, or the pool
    while the worker starts), owner (the pool), since. An entry whose pid is
    dead is reclaimed on read, so a killed holder frees its budget at once.
    """

    def __init__(self, path: Path, audit: Path | None = None) -> None:
        """``audit``: an append-only trail of every state the ledger takes, for audits and tests."""
        self.path = path
        self.lock = FileLock(str(path) + ".lock")
        self.audit = audit

    def _read(self) -> list[dict[str, Any]]:
        try:
            entries = json.loads(self.path.read_text())
        except FileNotFoundError:
            return []
        except ValueError:
            log.warning("ledger %s is not JSON; starting it afresh", self.path)
            return []
        return [entry for entry in entries if isinstance(entry, dict)]

    def _write(self, entries: list[dict[str, Any]]) -> None:
        handle, temp = tempfile.mkstemp(dir=self.path.parent, prefix=".ledger.")
        with os.fdopen(handle, "w") as out:
            json.dump(entries, out)
        os.replace(temp, self.path)
        if self.audit:
            with open(self.audit, "a") as trail:
                trail.write(json.dumps({"t": time.time(), "entries": entries}) + "\n")

    def _ensure_dir(self) -> None:
        # The state directory can be deleted under a running pool; the lock needs its folder back.
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)

    def entries(self) -> list[dict[str, Any]]:
        """Live entries; dead ones are removed from the file as they are found."""
        self._ensure_dir()
        with self.lock:
            return self._reclaim()

    def _reclaim(self) -> list[dict[str, Any]]:
        entries = self._read()
        live = [entry for entry in entries if pid_alive(int(entry.get("pid", 0)))]
        if len(live) != len(entries):
            self._write(live)
        return live

    def change(self, edit: Callable[[list[dict[str, Any]]], list[dict[str, Any]] | None]) -> list[dict[str, Any]]:
        """Apply ``edit`` to the live entries under the lock; it returns the new list or None to keep."""
        self._ensure_dir()
        with self.lock:
            entries = self._reclaim()
            new = edit(entries)
            if new is not None:
                self._write(new)
                return new
            return entries


def held(entries: list[dict[str, Any]]) -> dict[int, float]:
    """GB held per device."""
    found: dict[int, float] = {}
    for entry in entries:
        found[entry["device"]] = found.get(entry["device"], 0.0) + float(entry["budget_gb"])
    return found
