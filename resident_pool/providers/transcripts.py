"""Transcripts: one file per worker start, holding its output and the pool's notes about it."""

from __future__ import annotations

import os
import re
import secrets
import threading
import time
from pathlib import Path

__all__ = ["TAIL_LINES", "Transcript", "read_tail", "render_tail", "without_controls"]

TAIL_LINES = 20
# How many of the tail's lines an error message quotes; the whole tail stays on the error as data.
MESSAGE_LINES = 5
_TAIL_BYTES = 64 * 1024


class Transcript:
    """A worker's transcript, open for appending: the child writes to it, the pool adds notes."""

    def __init__(self, path: Path, handle) -> None:
        self.path = path
        self._handle = handle
        self._lock = threading.Lock()

    @classmethod
    def create(cls, directory: Path, slug: str, replica: int) -> Transcript:
        """A new file of its own: ``<slug>-<replica>-<time>-<random>.log``, never shared by two starts."""
        stamp = time.strftime("%Y%m%d-%H%M%S")
        while True:
            path = directory / f"{slug}-{replica}-{stamp}-{secrets.token_hex(3)}.log"
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_CLOEXEC, 0o600)
            except FileExistsError:
                continue
            return cls(path, os.fdopen(fd, "a", buffering=1, encoding="utf-8", errors="replace"))

    @classmethod
    def append_to(cls, path: Path) -> Transcript:
        """A transcript file a caller chose (``ResidentWorker(log_path=...)``), appended to."""
        path.parent.mkdir(parents=True, exist_ok=True)
        return cls(path, open(path, "a", buffering=1, encoding="utf-8", errors="replace"))

    def fileno(self) -> int:
        return self._handle.fileno()

    def note(self, message: str) -> None:
        """A line from the pool's side; a closed transcript or a full disk drops it quietly."""
        with self._lock:
            if self._handle.closed:
                return
            try:
                self._handle.write(f"--- resident-pool {time.strftime('%H:%M:%S')}: {message}\n")
            except OSError:
                pass  # a full disk must not turn a stop into a crash

    def close(self) -> None:
        with self._lock:
            try:
                self._handle.close()
            except OSError:
                pass

    def tail(self, lines: int = TAIL_LINES) -> list[str]:
        return read_tail(self.path, lines)


# What a worker's text may carry to move a terminal or hide what a line says: C0 controls but tab and
# newline, DEL, C1 controls (an 8-bit CSI starts an escape sequence too), and the Unicode direction
# overrides and isolates that make a line read other than it is.
_CONTROLS = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def without_controls(text: str) -> str:
    """Text from a worker, a transcript or a payload, safe to print to a terminal or a page."""
    return _CONTROLS.sub("", text)


def read_tail(path: str | os.PathLike[str] | None, lines: int = TAIL_LINES) -> list[str]:
    """The last ``lines`` lines of a transcript, read from its end."""
    if not path:
        return []
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            size = handle.tell()
            handle.seek(max(0, size - _TAIL_BYTES))
            data = handle.read()
    except OSError:
        return []
    return data.decode("utf-8", "replace").splitlines()[-lines:] if lines > 0 else []


def render_tail(tail: list[str], lines: int = MESSAGE_LINES) -> str:
    """The end of a message that quotes a transcript's last lines; empty when there are none."""
    if not tail:
        return ""
    return "\n  last lines:\n    " + "\n    ".join(tail[-lines:])
