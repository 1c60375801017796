"""A screening campaign's bookkeeping: which inputs to compute, their results, the output file.

No Prefect here: ``flows/screen.py`` orchestrates. Memory stays bounded
whatever the input size: inputs are read lazily and handled a block at a time,
and the output is written in input order as outcomes come in, so the only
inputs held are those waiting for a chunk, in flight, or read behind them.
Every input ends with exactly one record: a result, or a failure and its reason.
"""

from __future__ import annotations

import array
import base64
import binascii
import errno
import fcntl
import json
import math
import os
import re
import stat
import statistics
import sys
import uuid
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from .. import arrays
from ..errors import InputError, ResidentPoolError
from ..host.paths import Paths
from ..settings import Settings
from .inputs import DEFAULT_MAX_INPUT_BYTES, DEFAULT_MAX_INPUT_RECORDS, DEFAULT_MAX_RECORD_BYTES, Record, Region
from .outdir import OutputDir
from .report import VectorSample
from .results import ResultStore, options_text, result_key

__all__ = [
    "BLOCK",
    "NO_ROOM",
    "Campaign",
    "CampaignSettings",
    "Chunk",
    "TaskSizer",
    "first_line",
    "output_name",
    "summarize",
]

BLOCK = 1024  # records looked up in the store at once
NO_ROOM = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})  # a disk full, a quota, the file size limit
# One result (one input's answer) as decoded, and once written: over it, the record fails as bad_answer. A
# worker's 40 MB sparse attachment costs nothing to send; writing an answer costs about three times its JSON
# text (arrays by blocks, ARRAY_BLOCK), so this bounds what one answer in flight costs the client.
DEFAULT_MAX_RESULT_BYTES = 64 * 2**20
# The campaign maps less of a worker's answer than a direct call may (4 GiB): a chunk's rows, each at most
# DEFAULT_MAX_RESULT_BYTES, rarely add up to a gigabyte, and one that does is retried input by input.
DEFAULT_MAX_ATTACHMENT_BYTES = 2**30
# One encoder, made once: json.dumps with arguments builds a new one per call, a second per million results.
_COMPACT = json.JSONEncoder(separators=(",", ":")).encode
# A result's numpy arrays (or Array objects) go into the store and the output as nested lists of numbers,
# bytes as base64 text: records stay JSON whatever the provider answers with. A NaN or an infinity (an fp16
# overflow) is no JSON (json.dumps would write `NaN`, which jq and JSON.parse refuse): it fails its record.
_RESULT = json.JSONEncoder(separators=(",", ":"), allow_nan=False, default=arrays.plain).encode
if json.encoder.c_make_encoder is not None:  # the same encoder, made once: JSONEncoder.encode makes one per call
    _encode = json.encoder.c_make_encoder(None, arrays.plain, json.encoder.encode_basestring_ascii, None, ":", ",",
                                          False, False, False)  # the last: allow_nan, refused as above

    def _RESULT(value: Any) -> str:  # a drop-in for the encoder above, 1.5 us a result faster
        return "".join(_encode(value, 0))
# An array larger than this many numbers becomes JSON a block of rows at a time: as one Python list, a 40 MB
# float32 array cost the campaign about 460 MB (a 24-byte float per number, plus the list) before any text.
ARRAY_BLOCK = 1 << 16
_PLAIN_ID = re.compile(r"[A-Za-z0-9_.:|/+=-]*")  # ids that are their own JSON string body
OUTPUT_FORMATS = ("jsonl", "parquet")
# A record's own fields. A provider's item naming one of them is stored and written whole under "result"
# instead of beside them: JSON Lines would hold the key twice (the last wins) and Parquet two columns of one name.
RECORD_FIELDS = frozenset({"index", "id", "ok", "reason", "error"})


@dataclass(frozen=True)
class CampaignSettings:
    """The campaign's settings, taken from the pool's ``Settings`` and ``Paths`` (``CampaignSettings.of``)."""

    results_dir: Path
    max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES
    max_input_bytes: int = DEFAULT_MAX_INPUT_BYTES
    max_input_records: int = DEFAULT_MAX_INPUT_RECORDS
    max_result_bytes: int = DEFAULT_MAX_RESULT_BYTES
    max_attachment_bytes: int = DEFAULT_MAX_ATTACHMENT_BYTES

    @classmethod
    def of(cls, config: Settings, paths: Paths) -> CampaignSettings:
        return cls(results_dir=paths.results, max_record_bytes=config.max_record_bytes,
                   max_input_bytes=config.max_input_bytes, max_input_records=config.max_input_records,
                   max_result_bytes=config.max_result_bytes,
                   max_attachment_bytes=config.campaign_max_attachment_bytes)


def output_name(input_path: str | os.PathLike[str], provider: str, fmt: str) -> str:
    """One output per input file: ``<input file name>.<provider>.<format>``."""
    return f"{Path(input_path).name}.{provider}.{fmt}"


