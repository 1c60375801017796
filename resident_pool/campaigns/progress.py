"""A campaign's progress: inputs done over inputs known, its rate and ETA, and a bounded timeline for the report.

No Prefect here: ``flows/screen.py`` turns it into a progress artifact and log lines. Inputs known are
exact where each file's records were counted before the campaign read them (an uncompressed file), and
an estimate otherwise (a .gz file: the records seen so far over the fraction of its decompressed bytes
they reach, ``InputFile.fraction_read()``). The percentage never goes down, and reaches 100 only when
every file is done: a file that stopped short (its disk full, the file refused on the way) counts the inputs
it holds and those it got done, never more.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["FileProgress", "Progress", "Timeline"]

TIMELINE_POINTS = 512  # kept per file, whatever its length: halved by dropping every other point when full
RATE_WINDOW_S = 60.0  # the rate the ETA uses: inputs done over about the last minute


@dataclass
class Timeline:
    """(seconds since the start, inputs done, inputs failed), at most ``limit`` points, evenly thinned."""

    limit: int = TIMELINE_POINTS
    points: list[tuple[float, int, int]] = field(default_factory=list)
    every: int = 1  # keep one point in this many offered
    offered: int = 0

    def add(self, seconds: float, done: int, failed: int) -> None:
        self.offered += 1
        if (self.offered - 1) % self.every:
            return
        self.points.append((round(seconds, 3), done, failed))
        if len(self.points) >= self.limit:
            self.points = self.points[::2]
            self.every *= 2

    def close(self, seconds: float, done: int, failed: int) -> None:
        """The last point, always kept: the chart ends where the file ended."""
        if self.points and self.points[-1][0] == round(seconds, 3):
            self.points[-1] = (round(seconds, 3), done, failed)
        else:
            self.points.append((round(seconds, 3), done, failed))


@dataclass
class FileProgress:
    """One input file: its records counted up front (None: not countable cheaply), and how far it has got."""

    name: str
    count: int | None
    started: float | None = None
    seen: int = 0  # records read so far
    done: int = 0  # inputs with their outcome: a result, a failure, or answered from the store
    failed: int = 0
    fraction_read: float = 0.0  # of its bytes, for the estimate where it was not counted
    finished: bool = False
    stopped: str | None = None  # why it ended before every input was done
    timeline: Timeline = field(default_factory=Timeline)

    def known(self, guess: float | None) -> float:
        """Inputs this file holds, as well as can be said now (``guess``: what its size says, from the
        records per byte of the files read so far)."""
        if self.finished:
            return self.seen
        if self.count is not None:
            return max(self.count, self.seen)
        if self.seen and self.fraction_read > 0:
            return max(self.seen, self.seen / min(1.0, self.fraction_read))
        return self.seen if guess is None else max(self.seen, guess)

    @property
    def exact(self) -> bool:
        return self.finished or self.count is not None


class Progress:
    """Every file of a campaign: ``percent()``, ``line()`` for the log, each file's timeline for its report."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.started = clock()
        self.files: list[FileProgress] = []
        self.sizes: list[int] = []
        self.last_percent = 0.0
        self.recent: list[tuple[float, int]] = []  # (time, done) over about RATE_WINDOW_S

    def add_file(self, name: str, count: int | None, size: int) -> FileProgress:
        entry = FileProgress(name, count)
        self.files.append(entry)
        self.sizes.append(max(size, 1))
        return entry

    def begin(self, entry: FileProgress) -> None:
        entry.started = self.clock()

    def update(self, entry: FileProgress, *, seen: int, done: int, failed: int, fraction_read: float) -> None:
        entry.seen, entry.done, entry.failed = seen, done, failed
        entry.fraction_read = max(entry.fraction_read, fraction_read)
        now = self.clock()
        entry.timeline.add(now - (entry.started or self.started), done, failed)
        self.recent.append((now, self.done))
        while len(self.recent) > 2 and now - self.recent[1][0] > RATE_WINDOW_S:
            self.recent.pop(0)

    def finish(self, entry: FileProgress, *, seen: int, done: int, failed: int) -> None:
        entry.seen, entry.done, entry.failed, entry.finished = seen, done, failed, True
        entry.timeline.close(self.clock() - (entry.started or self.started), done, failed)

    def stop(self, entry: FileProgress, why: str, *, seen: int, done: int, failed: int) -> None:
        """The file ended short of its last input: its count stays what it holds, its done what was done."""
        entry.seen, entry.done, entry.failed, entry.stopped = seen, done, failed, why
        entry.timeline.close(self.clock() - (entry.started or self.started), done, failed)

    # -- what is said ----------------------------------------------------------------
    @property
    def done(self) -> int:
        return sum(entry.done for entry in self.files)

    @property
    def failed(self) -> int:
        return sum(entry.failed for entry in self.files)

    @property
    def exact(self) -> bool:
        return all(entry.exact for entry in self.files)

    def known(self) -> int:
        """Inputs in the whole campaign, exact or estimated; never fewer than are done."""
        counted = [(entry, size) for entry, size in zip(self.files, self.sizes, strict=True)
                   if entry.finished or entry.count is not None or entry.fraction_read > 0]
        records = sum(entry.known(None) for entry, _ in counted)
        volume = sum(size for _, size in counted)
        per_byte = records / volume if volume and records else None
        total = 0.0
        for entry, size in zip(self.files, self.sizes, strict=True):
            total += entry.known(None if per_byte is None else per_byte * size)
        return max(round(total), self.done)

    def percent(self) -> float:
        """Done over known, in percent: never lower than before, 100 only once every file is done."""
        if all(entry.finished for entry in self.files):  # none at all: an empty inbox is done too
            self.last_percent = 100.0
            return 100.0
        known = self.known()
        now = 100.0 * self.done / known if known else 0.0
        self.last_percent = max(self.last_percent, min(now, 99.9))
        return self.last_percent

    def rate(self) -> float | None:
        """Inputs done per second over about the last minute (since the start, before a minute has passed)."""
        if len(self.recent) < 2:
            elapsed = self.clock() - self.started
            return self.done / elapsed if elapsed > 0 and self.done else None
        (then, before), (now, after) = self.recent[0], self.recent[-1]
        return (after - before) / (now - then) if now > then else None

    def eta_s(self) -> float | None:
        rate = self.rate()
        left = self.known() - self.done
        return left / rate if rate and left >= 0 else None

    def line(self) -> str:
        """One log line: done of known (about, where estimated), percent, rate, ETA, failed so far, and the files
        that stopped short."""
        known = self.known()
        about = "" if self.exact else "about "
        rate, eta = self.rate(), self.eta_s()
        stopped = [entry for entry in self.files if entry.stopped is not None]
        running = any(not entry.finished and entry.stopped is None for entry in self.files)
        parts = [f"{self.done:,} of {about}{known:,} inputs done ({self.percent():.1f}%)",
                 f"{rate:,.1f} inputs/s" if rate else "rate not known yet",
                 f"ETA {_duration(eta)}" if eta is not None and running else None,
                 f"{self.failed:,} failed" if self.failed else None,
                 f"{len(stopped)} file{'s' if len(stopped) > 1 else ''} stopped short ({stopped[-1].stopped})"
                 if stopped else None]
        return "; ".join(part for part in parts if part)


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
