"""The pool's lifecycle events: one JSON line each, for `resident-pool events` to print or relay to Prefect.

The pool never imports Prefect (its memory at rest is budgeted), so it appends its events
to ``events.jsonl`` beside the transcripts, and a separate process (`resident-pool events
--to-prefect`) follows the file and emits each one. The file is private (0600 in the 0700
log folder), rotated at ``MAX_BYTES`` with one old file kept. A relay keeps its place in a
cursor file, so a restarted relay neither repeats nor skips events.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

__all__ = ["EVENTS_FILE", "MAX_BYTES", "EventLog", "Follower", "stop_cause"]

log = logging.getLogger("resident_pool.events")
EVENTS_FILE = "events.jsonl"
MAX_BYTES = 10 * 1024 * 1024
# A line longer than this is not one of ours (a corrupted file): skipped, never held in memory whole.
_MAX_LINE = 256 * 1024

# Why a worker stopped, in a word automations can match, from the sentence the pool logged.
# First match wins; the sentences are the pool's (pool.py), the test of each cause runs the real path.
_CAUSES = (
    ("idle for", "idle"),
    ("evicted", "evicted"),
    ("over its budget", "over_budget"),
    ("manifest changed", "drained"),
    ("the pool is stopping", "pool_stopping"),
    ("resident-pool stop", "stopped"),
    ("did not answer a liveness ping", "unresponsive"),
    ("outran request_timeout_s", "timeout"),
    ("abandoned request", "abandoned"),
    ("exited while idle", "died"),
    ("died mid-request", "died"),
    ("was stopped while this request ran", "stopped"),
    ("is exiting", "exited"),
)


def stop_cause(why: str | None) -> str:
    """``idle``, ``evicted``, ``drained``, ``died``... for the pool's sentence ``why``; ``other`` if none fits."""
    text = why or ""
    for needle, cause in _CAUSES:
        if needle in text:
            return cause
    return "other"


def _now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="microseconds")


class EventLog:
    """Appends events to ``path``; a write that fails is logged, never raised (events must not stop the pool)."""

    def __init__(self, path: Path, max_bytes: int = MAX_BYTES) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self.host = socket.gethostname()
        self.lock = threading.Lock()

    def emit(self, event: str, slug: str | None = None, replica: int | None = None, **payload: Any) -> dict[str, Any]:
        """Append ``resident-pool.<event>``; returns the record written."""
        record = {"id": str(uuid.uuid4()), "occurred": _now_iso(), "event": f"resident-pool.{event}",
                  "host": self.host, "pool_pid": os.getpid(), "slug": slug, "replica": replica, "payload": payload}
        line = (json.dumps(record, default=str) + "\n").encode()
        with self.lock:
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
                try:
                    os.write(fd, line)
                    size = os.fstat(fd).st_size
                finally:
                    os.close(fd)
                if size > self.max_bytes:
                    os.replace(self.path, self.path.with_name(self.path.name + ".1"))
            except OSError as exc:
                log.warning("cannot append to the event stream %s (%s); event %s dropped", self.path, exc, event)
        return record


class Follower:
    """Reads new events from an event stream across rotations, from a saved cursor when there is one.

    Without a cursor it starts at the end (an operator's first relay does not flood Prefect with
    history), or at the oldest kept event with ``from_start``.
    """

    def __init__(self, path: Path, cursor: Path | None = None, from_start: bool = False) -> None:
        self.path = path
        self.cursor = cursor
        self.handle = None
        self.inode: int | None = None
        self.buf = b""
        self.offset = 0  # of the first byte not yet handed out
        self._open_at_start(from_start)

    # -- opening -----------------------------------------------------------------
    def _open(self, path: Path, offset: int | None) -> bool:
        try:
            handle = open(path, "rb")  # noqa: SIM115 - held across polls, closed on rotation and in close()
        except OSError:
            return False
        self.close()
        self.handle, self.inode = handle, os.fstat(handle.fileno()).st_ino
        size = os.fstat(handle.fileno()).st_size
        self.offset = size if offset is None else min(offset, size)
        handle.seek(self.offset)
        self.buf = b""
        return True

    def _open_at_start(self, from_start: bool) -> None:
        saved = self._load_cursor()
        old = self.path.with_name(self.path.name + ".1")
        if saved is not None:
            for candidate in (old, self.path):
                try:
                    if candidate.stat().st_ino == saved[0]:
                        self._open(candidate, saved[1])
                        return
                except OSError:
                    continue
            # The file it pointed at is gone (rotated twice while no relay ran): the oldest kept event.
            from_start = True
        if from_start and old.exists():
            self._open(old, 0)
        else:
            self._open(self.path, 0 if from_start else None)

    def _load_cursor(self) -> tuple[int, int] | None:
        if self.cursor is None:
            return None
        try:
            data = json.loads(self.cursor.read_text())
            return int(data["inode"]), int(data["offset"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    # -- reading -------------------------------------------------------------------
    def poll(self) -> list[dict[str, Any]]:
        """Every whole event written since the last poll (switching files when the stream rotated)."""
        records: list[dict[str, Any]] = []
        if self.handle is None and not self._open(self.path, 0):
            return records
        while True:
            chunk = self.handle.read(1 << 16)
            if chunk:
                self.buf += chunk
                records += self._lines()
                continue
            try:
                current = self.path.stat().st_ino
            except OSError:
                return records  # rotated and not written since: the new file appears with the next event
            if current == self.inode:
                return records
            # Rotated: this file is read to its end; the new one is read from its start.
            if not self._open(self.path, 0):
                return records

    def _lines(self) -> list[dict[str, Any]]:
        records = []
        while True:
            newline = self.buf.find(b"\n")
            if newline < 0:
                if len(self.buf) > _MAX_LINE:
                    self.offset += len(self.buf)
                    self.buf = b""
                return records
            line, self.buf = self.buf[:newline], self.buf[newline + 1:]
            self.offset += newline + 1
            try:
                record = json.loads(line)
            except ValueError:
                log.warning("skipping a line of %s that is not JSON", self.path)
                continue
            if isinstance(record, dict) and isinstance(record.get("event"), str):
                records.append(record)

    def commit(self) -> None:
        """Save the place reached: the events polled so far were handled."""
        if self.cursor is None or self.inode is None:
            return
        temp = self.cursor.with_name(self.cursor.name + ".tmp")
        temp.write_text(json.dumps({"inode": self.inode, "offset": self.offset, "saved": time.time()}))
        os.replace(temp, self.cursor)

    def close(self) -> None:
        if self.handle is not None:
            self.handle.close()
            self.handle = None
