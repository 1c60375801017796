"""Log retention: each provider's transcripts capped by count and size, the background pool's own log rotated.

One transcript per worker start (and so one per request for a ``mode = "subprocess"``
provider) would otherwise fill the disk. The oldest go first; a transcript a live worker
writes, or that any of this user's processes holds open, is never removed: it is the one
an operator needs when that worker fails.
"""

from __future__ import annotations

import logging
import os
import re
from logging.handlers import RotatingFileHandler
from pathlib import Path

__all__ = ["POOL_LOG_BACKUPS", "PoolLogHandler", "open_files", "prune_transcripts", "transcript_slugs"]

log = logging.getLogger("resident_pool.retention")
POOL_LOG_BACKUPS = 3
# Transcripts.create names: <slug>-<replica>-<YYYYmmdd-HHMMSS>-<6 hex>.log
_TAIL = r"-\d+-\d{8}-\d{6}-[0-9a-f]{6}\.log"
_ANY = re.compile(r"([a-z0-9][a-z0-9_-]{0,39})" + _TAIL)


def transcript_slugs(directory: Path) -> set[str]:
    """The providers with transcripts in ``directory``."""
    try:
        names = os.listdir(directory)
    except OSError:
        return set()
    return {match.group(1) for match in map(_ANY.fullmatch, names) if match}


def _transcripts(directory: Path, slug: str) -> list[tuple[float, int, Path]]:
    """(mtime, size, path) of ``slug``'s transcripts, newest first; the fixed tail keeps slug "a" off "a-b"."""
    pattern = re.compile(re.escape(slug) + _TAIL)
    found = []
    with os.scandir(directory) as entries:
        for entry in entries:
            if pattern.fullmatch(entry.name) and entry.is_file(follow_symlinks=False):
                try:
                    info = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                found.append((info.st_mtime, info.st_size, Path(entry.path)))
    return sorted(found, reverse=True)


def open_files(directory: Path) -> set[Path]:
    """Files under ``directory`` that some process of this user holds open (read from /proc)."""
    prefix = str(directory) + os.sep
    held: set[Path] = set()
    try:
        pids = [entry for entry in os.listdir("/proc") if entry.isdigit()]
    except OSError:
        return held
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue  # another user's process, or gone
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith(prefix):
                held.add(Path(target))
    return held


def prune_transcripts(directory: Path, slug: str, keep: int, max_bytes: int, live: set[Path]) -> list[Path]:
    """Remove ``slug``'s oldest transcripts beyond ``keep`` files or ``max_bytes``; returns those removed.

    ``live``: transcripts of live workers. They, and files still open, are kept and count toward the caps.
    """
    try:
        files = _transcripts(directory, slug)
    except OSError as exc:
        log.warning("cannot list transcripts in %s (%s); nothing pruned", directory, exc)
        return []
    if len(files) <= keep and sum(size for _, size, _ in files) <= max_bytes:
        return []
    protected = {Path(p) for p in live} | open_files(directory)
    # The protected count first, however old: the rest share what they leave of the caps, newest first.
    kept_files = sum(1 for _, _, path in files if path in protected)
    kept_bytes = sum(size for _, size, path in files if path in protected)
    removed = []
    for _, size, path in files:
        if path in protected:
            continue
        if kept_files < keep and kept_bytes + size <= max_bytes:
            kept_files += 1
            kept_bytes += size
            continue
        try:
            path.unlink()
        except FileNotFoundError:
            continue
        except OSError as exc:
            log.warning("cannot remove old transcript %s: %s", path, exc)
            continue
        removed.append(path)
    if removed:
        log.info("%s: removed %d old transcript(s); kept %d (%.1f MB) under transcripts_keep = %d, "
                 "transcripts_max_mb = %g", slug, len(removed), kept_files, kept_bytes / 2**20, keep, max_bytes / 2**20)
    return removed


class PoolLogHandler(RotatingFileHandler):
    """The background pool's log, rotated by size; its stdout and stderr follow it to each new file.

    Anything not logged (a thread's traceback, a library's print) goes to file descriptors 1 and 2,
    so they are pointed at the current file after each rollover, not left on a renamed one.
    """

    def __init__(self, path: Path, max_bytes: int) -> None:
        super().__init__(path, maxBytes=max_bytes, backupCount=POOL_LOG_BACKUPS, encoding="utf-8")
        self._follow()

    def doRollover(self) -> None:
        super().doRollover()
        self._follow()

    def _follow(self) -> None:
        if self.stream is None:
            return
        self.stream.flush()
        for fd in (1, 2):
            os.dup2(self.stream.fileno(), fd)
