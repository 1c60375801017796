"""A screening campaign's bookkeeping: which inputs to compute, their results, the output file.

No Prefect here: ``flows/screen.py`` orchestrates. Memory stays bounded
whatever the input size: inputs are read lazily and handled a block at a time,
the only inputs held are those waiting for a chunk or in flight, and the
index of the campaign (input number -> id, key, or why it is bad) lives in
SQLite's private temporary database, which the final output is joined from.
Every input ends with exactly one record: a result, or a failure and its reason.
"""

from __future__ import annotations

import array
import base64
import binascii
import fcntl
import json
import math
import os
import re
import stat
import statistics
import sys
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from .. import arrays
from ..errors import InputError
from ..settings import settings
from .inputs import DEFAULT_MAX_INPUT_BYTES, DEFAULT_MAX_INPUT_RECORDS, DEFAULT_MAX_RECORD_BYTES, Record
from .outdir import OutputDir
from .report import VectorSample
from .results import ResultStore, default_results_dir, options_text, result_key

__all__ = [
    "BLOCK",
    "Campaign",
    "CampaignSettings",
    "Chunk",
    "first_line",
    "output_name",
    "summarize",
]

BLOCK = 1024  # records looked up in the store at once
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
    """The campaign's settings from ``RESIDENT_POOL_*`` variables (read here, nowhere else)."""

    results_dir: Path
    max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES
    max_input_bytes: int = DEFAULT_MAX_INPUT_BYTES
    max_input_records: int = DEFAULT_MAX_INPUT_RECORDS
    max_result_bytes: int = DEFAULT_MAX_RESULT_BYTES
    max_attachment_bytes: int = DEFAULT_MAX_ATTACHMENT_BYTES

    @classmethod
    def from_env(cls) -> CampaignSettings:
        config = settings()
        return cls(results_dir=config.results_dir or default_results_dir(), max_record_bytes=config.max_record_bytes,
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


class Campaign:
    """One input file through one provider version.

    ``add`` takes records a block at a time and returns the chunks to compute;
    ``finish``/``fail`` take a chunk's outcome; ``write`` produces the output.
    Uses the store's connection from one thread.
    """

    def __init__(self, store: ResultStore, version: str, options: dict[str, Any], chunk_size: int,
                 output: str | os.PathLike[str], *, max_result_bytes: int = DEFAULT_MAX_RESULT_BYTES) -> None:
        if chunk_size < 1:
            raise InputError(f"chunk_size must be at least 1, not {chunk_size}")
        self.store = store
        self.db = store.connection
        self.version = version
        self.options = options_text(options)
        self.chunk_size = chunk_size
        self.max_result_bytes = max_result_bytes
        self.output = Path(output)
        self.journal_name = self.output.name + ".partial"
        self.pending = Chunk()
        self.waiting: set[bytes] = set()  # keys pending or in flight: a duplicate of one is not computed twice
        self.counts = {"inputs": 0, "bad_input": 0, "from_store": 0, "duplicates": 0, "computed": 0, "chunks": 0}
        self.failed_computing = 0  # inputs whose chunk came back failed, or that the model refused: so far
        self.chunk_stats: list[dict[str, Any]] = []
        # The index lives in SQLite's temporary database: a private file, unlinked as soon as it is made.
        self.db.executescript("""
            DROP TABLE IF EXISTS temp.slots;
            DROP TABLE IF EXISTS temp.failures;
            CREATE TEMP TABLE slots (idx INTEGER PRIMARY KEY, id TEXT NOT NULL, key BLOB, error TEXT);
            CREATE TEMP TABLE failures (key BLOB PRIMARY KEY, reason TEXT NOT NULL, error TEXT NOT NULL);
        """)
        self.folder = OutputDir(self.output.parent)
        try:
            self.journal = os.fdopen(_locked_journal(self.folder, self.journal_name, self.output), "w",
                                     encoding="utf-8")
        except BaseException:
            self.folder.close()
            raise

    def close(self) -> None:
        if not self.journal.closed:
            self.journal.close()
        self.folder.close()
        self.db.executescript("DROP TABLE IF EXISTS temp.slots; DROP TABLE IF EXISTS temp.failures;")

    # -- planning -----------------------------------------------------------------
    def add(self, records: list[Record]) -> list[Chunk]:
        """Index a block of records; return the full chunks of what is neither stored nor already on its way."""
        version, options = self.version, self.options
        rows: list[tuple[int, str, bytes | None, str | None]] = []
        keyed: list[tuple[bytes, Record]] = []
        for record in records:
            if record.error is not None:
                rows.append((record.index, record.id, None, record.error))
            else:
                key = result_key(version, options, record.text)
                rows.append((record.index, record.id, key, None))
                keyed.append((key, record))
        self.db.execute("BEGIN")  # deferred: only the private temp database is written
        self.db.executemany("INSERT INTO temp.slots (idx, id, key, error) VALUES (?, ?, ?, ?)", rows)
        self.db.execute("COMMIT")
        self.counts["inputs"] += len(rows)
        self.counts["bad_input"] += len(rows) - len(keyed)
        stored = self.store.present([key for key, _ in keyed])
        pending, waiting = self.pending, self.waiting
        for key, record in keyed:
            if key in stored:
                self.counts["from_store"] += 1
            elif key in waiting:
                self.counts["duplicates"] += 1
            else:
                waiting.add(key)
                pending.keys.append(key)
                pending.texts.append(record.text)
                pending.indexes.append(record.index)
                pending.ids.append(record.id)
        chunks = []
        while len(self.pending) >= self.chunk_size:
            chunks.append(self._cut(self.chunk_size))
        return chunks

    def flush(self) -> list[Chunk]:
        """The last, partly filled chunk, once the input is read."""
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
        failures: list[tuple[bytes, str, str]] = []
        for position, (key, result) in enumerate(zip(chunk.keys, results, strict=True)):
            head = _head(chunk.indexes[position], chunk.ids[position])
            if result is None or position in failed:
                reason, error = failed.get(position, ("bad_answer", "no result came back for this input"))
                failures.append((key, reason, error))
                lines.append(_failure_line(head, reason, error))
            else:
                text, problem = _written(result, self.max_result_bytes)
                if problem is not None:  # one input's answer that cannot be written fails alone, and is not stored
                    failures.append((key, "bad_answer", problem))
                    lines.append(_failure_line(head, "bad_answer", problem))
                    continue
                stored.append((key, text))
                lines.append(_ok_line(head, text))
        self.store.put(self.version, stored)
        self._record_failures(failures)
        self.failed_computing += len(failures)
        self._journal(lines)
        self.waiting.difference_update(chunk.keys)
        self.chunk_stats.append({**stats, "n": len(chunk)})

    def fail(self, chunk: Chunk, reason: str, error: str, stats: dict[str, Any] | None = None) -> None:
        """Every input of a chunk failed for one reason (the worker could not be had, it kept dying)."""
        self._record_failures([(key, reason, error) for key in chunk.keys])
        self.failed_computing += len(chunk)
        self._journal([_failure_line(_head(index, ident), reason, error)
                       for index, ident in zip(chunk.indexes, chunk.ids, strict=True)])
        self.waiting.difference_update(chunk.keys)
        self.chunk_stats.append({**(stats or {}), "failed": True, "n": len(chunk)})

    def _record_failures(self, failures: list[tuple[bytes, str, str]]) -> None:
        if failures:
            self.db.execute("BEGIN")
            self.db.executemany("INSERT OR REPLACE INTO temp.failures (key, reason, error) VALUES (?, ?, ?)",
                                failures)
            self.db.execute("COMMIT")

    def _journal(self, lines: list[str]) -> None:
        self.journal.writelines(lines)
        self.journal.flush()

    # -- the output ---------------------------------------------------------------
    def _joined(self) -> Iterator[tuple[int, str, str | None, str | None, str | None, str | None]]:
        return self.db.execute("""
            SELECT s.idx, s.id, s.error, r.result, f.reason, f.error
            FROM temp.slots AS s
            LEFT JOIN main.results AS r ON r.key = s.key
            LEFT JOIN temp.failures AS f ON f.key = s.key
            ORDER BY s.idx
        """)

    def write(self, fmt: Literal["jsonl", "parquet"] = "jsonl", sample: VectorSample | None = None) -> dict[str, Any]:
        """Write the output in input order, one record per input, atomically; returns the counts, with the
        first failures (``failures``). ``sample`` is offered every result written (the report's map)."""
        if fmt not in OUTPUT_FORMATS:
            raise InputError(f"unknown output format {fmt!r}; use one of {', '.join(OUTPUT_FORMATS)}")
        self.journal.flush()  # kept open, and locked, until the output has replaced the old one
        temp = f".{self.output.name}.{uuid.uuid4().hex[:8]}.tmp"
        fd = self.folder.open(temp, os.O_EXCL)
        try:
            with os.fdopen(fd, "wb") as out:
                rows = _Counted(self._joined(), sample)
                if fmt == "parquet":
                    _write_parquet(out, rows, self._first_result())
                else:
                    _write_jsonl(out, rows)
            self.folder.replace(temp, self.output.name)
        except BaseException:
            self.folder.unlink(temp)
            raise
        self._forget(rows.demoted)
        self.folder.unlink(self.journal_name)
        self.journal.close()
        return rows.counts

    def _forget(self, indexes: list[int]) -> None:
        """Drop from the store the answers of inputs the writer could not write: computed again next time."""
        for start in range(0, len(indexes), 4096):
            batch = indexes[start:start + 4096]
            marks = ",".join("?" * len(batch))
            keys = [key for (key,) in self.db.execute(
                f"SELECT key FROM temp.slots WHERE idx IN ({marks})", batch)]  # noqa: S608 - only '?' marks
            self.store.forget(keys)

    def _first_result(self) -> dict[str, Any] | None:
        """The result the Parquet columns are drawn from: the first whose vectors decode (an older version may
        have stored one that does not, and it must not shape every column)."""
        first = None
        for (text,) in self.db.execute("SELECT r.result FROM temp.slots AS s JOIN main.results AS r ON "
                                       "r.key = s.key ORDER BY s.idx LIMIT 100"):
            result = json.loads(text)
            first = first or result
            if isinstance(result, dict) and _f32_problem(result.get("embedding_f32", "")) is None:
                return result
        return first


FAILURES_KEPT = 100  # failures a campaign's table shows; every one is in the output
_MISSING = ("not_computed", "no result and no failure was recorded for this input; run the campaign again")


class _Counted:
    """The joined rows, each resolved to (index, id, ok, result JSON, reason, error), counted on the way.

    Keeps the first FAILURES_KEPT failures (index, id, reason, the error's first line) for the failed-inputs
    table, and offers each result to ``sample``.
    """

    def __init__(self, rows: Iterable[tuple], sample: VectorSample | None = None) -> None:
        self.rows = rows
        self.sample = sample
        self.counts: dict[str, Any] = {"records": 0, "ok": 0, "failed": 0, "missing": 0, "failure_reasons": {},
                                       "failures": []}
        self.demoted: list[int] = []

    def __iter__(self) -> Iterator[tuple[int, str, bool, str | None, str | None, str | None]]:
        counts, reasons, kept = self.counts, self.counts["failure_reasons"], self.counts["failures"]
        offer = self.sample.offer if self.sample is not None else None
        for index, ident, bad, stored, recorded_reason, recorded_error in self.rows:
            counts["records"] += 1
            if stored is not None and bad is None:
                counts["ok"] += 1
                if offer is not None:
                    offer(ident, stored)
                yield index, ident, True, stored, None, None
                continue
            if bad is not None:
                reason, error = "bad_input", bad
            elif recorded_reason is None:
                (reason, error), counts["missing"] = _MISSING, counts["missing"] + 1
            else:
                reason, error = recorded_reason, recorded_error
            counts["failed"] += 1
            reasons[reason] = reasons.get(reason, 0) + 1
            if len(kept) < FAILURES_KEPT:
                kept.append({"index": index, "id": ident, "reason": reason, "error": first_line(error)})
            yield index, ident, False, None, reason, error

    def demote(self, index: int, reason: str) -> None:
        """Input ``index``, counted ok, turned out not to be writable: count it failed for ``reason``."""
        self.demoted.append(index)
        reasons = self.counts["failure_reasons"]
        self.counts["ok"] -= 1
        self.counts["failed"] += 1
        reasons[reason] = reasons.get(reason, 0) + 1
        if len(self.counts["failures"]) < FAILURES_KEPT:
            self.counts["failures"].append({"index": index, "id": "", "reason": reason,
                                            "error": "its answer could not be written to the output"})


def first_line(text: str | None, limit: int = 300) -> str:
    """An error's first non-empty line, cut at ``limit`` characters."""
    line = next((part.strip() for part in (text or "").splitlines() if part.strip()), "")
    return line if len(line) <= limit else line[:limit - 1] + "…"


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
    size, large = _decoded_size(result, limit)
    if size > limit:
        return "", f"the answer is over {limit} bytes decoded (RESIDENT_POOL_MAX_RESULT_BYTES); it was not written"
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


def _write_jsonl(out, rows: _Counted) -> None:
    batch: list[str] = []
    for index, ident, ok, result, reason, error in rows:
        head = _head(index, ident)
        batch.append(_ok_line(head, result) if ok else _failure_line(head, reason, error))
        if len(batch) >= 4096:
            out.write("".join(batch).encode())
            batch.clear()
    out.write("".join(batch).encode())


# -- Parquet --------------------------------------------------------------------------
def _write_parquet(out, rows: _Counted, example: dict[str, Any] | None, batch_rows: int = 8192) -> None:
    """id, index, ok, reason, error, then the result's fields; embeddings as fixed-size float32 lists."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise InputError("--format parquet needs pyarrow: pip install 'resident-pool[parquet]'") from None
    columns = _parquet_columns(example or {}, pa)
    schema = pa.schema([("id", pa.string()), ("index", pa.int64()), ("ok", pa.bool_()), ("reason", pa.string()),
                        ("error", pa.string())] + [(name, kind) for name, kind, _ in columns])
    with pq.ParquetWriter(out, schema) as writer:
        batch: list[tuple] = []
        for row in rows:
            batch.append(row)
            if len(batch) >= batch_rows:
                writer.write_table(_parquet_batch(batch, columns, schema, pa, rows))
                batch.clear()
        if batch or not rows.counts["records"]:
            writer.write_table(_parquet_batch(batch, columns, schema, pa, rows))


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


def _parquet_batch(batch: list[tuple], columns: list[tuple[str, Any, str]], schema, pa, rows: _Counted):
    """One batch as an Arrow table. A stored result whose value does not fit its column (undecodable base64
    float32 an older version stored, a string where the first result had a number) fails its own row as
    bad_answer; the rest of the output is written."""
    cells: list[list[Any]] = [[None] * len(batch) for _ in columns]
    readers = [("embedding_f32" if how == "f32" else name, _cell_reader(kind, how, pa)) for name, kind, how in columns]
    for at, row in enumerate(batch):
        if not row[2]:
            continue
        result = json.loads(row[3])
        converted, problem = [], None
        for source, read in readers:
            value = result.get(source)
            value, problem = (None, None) if value is None else read(value)
            if problem is not None:
                problem = f"{source}: {problem}"
                break
            converted.append(value)
        if problem is not None:
            batch[at] = (row[0], row[1], False, None, "bad_answer",
                         f"{problem}; the stored answer was removed, so the next run computes it again")
            rows.demote(row[0], "bad_answer")
            continue
        for column, value in zip(cells, converted, strict=True):
            column[at] = value
    arrays = [pa.array([row[1] for row in batch], pa.string()), pa.array([row[0] for row in batch], pa.int64()),
              pa.array([row[2] for row in batch], pa.bool_()), pa.array([row[4] for row in batch], pa.string()),
              pa.array([row[5] for row in batch], pa.string())]
    for (_, kind, how), values in zip(columns, cells, strict=True):
        arrays.append(_vectors(values, kind.list_size, pa) if how in ("f32", "floats") else pa.array(values, kind))
    return pa.Table.from_arrays(arrays, schema=schema)


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