@dataclass
class Chunk:
    """Distinct inputs no earlier run computed, packed for one task run."""

    keys: list[bytes] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    indexes: list[int] = field(default_factory=list)
    ids: list[str] = field(default_factory=list)

    @property
    def first(self) -> int:
        return self.indexes[0]

    @property
    def last(self) -> int:
        return self.indexes[-1]

    @property
    def label(self) -> str:
        """The inputs it holds, as its task run is named: ``0-63`` when they run on, ``0,2`` for a few, else
        ``0-200, 64 inputs`` (inputs answered from the store or repeated in between are not in it)."""
        if len(self) == 1:
            return str(self.first)
        if self.last - self.first + 1 == len(self):
            return f"{self.first}-{self.last}"
        if len(self) <= 4:
            return ",".join(map(str, self.indexes))
        return f"{self.first}-{self.last}, {len(self)} inputs"

    def __len__(self) -> int:
        return len(self.keys)


def _locked_journal(folder: OutputDir, name: str, output: Path) -> int:
    """``<output>.partial``, opened, locked and emptied: one campaign writes an output at a time.

    Another run on the same inbox at once (a slow night, a hand-started run) is refused here, before it
    computes anything; the lock goes with the process, however it ends. A file that is not ours alone (a
    hard link or a file someone else put there, in a folder others can write) is refused, never emptied.
    """
    path = folder.path / name
    while True:
        fd = folder.open(name, os.O_APPEND)
        opened = os.fstat(fd)
        if not stat.S_ISREG(opened.st_mode) or opened.st_uid != os.getuid() or opened.st_nlink != 1:
            os.close(fd)
            raise InputError(f"{path}: is not a file of yours alone (owner uid {opened.st_uid}, "
                             f"{opened.st_nlink} link(s)), so it is never emptied or written; remove it, or give "
                             "another --output", details={"path": str(path)})
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise InputError(f"{output}: another campaign is writing this output now ({name} is locked); "
                             "let it finish and run again, or give another --output",
                             details={"path": str(output)}) from None
        try:  # the campaign that held it may have removed it on its way out: lock the file that is there
            current = os.path.samestat(opened, folder.lstat(name))
        except FileNotFoundError:
            current = False
        if current:
            os.ftruncate(fd, 0)
            return fd
        os.close(fd)


class TaskSizer:
    """How many inputs one task run takes: whole requests of ``chunk_size``, enough that a run holds about
    ``TARGET_S`` of the model's time, at most ``MAX_INPUTS``.

    Each task run costs the Prefect server and the flow tens of milliseconds of CPU whatever it holds
    (about 36 ms of the server's alone per run, measured here): a request that takes 10 ms would
    spend most of the campaign on them. The first runs take one request each; once runs finish,
    their measured model time per input sizes the next ones.
    """

    TARGET_S = 1.0
    MAX_INPUTS = 16384  # the window (several runs in flight) times this bounds the flow's memory

    def __init__(self, chunk_size: int) -> None:
        self.chunk_size = chunk_size
        self.size = chunk_size
        self.per_input_s: float | None = None

    def observe(self, inputs: int, seconds: Any) -> None:
        """A finished run's ``inputs`` took ``seconds`` of requests."""
        if not inputs or not isinstance(seconds, int | float) or seconds < 0:
            return
        per_input = max(seconds / inputs, 1e-9)
        self.per_input_s = per_input if self.per_input_s is None else (self.per_input_s + per_input) / 2
        requests = max(1, int(self.TARGET_S / self.per_input_s) // self.chunk_size)
        most = max(1, self.MAX_INPUTS // self.chunk_size)
        self.size = min(requests, most) * self.chunk_size


class _Entry:
    """One input's place in the output: its outcome once known (a result's JSON, or a failure); or a whole
    Region's, as the lines an earlier campaign wrote for it (``lines``, ``count`` records, every one ok)."""

    __slots__ = ("count", "error", "id", "index", "key", "line", "lines", "reason", "result")

    def __init__(self, index: int, ident: str, key: bytes | None) -> None:
        self.index, self.id, self.key = index, ident, key
        self.result: str | None = None
        self.reason: str | None = None
        self.error: str | None = None
        self.line: str | None = None  # its record as the journal got it, written the same into the output
        self.lines: str | None = None
        self.count = 1


class _Mark:
    """A Region being computed: its key and its inputs, whose lines are kept as they are written."""

    __slots__ = ("first", "key", "last", "lines", "ok", "size")

    def __init__(self, key: bytes, first: int, last: int) -> None:
        self.key, self.first, self.last = key, first, last
        self.lines: list[str] = []
        self.ok = True
        self.size = 0


class Campaign:
    """One input file through one provider version.

    ``add`` takes records a block at a time and returns the chunks (task runs) to compute; ``finish``/``fail``
    take a chunk's outcome. The output is written as it goes, in input order: each input's record as
    soon as it and every input before it have an outcome (stored, computed, failed), into a temporary
    file that ``write`` puts in place once every input has one. What is held is what waits: the inputs
    in flight and those read behind the first of them (``backlog``), never the whole input. Uses the
    store's connection from one thread.
    """

    BACKLOG = 1 << 17  # inputs read but not yet written, past which the flow stops reading until some are
    # A Region's lines are kept whole only up to this size: past it (answers of kilobytes each) they would
    # double the store for a saving the lines' own writing dwarfs.
    REGION_MAX_BYTES = 4 << 20

    def __init__(self, store: ResultStore, version: str, options: dict[str, Any], chunk_size: int,
                 output: str | os.PathLike[str], *, max_result_bytes: int = DEFAULT_MAX_RESULT_BYTES,
                 fmt: Literal["jsonl", "parquet"] = "jsonl", sample: VectorSample | None = None,
                 rule: Callable[[Record], tuple[str, str | None]] | None = None) -> None:
        if chunk_size < 1:
            raise InputError(f"chunk_size must be at least 1, not {chunk_size}")
        _check_format(fmt)
        self.store = store
        self.version = version
        self.options = options_text(options)
        self.chunk_size = chunk_size
        self.sizer = TaskSizer(chunk_size)
        self.max_result_bytes = max_result_bytes
        self.output = Path(output)
        self.fmt = fmt
        self.sample = sample  # offered every result as it is written (the report's map)
        # The provider's input rule: each record's text as sent, or why it is refused (that input fails alone).
        self.rule = rule
        self.journal_name = self.output.name + ".partial"
        self.pending = Chunk()
        # Inputs waiting for a key that is pending or in flight: a duplicate of one is not computed twice.
        self.waiting: dict[bytes, list[_Entry]] = {}
        self.order: deque[_Entry] = deque()  # read, not yet written; the first waits, the rest may not
        self.counts = {"inputs": 0, "bad_input": 0, "from_store": 0, "duplicates": 0, "computed": 0, "chunks": 0}
        self.failed_computing = 0  # inputs whose chunk came back failed, or that the model refused: so far
        self.written: dict[str, Any] = {"records": 0, "ok": 0, "failed": 0, "missing": 0, "failure_reasons": {},
                                       "failures": []}
        self.chunk_stats: list[dict[str, Any]] = []
        self.demoted: list[bytes] = []  # stored answers the output could not hold: forgotten at the end
        self.marks: deque[_Mark] = deque()  # Regions being computed, in input order
        self.temp: str | None = None
        self.sink: _JsonlSink | _ParquetSink | None = None
        self.folder = OutputDir(self.output.parent)
        try:
            self.journal = os.fdopen(_locked_journal(self.folder, self.journal_name, self.output), "w",
                                     encoding="utf-8")
        except BaseException:
            self.folder.close()
            raise

    def close(self) -> None:
        if self.sink is not None:
            try:
                self.sink.abandon()
            except OSError:  # what it still buffered, on a full disk: the file is removed below anyway
                pass
            self.sink = None
        if self.temp is not None:  # not put in place: never left behind
            self.folder.unlink(self.temp)
            self.temp = None
        if not self.journal.closed:
            try:
                self.journal.close()
            except OSError:  # its last lines, on a full disk: a re-run empties it first
                pass
        self.folder.close()

    @property
    def backlog(self) -> int:
        """Inputs read and not yet written."""
        return len(self.order)

    # -- planning -----------------------------------------------------------------
    def add(self, records: list[Record]) -> list[Chunk]:
        """Take a block of records; return the full chunks of what is neither stored nor already on its way."""
        version, options, rule = self.version, self.options, self.rule
        entries: list[tuple[_Entry, Record]] = []
        for record in records:
            if record.error is None and rule is not None:
                text, problem = rule(record)
                if problem is not None or text != record.text:
                    record = Record(record.index, record.id, text, record.line, problem)  # noqa: PLW2901
            if record.error is not None:
                entry = _Entry(record.index, record.id, None)
                entry.reason, entry.error = "bad_input", record.error
                self.counts["bad_input"] += 1
            else:
                entry = _Entry(record.index, record.id, result_key(version, options, record.text))
                entries.append((entry, record))
            self.order.append(entry)
        self.counts["inputs"] += len(records)
        stored = self.store.results([entry.key for entry, _ in entries])
        pending, waiting = self.pending, self.waiting
        for entry, record in entries:
            key = entry.key
            result = stored.get(key)
            if result is not None:
                entry.result = result
                self.counts["from_store"] += 1
            elif key in waiting:
                waiting[key].append(entry)
                self.counts["duplicates"] += 1
            else:
                waiting[key] = [entry]
                pending.keys.append(key)
                pending.texts.append(record.text)
                pending.indexes.append(record.index)
                pending.ids.append(record.id)
        chunks = []
        while len(self.pending) >= self.sizer.size:
            chunks.append(self._cut(self.sizer.size))
        self._emit()
        return chunks

    def add_region(self, region: Region) -> list[Chunk]:
        """Take a Region: written from the store whole when a campaign wrote it before (JSON Lines output),
        else its records go as ``add``'s, and its lines are kept once every one of them is ok."""
        if self.fmt != "jsonl":
            return self.add(region.records())
        key = region.key(self.version, self.options)
        found = self.store.region(key)
        if found is None or found[0] != region.count:
            self.marks.append(_Mark(key, region.first_index, region.first_index + region.count - 1))
            return self.add(region.records())
        entry = _Entry(region.first_index, "", None)
        entry.count, entry.lines = found
        self.order.append(entry)
        self.counts["inputs"] += entry.count
        self.counts["from_store"] += entry.count
        self._emit()
        return []

    def keep(self, entries: list[_Entry], lines: list[str]) -> None:
        """Inputs' lines, as written: those of a Region being computed are kept, and stored once it is whole."""
        marks, limit = self.marks, self.REGION_MAX_BYTES
        for entry, line in zip(entries, lines, strict=True):
            if not marks or entry.index < marks[0].first:
                continue
            mark = marks[0]
            mark.ok = mark.ok and entry.result is not None
            mark.size += len(line)
            if mark.ok and mark.size <= limit:
                mark.lines.append(line)
            if entry.index == mark.last:
                marks.popleft()
                if mark.ok and mark.size <= limit:
                    self.store.put_region(mark.key, self.version, len(mark.lines), "".join(mark.lines))

    def flush(self) -> list[Chunk]:
        """The last, partly filled chunk (once the input is read, or to let what waits on it be written)."""
        return [self._cut(len(self.pending))] if len(self.pending) else []

    def _cut(self, size: int) -> Chunk:
        pending = self.pending
        chunk = Chunk(pending.keys[:size], pending.texts[:size], pending.indexes[:size], pending.ids[:size])
        self.pending = Chunk(pending.keys[size:], pending.texts[size:], pending.indexes[size:], pending.ids[size:])
        self.counts["computed"] += len(chunk)
        self.counts["chunks"] += 1
        return chunk

    # -- outcomes -----------------------------------------------------------------
    def finish(self, chunk: Chunk, results: list[dict[str, Any] | None], failed: dict[int, tuple[str, str]],
               stats: dict[str, Any]) -> None:
        """Store a computed chunk: ``results[i]`` for input i, or ``failed[i] = (reason, error)``."""
        if len(results) != len(chunk):
            self.fail(chunk, "bad_answer", f"{len(results)} results came back for {len(chunk)} inputs", stats)
            return
        stored: list[tuple[bytes, str]] = []
        lines: list[str] = []
        failures = 0
        for position, (key, result) in enumerate(zip(chunk.keys, results, strict=True)):
            head = _head(chunk.indexes[position], chunk.ids[position])
            if result is None or position in failed:
                reason, error = failed.get(position, ("bad_answer", "no result came back for this input"))
                failures += 1
                lines.append(self._resolve(key, _failure_line(head, reason, error), None, reason, error))
                continue
            text, problem = _written(result, self.max_result_bytes)
            if problem is not None:  # one input's answer that cannot be written fails alone, and is not stored
                failures += 1
                lines.append(self._resolve(key, _failure_line(head, "bad_answer", problem), None, "bad_answer",
                                           problem))
                continue
            stored.append((key, text))
            lines.append(self._resolve(key, _ok_line(head, text), text))
        self.store.put(self.version, stored)
        self.failed_computing += failures
        self._journal(lines)
        self.chunk_stats.append({**stats, "n": len(chunk)})
        self.sizer.observe(len(chunk), stats.get("compute_s"))
        self._emit()

    def fail(self, chunk: Chunk, reason: str, error: str, stats: dict[str, Any] | None = None) -> None:
        """Every input of a chunk failed for one reason (the worker could not be had, it kept dying)."""
        for key in chunk.keys:
            self._resolve(key, None, None, reason, error)
        self.failed_computing += len(chunk)
        self._journal([_failure_line(_head(index, ident), reason, error)
                       for index, ident in zip(chunk.indexes, chunk.ids, strict=True)])
        self.chunk_stats.append({**(stats or {}), "failed": True, "n": len(chunk)})
        self._emit()

    def _resolve(self, key: bytes, line: str | None, result: str | None, reason: str | None = None,
                 error: str | None = None) -> str | None:
        """Every input waiting for ``key`` gets its outcome; the first (the chunk's own) its line too."""
        entries = self.waiting.pop(key, ())
        for entry in entries:
            entry.result, entry.reason, entry.error = result, reason, error
        if entries:
            entries[0].line = line
        return line

    def _journal(self, lines: list[str]) -> None:
        with self._room("its journal", self.journal_name):
            self.journal.writelines(lines)
            self.journal.flush()

    @contextmanager
    def _room(self, what: str, name: str) -> Iterator[None]:
        """A write to the output's folder that its disk cannot take becomes one sentence naming the output, the
        file and the fix (the results computed so far are in the store, kept)."""
        try:
            yield
        except OSError as exc:
            if exc.errno not in NO_ROOM:
                raise
            raise ResidentPoolError(
                f"{self.output}: {(exc.strerror or str(exc)).lower()} while writing {what} ({self.folder.path / name});"
                " free space on its disk (or give another --output) and run the campaign again: the results stored so "
                "far are kept and are not computed again", reason="disk_full",
                details={"path": str(self.output)}) from None

    # -- the output ---------------------------------------------------------------
    def _emit(self) -> None:
        """Write every record at the head of the order that has its outcome."""
        order, ready = self.order, []
        while order and (order[0].result is not None or order[0].reason is not None or order[0].lines is not None):
            ready.append(order.popleft())
        if not ready:
            return
        if self.sink is None:
            self._open_sink()
        with self._room("its output", self.temp or self.output.name):
            self.sink.write(ready)

    def _open_sink(self) -> None:
        self.temp = f".{self.output.name}.{uuid.uuid4().hex[:8]}.tmp"
        with self._room("its output", self.temp):
            out = os.fdopen(self.folder.open(self.temp, os.O_EXCL), "wb")
        self.sink = _JsonlSink(out, self) if self.fmt == "jsonl" else _ParquetSink(out, self)

    def count(self, entry: _Entry) -> None:
        """One record (or a Region's) as it is written: counted, its result offered to ``sample``, and the
        first FAILURES_KEPT failures kept (index, id, reason, the error's first line) for the failures table."""
        written = self.written
        written["records"] += entry.count
        if entry.result is not None or entry.lines is not None:
            written["ok"] += entry.count
            if self.sample is not None:
                if entry.lines is None:
                    self.sample.offer(entry.id, entry.result)
                else:
                    for line in entry.lines.splitlines():
                        self.sample.offer_line(line)
            return
        written["failed"] += 1
        reasons = written["failure_reasons"]
        reasons[entry.reason] = reasons.get(entry.reason, 0) + 1
        if len(written["failures"]) < FAILURES_KEPT:
            written["failures"].append({"index": entry.index, "id": entry.id, "reason": entry.reason,
                                        "error": first_line(entry.error)})

    def demote(self, entry: _Entry, problem: str) -> None:
        """An answer counted ok turned out not to fit the output: it fails as bad_answer and leaves the store."""
        self.written["ok"] -= 1
        entry.result, entry.reason, entry.error = None, "bad_answer", problem
        self.count(entry)
        self.written["records"] -= 1
        self.demoted.append(entry.key)

    def write(self, fmt: Literal["jsonl", "parquet"] | None = None) -> dict[str, Any]:
        """Put the output in place, every input's record in input order, atomically; returns the counts."""
        if fmt is not None and fmt != self.fmt:
            _check_format(fmt)
            raise InputError(f"this campaign writes {self.fmt}, not {fmt}")
        if self.pending or self.waiting or self.order:
            raise InputError(f"{self.output}: {len(self.order)} inputs have no outcome yet; finish every chunk "
                             "before writing the output")
        with self._room("its journal", self.journal_name):
            self.journal.flush()  # kept open, and locked, until the output has replaced the old one
        if self.sink is None:  # no input at all
            self._open_sink()
        sink, self.sink = self.sink, None
        with self._room("its output", self.temp):
            sink.close()
        self.folder.replace(self.temp, self.output.name)
        self.temp = None
        for start in range(0, len(self.demoted), 4096):  # computed again next time
            self.store.forget(self.demoted[start:start + 4096])
        self.folder.unlink(self.journal_name)
        self.journal.close()
        return self.written


FAILURES_KEPT = 100  # failures a campaign's table shows; every one is in the output


def first_line(text: str | None, limit: int = 300) -> str:
    """An error's first non-empty line, cut at ``limit`` characters."""
    line = next((part.strip() for part in (text or "").splitlines() if part.strip()), "")
    return line if len(line) <= limit else line[:limit - 1] + "…"


def _check_format(fmt: str) -> None:
    if fmt not in OUTPUT_FORMATS:
        raise InputError(f"unknown output format {fmt!r}; use one of {', '.join(OUTPUT_FORMATS)}")


class _JsonlSink:
    """Records as JSON Lines, written a batch at a time."""

    def __init__(self, out, campaign: Campaign) -> None:
        self.out, self.campaign = out, campaign

    def write(self, entries: list[_Entry]) -> None:
        campaign, lines = self.campaign, []
        for entry in entries:
            campaign.count(entry)
            if entry.lines is not None:
                lines.append(entry.lines)
                continue
            line = entry.line
            if line is None:
                head = _head(entry.index, entry.id)
                line = (_ok_line(head, entry.result) if entry.result is not None
                        else _failure_line(head, entry.reason, entry.error))
            lines.append(line)
        if campaign.marks:
            campaign.keep(entries, lines)
        self.out.write("".join(lines).encode())

    def close(self) -> None:
        self.out.close()

    def abandon(self) -> None:
        self.out.close()


class _ParquetSink:
    """Records as Parquet: id, index, ok, reason, error, then the result's fields, in batches of ``BATCH`` rows.

    The columns are drawn from an early result: the first of up to ``EXAMPLES`` results whose vectors
    decode (an older version may have stored one that does not, and it must not shape every column).
    Rows wait here until the columns are known, at most ``WAIT`` of them.
    """

    BATCH, EXAMPLES, WAIT = 8192, 100, 65536

    def __init__(self, out, campaign: Campaign) -> None:
        try:
            import pyarrow as pa
            import pyarrow.parquet as pq
        except ImportError:
            out.close()
            raise InputError("--format parquet needs pyarrow: pip install 'resident-pool[parquet]'") from None
        self.out, self.campaign, self.pa, self.pq = out, campaign, pa, pq
        self.rows: list[_Entry] = []
        self.results = 0
        self.writer = None
        self.columns: list[tuple[str, Any, str]] = []
        self.schema = None

    def write(self, entries: list[_Entry]) -> None:
        self.rows.extend(entries)
        if self.writer is None:
            self.results += sum(1 for entry in entries if entry.result is not None)
            if self.results < self.EXAMPLES and len(self.rows) < self.WAIT:
                return
            self._start()
        while len(self.rows) >= self.BATCH:
            batch, self.rows = self.rows[:self.BATCH], self.rows[self.BATCH:]
            self.writer.write_table(self._table(batch))

    def _start(self) -> None:
        pa, example, first = self.pa, None, None
        for entry in self.rows:
            if entry.result is None:
                continue
            result = json.loads(entry.result)
            first = first or result
            if isinstance(result, dict) and _f32_problem(result.get("embedding_f32", "")) is None:
                example = result
                break
        self.columns = _parquet_columns(example or first or {}, pa)
        self.schema = pa.schema([("id", pa.string()), ("index", pa.int64()), ("ok", pa.bool_()),
                                 ("reason", pa.string()), ("error", pa.string())]
                                + [(name, kind) for name, kind, _ in self.columns])
        self.writer = self.pq.ParquetWriter(self.out, self.schema)

    def close(self) -> None:
        if self.writer is None:
            self._start()
        if self.rows or not self.campaign.written["records"]:
            self.writer.write_table(self._table(self.rows))
        self.rows = []
        self.writer.close()
        self.out.close()

    def abandon(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.out.close()

    def _table(self, batch: list[_Entry]):
        """One batch as an Arrow table. A stored result whose value does not fit its column (undecodable base64
        float32 an older version stored, a string where the first result had a number) fails its own row as
        bad_answer; the rest of the output is written."""
        pa, campaign = self.pa, self.campaign
        cells: list[list[Any]] = [[None] * len(batch) for _ in self.columns]
        readers = [("embedding_f32" if how == "f32" else name, _cell_reader(kind, how, pa))
                   for name, kind, how in self.columns]
        for at, entry in enumerate(batch):
            campaign.count(entry)
            if entry.result is None:
                continue
            result = json.loads(entry.result)
            converted, problem = [], None
            for source, read in readers:
                value = result.get(source)
                value, problem = (None, None) if value is None else read(value)
                if problem is not None:
                    problem = f"{source}: {problem}"
                    break
                converted.append(value)
            if problem is not None:
                campaign.demote(entry, f"{problem}; the stored answer was removed, so the next run computes it again")
                continue
            for column, value in zip(cells, converted, strict=True):
                column[at] = value
        arrays = [pa.array([entry.id for entry in batch], pa.string()),
                  pa.array([entry.index for entry in batch], pa.int64()),
                  pa.array([entry.result is not None for entry in batch], pa.bool_()),
                  pa.array([entry.reason for entry in batch], pa.string()),
                  pa.array([entry.error for entry in batch], pa.string())]
        for (_, kind, how), values in zip(self.columns, cells, strict=True):
            arrays.append(_vectors(values, kind.list_size, pa) if how in ("f32", "floats") else pa.array(values, kind))
        return pa.Table.from_arrays(arrays, schema=self.schema)


def _head(index: int, ident: str) -> str:
    quoted = f'"{ident}"' if _PLAIN_ID.fullmatch(ident) else _COMPACT(ident)
    return f'{{"index":{index},"id":{quoted}'


def _ok_line(head: str, result: str) -> str:
    return f'{head},"ok":true}}\n' if result == "{}" else f'{head},"ok":true,{result[1:]}\n'


def _fields(result: dict[str, Any]) -> dict[str, Any]:
    """A provider's item as the store and the output hold it: its fields beside the record's own, or, when it
    names one of them, whole under "result". Checked once, when the item comes in, not per line written."""
    return {"result": result} if not RECORD_FIELDS.isdisjoint(result) else result


def _written(result: dict[str, Any], limit: int) -> tuple[str, str | None]:
    """The result as the store and the output hold it (compact JSON), or why it cannot be: over ``limit``
    decoded or written, a ``*_f32`` field that is not base64 float32, a value JSON cannot hold.

    What it costs: about twice the text (at most ``limit``) while it is built, plus one block of an
    array's numbers; the campaign then holds about as much again to store and journal it.
    """
    large = False
    if any(type(value) not in _SCALARS for value in result.values()):  # a flat answer's size is its text's
        size, large = _decoded_size(result, limit)
        if size > limit:
            return "", (f"the answer is over {limit} bytes decoded (RESIDENT_POOL_MAX_RESULT_BYTES); it was not "
                        "written")
    for name, value in result.items():
        if isinstance(name, str) and name.endswith("_f32") and value is not None:
            problem = _f32_problem(value)
            if problem is not None:
                return "", f"{name}: {problem}"
    try:
        text = _by_blocks(_fields(result), limit) if large else _RESULT(_fields(result))
    except ValueError as exc:
        if "not JSON compliant" in str(exc):
            return "", "the answer holds a NaN or an infinity, which JSON cannot hold; it was not written"
        return "", f"the answer cannot be written as JSON: {exc}"
    except (TypeError, OverflowError, RecursionError) as exc:
        return "", f"the answer cannot be written as JSON: {exc}"
    if text is None or len(text) > limit:
        return "", (f"the answer is more than {limit} bytes as JSON (RESIDENT_POOL_MAX_RESULT_BYTES); it was not "
                    "written")
    return text, None


_SCALARS = frozenset({int, float, bool, type(None)})


def _by_blocks(fields: dict[str, Any], limit: int) -> str | None:
    """``fields`` as compact JSON, each array of more than ARRAY_BLOCK numbers written a block of rows at a time
    (the same text as whole); None once the text passes ``limit``."""
    found: list[Any] = []
    marker = f"rp-array-{uuid.uuid4().hex}-"  # unguessable: no string of the answer can be one

    def default(value: Any) -> Any:
        if _large_array(value):
            found.append(value)
            return f"{marker}{len(found) - 1}"
        return arrays.plain(value)

    skeleton = json.JSONEncoder(separators=(",", ":"), allow_nan=False, default=default).encode(fields)
    pieces = skeleton.split(f'"{marker}')
    parts, size = [pieces[0]], len(pieces[0])
    for piece in pieces[1:]:
        number, _, rest = piece.partition('"')
        for block in (*_array_blocks(found[int(number)]), rest):
            size += len(block)
            if size > limit:
                return None
            parts.append(block)
    return "".join(parts)


def _large_array(value: Any) -> bool:
    """A numpy array or an arrays.Array of more than ARRAY_BLOCK numbers, with at least one dimension."""
    numpy = sys.modules.get("numpy")  # an ndarray can only exist if numpy was imported
    is_array = isinstance(value, arrays.Array) or (numpy is not None and isinstance(value, numpy.ndarray))
    return is_array and value.ndim >= 1 and value.size > ARRAY_BLOCK


def _array_blocks(value: Any) -> Iterator[str]:
    """An array's JSON text (nested lists), in pieces of about ARRAY_BLOCK numbers each."""
    rows, per_row = value.shape[0], math.prod(value.shape[1:])
    yield "["
    if per_row > ARRAY_BLOCK:  # each row is large itself: one at a time
        for row in range(rows):
            if row:
                yield ","
            yield from _array_blocks(_row(value, row))
    else:
        step = max(1, ARRAY_BLOCK // max(per_row, 1))
        for start in range(0, rows, step):
            yield ("," if start else "") + _RESULT(_rows(value, start, start + step).tolist())[1:-1]
    yield "]"


def _rows(value: Any, start: int, stop: int) -> Any:
    """Rows ``start`` to ``stop`` of a numpy array or an arrays.Array, sharing its memory."""
    return value.rows(start, stop) if isinstance(value, arrays.Array) else value[start:stop]


def _row(value: Any, index: int) -> Any:
    """Row ``index`` (one dimension less) of a numpy array or an arrays.Array, sharing its memory."""
    if isinstance(value, arrays.Array):
        run = value.rows(index, index + 1)
        return arrays.Array(run.data, run.dtype, run.shape[1:])
    return value[index]


def _decoded_size(value: Any, limit: int) -> tuple[int, bool]:
    """Roughly the bytes ``value`` holds (arrays by their nbytes, text by its length), counted until past
    ``limit``, and whether it holds an array large enough to be written by blocks; never encodes anything."""
    size, large, todo = 0, False, [value]
    while todo and size <= limit:
        item = todo.pop()
        if isinstance(item, str | bytes | bytearray):
            size += len(item)
        elif isinstance(item, dict):
            size += 2 * len(item)
            todo.extend(item.keys())
            todo.extend(item.values())
        elif isinstance(item, list | tuple):
            size += len(item)
            todo.extend(item)
        else:
            nbytes = getattr(item, "nbytes", None)
            size += nbytes if isinstance(nbytes, int) else 8
            large = large or _large_array(item)
    return size, large


def _f32_problem(value: Any) -> str | None:
    """Why ``value`` is not base64 of little-endian float32s (None when it is)."""
    if not isinstance(value, str):
        return f"a {type(value).__name__}, not base64 float32 text"
    try:
        blob = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError) as exc:
        return f"not base64 float32 text ({exc})"
    if len(blob) % 4:
        return f"{len(blob)} bytes once decoded, not a whole number of float32s"
    return None


def _failure_line(head: str, reason: str, error: str) -> str:
    return f'{head},"ok":false,"reason":{_COMPACT(reason)},"error":{_COMPACT(error)}}}\n'


def _parquet_columns(example: dict[str, Any], pa) -> list[tuple[str, Any, str]]:
    """(column, arrow type, how to read it from a result) for each field of an example result."""
    columns = []
    for name, value in example.items():
        if name == "embedding_f32" and _f32_problem(value) is None:
            columns.append(("embedding", pa.list_(pa.float32(), len(base64.b64decode(value)) // 4), "f32"))
        elif name == "embedding" and isinstance(value, list) and all(isinstance(x, int | float) for x in value):
            columns.append(("embedding", pa.list_(pa.float32(), len(value)), "floats"))
        elif isinstance(value, bool):
            columns.append((name, pa.bool_(), "value"))
        elif isinstance(value, int):
            columns.append((name, pa.int64(), "value"))
        elif isinstance(value, float):
            columns.append((name, pa.float64(), "value"))
        elif isinstance(value, str):
            columns.append((name, pa.string(), "value"))
        else:
            columns.append((name, pa.string(), "json"))
    return columns


def _cell_reader(kind: Any, how: str, pa) -> Callable[[Any], tuple[Any, str | None]]:
    """For one column: a value (not None) as the column takes it (vectors as float32 bytes), or why it does not
    fit."""
    if how in ("f32", "floats"):
        def sized(blob: bytes) -> tuple[Any, str | None]:
            # The column's size is the first answer's: a vector of another size has no place in it.
            if len(blob) != 4 * kind.list_size:
                return None, (f"{len(blob) // 4} floats, where the output's column holds {kind.list_size} (the "
                              "size of the first answer's)")
            return blob, None
    if how == "f32":
        def f32(value: Any) -> tuple[Any, str | None]:
            problem = _f32_problem(value)
            return (None, problem) if problem else sized(base64.b64decode(value))
        return f32
    if how == "floats":
        def floats(value: Any) -> tuple[Any, str | None]:
            if not isinstance(value, list) or not all(isinstance(x, int | float) and not isinstance(x, bool)
                                                      for x in value):
                return None, "not a list of numbers"
            try:
                return sized(array.array("f", value).tobytes())
            except OverflowError:
                return None, "a number too large for float32"
        return floats
    if how == "json":
        return lambda value: (json.dumps(value), None)
    if kind == pa.bool_():
        fits = lambda v: isinstance(v, bool)  # noqa: E731 - one line per column type reads best as a table
    elif kind == pa.int64():
        fits = lambda v: isinstance(v, int) and not isinstance(v, bool) and -(2**63) <= v < 2**63  # noqa: E731
    elif kind == pa.float64():
        fits = lambda v: isinstance(v, int | float) and not isinstance(v, bool) and abs(v) < 2.0**1023  # noqa: E731
    else:
        fits = lambda v: isinstance(v, str)  # noqa: E731

    def value(v: Any) -> tuple[Any, str | None]:
        return (v, None) if fits(v) else (None, f"a {type(v).__name__} where the output's column holds {kind}")
    return value


def _vectors(blobs: list[bytes | None], dim: int, pa):
    """A fixed-size float32 list column built from one buffer (nulls where a row has no vector: a failed row,
    or one whose answer has none; one of another size failed its row in ``_parquet_batch``)."""
    zero = bytes(4 * dim)
    valid = [blob is not None and len(blob) == 4 * dim for blob in blobs]
    data = b"".join(blob if ok else zero for blob, ok in zip(blobs, valid, strict=True))
    flat = pa.Array.from_buffers(pa.float32(), len(blobs) * dim, [None, pa.py_buffer(data)])
    mask = None if all(valid) else pa.array([not v for v in valid], pa.bool_())
    return pa.FixedSizeListArray.from_arrays(flat, dim, mask=mask)


def summarize(counts: dict[str, Any], written: dict[str, Any], chunk_stats: list[dict[str, Any]],
              wall_s: float) -> dict[str, Any]:
    """One file's line of the campaign table: inputs, ok, failed, what was computed, latency, throughput."""
    computed = [s for s in chunk_stats if not s.get("failed")]
    warm = [s["latency_s"] for s in computed if not s.get("cold") and s.get("latency_s") is not None]
    return {
        "inputs": counts["inputs"],
        "ok": written["ok"],
        "failed": written["failed"],
        "missing": written["missing"],
        "failure_reasons": written["failure_reasons"],
        "failures": written.get("failures", []),
        "computed": counts["computed"],
        "from_store": counts["from_store"],
        "duplicates": counts["duplicates"],
        "chunks": counts["chunks"],
        "cold_starts": sum(1 for s in computed if s.get("cold")),
        "warm_median_chunk_latency_ms": round(statistics.median(warm) * 1000, 1) if warm else None,
        "throughput_inputs_per_s": round(counts["inputs"] / wall_s, 1) if wall_s > 0 else None,
        "wall_s": round(wall_s, 2),
        "workers": sorted({s["pid"] for s in computed if s.get("pid")}),
    }
