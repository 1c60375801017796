"""A campaign's input files, read lazily: FASTA, CSV, TSV and JSONL, each optionally gzip-compressed.

A record that cannot be used (undecodable, over the size limit, malformed) is
yielded as a bad record naming the file and line; the rest of the file goes on.
A file in which no valid record appears in its first 64 KiB is not an input
file: ``InputFile.check()`` says so, once, before any work starts.
"""

from __future__ import annotations

import codecs
import csv
import errno
import gzip
import hashlib
import io
import itertools
import json
import os
import pwd
import stat
import string
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from ..errors import InputError
from ..host.trust import others_may_write
from ..providers.input_rules import show_character

__all__ = [
    "DEFAULT_MAX_INPUT_BYTES",
    "DEFAULT_MAX_INPUT_RECORDS",
    "DEFAULT_MAX_RECORD_BYTES",
    "FORMATS",
    "ID_FIELDS",
    "SEQUENCE_FIELDS",
    "SNIFF_BYTES",
    "TEXT_FIELDS",
    "InputFile",
    "Record",
    "Region",
    "field_kind",
    "input_format",
    "open_input",
    "snippet",
]

SNIFF_BYTES = 64 * 1024
DEFAULT_MAX_RECORD_BYTES = 1 << 20  # a titin-sized protein is 35 kB; a record this large is a mistake
# Per file, set by the operator, not by the input: a 7 kB .fasta.gz held a million records (a 106 MB output).
DEFAULT_MAX_INPUT_BYTES = 10 * 10**9
DEFAULT_MAX_INPUT_RECORDS = 50_000_000
TEXT_FIELDS = ("sequence", "text", "input", "seq")
# A column or field of these names holds sequences: read as FASTA's are (spaces dropped, upper case), so the
# same protein is the same input whichever file it comes from. "text" and "input" are kept as written.
SEQUENCE_FIELDS = ("sequence", "seq")
ID_FIELDS = ("id", "name", "accession", "entry")
FORMATS = {
    ".fasta": "fasta", ".fa": "fasta", ".faa": "fasta", ".fas": "fasta", ".fna": "fasta",
    ".csv": "csv", ".tsv": "tsv", ".tab": "tsv",
    ".jsonl": "jsonl", ".ndjson": "jsonl",
}
_EXPECTED = {
    "fasta": "FASTA: '>' header lines, each followed by lines of sequence letters",
    "csv": "CSV: a header row naming the columns, then one row per input",
    "tsv": "TSV: a tab-separated header row naming the columns, then one row per input",
    "jsonl": 'JSON Lines: one JSON object per line, with a "sequence" or "text" field',
}
# What a FASTA sequence line may hold: residue or base letters, gaps, stop; spaces are dropped.
_SEQUENCE_BYTES = (string.ascii_letters + "*-.").encode()
_WHITESPACE = b" \t\r\n\v\f"
_BOM = b"\xef\xbb\xbf"  # Notepad and Excel save UTF-8 with one
FASTA_BLOCK = 1 << 20
# gzip asks its file for 128 KiB at a time: a .gz under that is "read whole" at its first record. Fed this much at
# a time, how far it has read says how far it has got, for the progress of a file whose records were not counted.
GZIP_STEP = 16 * 1024


@dataclass(frozen=True, slots=True)
class Record:
    """One input: its position, id and text; or, when ``error`` is set, why it cannot be used."""

    index: int
    id: str
    text: str
    line: int
    error: str | None = None


def input_format(path: str | os.PathLike[str]) -> tuple[str, bool]:
    """The format of ``path`` from its suffix, and whether it is gzip-compressed."""
    suffixes = [s.lower() for s in Path(path).suffixes]
    compressed = bool(suffixes) and suffixes[-1] == ".gz"
    if compressed:
        suffixes.pop()
    kind = FORMATS.get(suffixes[-1]) if suffixes else None
    if kind is None:
        known = ", ".join(sorted(FORMATS))
        raise InputError(f"{path}: unknown input format; name it with one of {known} (optionally .gz)",
                         details={"path": str(path)})
    return kind, compressed


class _Lines:
    """Numbered lines of a binary stream, each read with a bounded buffer.

    Yields ``(number, line, over)``; a line longer than ``limit`` bytes is
    skipped in bounded reads and yielded as its first ``limit`` bytes with
    ``over`` set, so one huge line never makes the reader allocate without bound.
    """

    def __init__(self, stream: IO[bytes], limit: int) -> None:
        self.stream = stream
        self.limit = limit
        self.number = 0
        self.position = 0  # bytes of the stream up to the end of the last line yielded

    def __iter__(self) -> Iterator[tuple[int, bytes, bool]]:
        readline, limit = self.stream.readline, self.limit
        while True:
            line = readline(limit + 1)
            if not line:
                return
            self.number += 1
            self.position += len(line)
            if len(line) > limit and not line.endswith(b"\n"):
                rest = line
                while rest and not rest.endswith(b"\n"):
                    rest = readline(limit + 1)
                    self.position += len(rest)
                yield self.number, line[:limit], True
                continue
            yield self.number, line.rstrip(b"\r\n"), False


class InputFile:
    """One input file: ``check()`` it, then iterate ``records()`` lazily."""

    def __init__(self, path: str | os.PathLike[str], *, column: str | None = None, id_column: str | None = None,
                 max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES, max_input_bytes: int = DEFAULT_MAX_INPUT_BYTES,
                 max_input_records: int = DEFAULT_MAX_INPUT_RECORDS) -> None:
        self.path = Path(path)
        self.format, self.compressed = input_format(self.path)
        self.column = column
        self.id_column = id_column
        self.max_record_bytes = max_record_bytes
        self.max_input_bytes = max_input_bytes
        self.max_input_records = max_input_records
        # What its inputs are, as the reader found them: FASTA and a sequence column or field hold proteins, a text
        # or input one text; None for a column named otherwise (the provider's default kind then). Set by check().
        self.kind: str | None = "protein" if self.format == "fasta" else None
        self._raw: IO[bytes] | None = None
        # Of the current records() pass, for fraction_read(): its parser, what came out of the (decompressed)
        # stream, the file's size, and the fraction said so far (1 once it read to the end).
        self._reader: _Lines | _FastaBlocks | None = None
        self._bounded: _Bounded | None = None
        self._size = 0
        self._fraction = 0.0

    # -- opening -------------------------------------------------------------------
    @contextmanager
    def _open(self) -> Iterator[IO[bytes]]:
        fd = open_input(self.path)
        opened = os.fstat(fd)
        with open(fd, "rb", buffering=1 << 20) as raw:
            self._raw = raw
            if not self.compressed:
                yield raw
            else:
                with gzip.GzipFile(fileobj=_Metered(raw), mode="rb") as unpacked:
                    yield unpacked
            now = os.fstat(raw.fileno())
            if (now.st_size, now.st_mtime_ns) != (opened.st_size, opened.st_mtime_ns):
                # Rewritten in place, or still being copied in: what was read may mix two versions.
                raise InputError(f"{self.path}: the file changed while it was read (its size or modification "
                                 "time moved), so no output is written for it: run again once it is complete "
                                 "(write an inbox file under another name, then rename it in)",
                                 details={"path": str(self.path)})

    def size(self) -> int:
        """The file's size in bytes; 0 when it cannot be read (records() then says why)."""
        try:
            return os.lstat(self.path).st_size
        except OSError:
            return 0

    def fraction_read(self) -> float:
        """How far records() has got, from 0 to 1: the bytes up to the last record it handed out over the file's
        bytes (for a .gz, decompressed). Never less than it said before, and 1 once it has read to the end.

        A .gz's decompressed size is known only at its end: until then it is estimated from the compression
        ratio of what was decompressed so far (gzip is fed GZIP_STEP bytes at a time, so the ratio is measured
        from the first record on, whatever the file's size). Records are read a megabyte at a time, so the
        position is the parser's, not the reader's.
        """
        reader, bounded = self._reader, self._bounded
        if reader is None or bounded is None or self._fraction >= 1.0:
            return self._fraction
        if not self.compressed:
            total = float(self._size)
        elif bounded.ended:
            total = float(bounded.produced)
        else:
            consumed = self._compressed_read()
            total = bounded.produced * self._size / consumed if consumed else 0.0
        if total > 0:
            self._fraction = max(self._fraction, min(1.0, reader.position / total))
        return self._fraction

    def _compressed_read(self) -> int:
        raw = self._raw
        try:
            return raw.tell() if raw is not None else self._size
        except (OSError, ValueError):  # closed as the pass ended
            return self._size

    def record_count(self) -> int | None:
        """How many records the file holds, by a quick pass over its bytes; None for a compressed file.

        Exact for a well-formed file (a line the reader skips, such as a row of empty cells, makes it an
        overcount by that much); a campaign's progress uses it as the number of inputs to expect. Read a
        megabyte at a time and never past the operator's byte limit (a sparse 3 GiB file with no newline
        costs a block, not 3 GiB); a file it cannot count is None, and records() refuses it alone.
        """
        if self.compressed:
            return None  # counting would cost a whole decompression: estimate from fraction_read instead
        try:
            with self._open() as raw:  # opened as records() opens it, so refused alike
                if os.fstat(raw.fileno()).st_size > self.max_input_bytes:
                    return None  # records() refuses it by the limit, before reading that far
                bounded = _Bounded(raw, self)
                lines = _count_headers(bounded) if self.format == "fasta" else _count_lines(bounded)
        except (InputError, OSError):
            return None  # records() will say what is wrong with it
        finally:
            self._raw = None
        if self.format == "fasta":
            return lines
        return max(0, lines - 1) if self.format in ("csv", "tsv") else lines

    # -- the first 64 KiB ------------------------------------------------------------
    def check(self) -> None:
        """Raise InputError unless a valid record appears in the first 64 KiB."""
        with self._open() as stream:
            head = self._read_head(stream)
        truncated = len(head) == SNIFF_BYTES
        cut = (head.rindex(b"\n") + 1 if b"\n" in head else 0) if truncated else len(head)
        head, tail = head[:cut], head[cut:]
        first_problem = None
        for record in self._parse(io.BytesIO(head), truncated=truncated):
            if record.error is None:
                return
            first_problem = first_problem or record.error
        if first_problem is None and _text_so_far(tail):
            return  # a first record longer than the sniff, readable as far as it goes
        what = _EXPECTED[self.format] + (", gzip-compressed" if self.compressed else "")
        found = "it is empty" if not head else (first_problem or "no record at all")
        raise InputError(f"{self.path}: not a {self.format.upper()} input file: no valid record in its first "
                         f"{SNIFF_BYTES // 1024} KiB ({found.removeprefix(f'{self.path}:')}); expected {what}",
                         details={"path": str(self.path)})

    def _read_head(self, stream: IO[bytes]) -> bytes:
        try:
            return stream.read(SNIFF_BYTES)
        except (gzip.BadGzipFile, EOFError, zlib.error) as exc:
            raise InputError(f"{self.path}: not gzip-compressed data ({exc}); a .gz input must be gzip-compressed",
                             details={"path": str(self.path)}) from None

    # -- all of it -------------------------------------------------------------------
    def records(self, regions: bool = False) -> Iterator[Record | Region]:
        """Every record of the file, in order, read lazily; bad ones carry their error.

        ``regions``: a FASTA file's records come as Regions where they can (each ``records()`` parses its
        own), other records one by one. Past the operator's limits (records, or bytes once decompressed)
        it raises InputError: the file is refused as a whole, never cut short into an output that looks
        complete.
        """
        self._fraction, self._size = 0.0, self.size()
        with self._open() as stream:
            limit = self.max_input_records
            self._bounded = _Bounded(stream, self)
            count = 0
            try:
                for item in self._parse(self._bounded, regions=regions):
                    count += item.count if isinstance(item, Region) else 1
                    if count > limit:
                        raise InputError(f"{self.path}: more than {limit:,} records (RESIDENT_POOL_MAX_INPUT_RECORDS); "
                                         "no output is written for it: split the file, or raise the limit",
                                         details={"path": str(self.path), "limit": "records"})
                    yield item
            except (gzip.BadGzipFile, EOFError, zlib.error) as exc:
                raise InputError(f"{self.path}: the compressed data is damaged ({exc}); the records before the "
                                 "damage were read", details={"path": str(self.path)}) from None
            except OSError as exc:  # an I/O error, a file on a mount gone away: this file fails, not the run
                raise InputError(f"{self.path}: cannot be read ({exc.strerror or exc}); no output is written for "
                                 "it", details={"path": str(self.path)}) from None
            self._fraction = 1.0

    def _parse(self, stream: IO[bytes], truncated: bool = False, regions: bool = False) -> Iterator[Record | Region]:
        if self.format == "fasta":
            return self._fasta(stream, truncated, regions)
        lines = self._reader = _Lines(stream, self.max_record_bytes)
        if self.format == "jsonl":
            return self._jsonl(lines)
        return self._table(lines, "\t" if self.format == "tsv" else ",")

    def bad(self, index: int, identifier: str, line: int, problem: str) -> Record:
        return Record(index, identifier, "", line, f"{self.path}:{line}: {problem}")

    # FASTA ---------------------------------------------------------------------------
    def _fasta(self, stream: IO[bytes], truncated: bool, regions: bool) -> Iterator[Record | Region]:
        self._reader = _FastaBlocks(self, stream, truncated, regions)
        return self._reader.records()

    def fasta_record(self, index: int, line: int, record: bytes, over: bool = False, last: bool = False) -> Record:
        """One record's bytes, from its '>' to the end of its last sequence line."""
        newline = record.find(b"\n")
        header, body = (record[1:], b"") if newline < 0 else (record[1:newline], record[newline + 1:])
        try:
            words = header.rstrip(b"\r").decode("utf-8").split()
        except UnicodeDecodeError as exc:
            return self.bad(index, f"line-{line}", line, f"the header is not UTF-8 text (byte {exc.start + 2})")
        identifier = words[0] if words else f"line-{line}"
        if over:
            return self.bad(index, identifier, line, f"the record is over the {self.max_record_bytes}-byte limit "
                                                      "(RESIDENT_POOL_MAX_RECORD_BYTES)")
        sequence = body.translate(None, _WHITESPACE)
        stray = sequence.translate(None, _SEQUENCE_BYTES)
        if stray:
            where = line + 1 + body.count(b"\n", 0, body.find(stray[:1]))
            return self.bad(index, identifier, line, f"line {where} holds {show_character(chr(stray[0]))}, which is "
                                                      "not a sequence letter")
        if not sequence and not last:
            return self.bad(index, identifier, line, "empty sequence")
        return Record(index, identifier, sequence.upper().decode("ascii"), line)

    # CSV and TSV ---------------------------------------------------------------------
    def _table(self, lines: _Lines, delimiter: str) -> Iterator[Record]:
        """One row per line, always: a quote left open (a stray '"' in a name) fails its own row, never swallows
        the rows after it. TSV has no quoting (UniProt's is plain tab-separated text); CSV keeps its quoting
        within a line (a quoted name may hold commas), so a multi-line quoted field is not an input row."""
        limit = self.max_record_bytes
        # The csv module's own cap (131,072 bytes) would raise out of the reader; ours is per record.
        if csv.field_size_limit() < limit:
            csv.field_size_limit(limit)
        cells_of = _tsv_cells if delimiter == "\t" else _csv_cells
        header: list[str] | None = None
        text_at = id_at = None
        normalize = str.strip
        index = 0
        for number, line, over in lines:
            cells, problem = None, None
            if over:
                problem = f"line {number} is over the {limit}-byte record limit (RESIDENT_POOL_MAX_RECORD_BYTES)"
            else:
                try:
                    text = line.decode("utf-8")
                except UnicodeDecodeError as exc:
                    problem = f"line {number} is not UTF-8 text (byte {exc.start + 1})"
                else:
                    if number == 1:
                        text = text.removeprefix("\ufeff")
                    cells, problem = cells_of(text, self.format.upper())
            if header is None:
                if problem is not None:
                    raise InputError(f"{self.path}: not a {self.format.upper()} input file: the header row cannot "
                                     f"be read ({problem}); expected {_EXPECTED[self.format]}",
                                     details={"path": str(self.path)})
                header = [cell.strip() for cell in cells]
                text_at = self._pick_column(header, self.column, TEXT_FIELDS, "--column")
                id_at = self._pick_column(header, self.id_column, ID_FIELDS, "--id-column",
                                          required=bool(self.id_column))
                normalize = _sequence_text if header[text_at].lower() in SEQUENCE_FIELDS else str.strip
                self.kind = field_kind(header[text_at])
                continue
            if problem is not None:
                yield self.bad(index, f"line-{number}", number, problem)
                index += 1
                continue
            if not any(cell.strip() for cell in cells):
                continue
            identifier = cells[id_at].strip() if id_at is not None and id_at < len(cells) else ""
            identifier = identifier or f"line-{number}"
            value = normalize(cells[text_at]) if text_at < len(cells) else ""
            if not value:
                yield self.bad(index, identifier, number, f"no value in column {snippet(header[text_at])}")
            else:
                yield Record(index, identifier, value, number)
            index += 1
        if header is None:  # an empty file: name the column it lacks
            self._pick_column([], self.column, TEXT_FIELDS, "--column")

    def _pick_column(self, header: list[str], wanted: str | None, defaults: tuple[str, ...], option: str,
                     required: bool = True) -> int | None:
        """The column named ``wanted`` (or the first of ``defaults``), matched case-insensitively."""
        lowered = [cell.lower() for cell in header]
        for name in (wanted,) if wanted else defaults:
            if name.lower() in lowered:
                return lowered.index(name.lower())
        if not required:
            return None
        asked = repr(wanted) if wanted else " or ".join(repr(name) for name in defaults)
        # The header row is the file's content, and a refused file is never quoted: a table of credentials (or a
        # link planted to one) must not reach a log or a flow run's page through this message.
        held = f"its header row has {len(header)} column(s), none so named" if header else "it has no header row"
        raise InputError(f"{self.path}: no column named {asked} (matched ignoring case); {held}; name the input "
                         f"column with {option} NAME", details={"path": str(self.path)})

    # JSON Lines ----------------------------------------------------------------------
    def _jsonl(self, lines: _Lines) -> Iterator[Record]:
        limit = self.max_record_bytes
        text_names = (self.column,) if self.column else TEXT_FIELDS
        id_names = (self.id_column,) if self.id_column else ID_FIELDS
        index = 0
        for number, line, over in lines:
            fallback = f"line-{number}"
            if over:
                yield self.bad(index, fallback, number, f"the line is over the {limit}-byte record limit "
                                                         "(RESIDENT_POOL_MAX_RECORD_BYTES)")
                index += 1
                continue
            if not line.strip():
                continue
            try:
                row = json.loads((line.removeprefix(_BOM) if number == 1 else line).decode("utf-8"))
            except UnicodeDecodeError as exc:
                problem = f"not UTF-8 text (byte {exc.start + 1})"
            except ValueError as exc:
                problem = f"not JSON: {exc}"
            except RecursionError:
                problem = "JSON nested too deeply to read"
            else:
                problem = None if isinstance(row, dict) else f"a JSON {type(row).__name__}, not an object"
            if problem is not None:
                yield self.bad(index, fallback, number, problem)
                index += 1
                continue
            text_name, text = _field(row, text_names)
            identifier = _field(row, id_names)[1]
            identifier = str(identifier) if isinstance(identifier, str | int) and identifier != "" else fallback
            if not isinstance(text, str) or not text.strip():
                names = " or ".join(repr(name) for name in text_names)
                yield self.bad(index, identifier, number, f"no non-empty string field {names}")
            else:
                value = _sequence_text(text) if text_name.lower() in SEQUENCE_FIELDS else text.strip()
                if self.kind is None:  # the file's first input says what its inputs are
                    self.kind = field_kind(text_name)
                yield Record(index, identifier, value, number)
            index += 1


class _Bounded:
    """A stream that raises InputError once more than the file's ``max_input_bytes`` have come out of it."""

    def __init__(self, stream: IO[bytes], source: InputFile) -> None:
        self.stream, self.source = stream, source
        self.left = source.max_input_bytes
        self.produced = 0  # bytes that came out so far
        self.ended = False  # a read came back empty: ``produced`` is the whole (decompressed) size

    def _count(self, data: bytes) -> bytes:
        self.left -= len(data)
        self.produced += len(data)
        self.ended = self.ended or not data
        if self.left < 0:
            what = "decompressed" if self.source.compressed else "read"
            raise InputError(f"{self.source.path}: more than {self.source.max_input_bytes:,} bytes {what} "
                             "(RESIDENT_POOL_MAX_INPUT_BYTES); no output is written for it: split the file, or "
                             "raise the limit", details={"path": str(self.source.path), "limit": "bytes"})
        return data

    def read(self, size: int = -1) -> bytes:
        return self._count(self.stream.read(size if size >= 0 else self.left + 1))

    def readline(self, size: int = -1) -> bytes:
        return self._count(self.stream.readline(size if size >= 0 else self.left + 1))


class _Metered:
    """The compressed file as gzip reads it: at most GZIP_STEP bytes a read, so its position says how far the
    decompression has got (gzip's own reads are 128 KiB)."""

    def __init__(self, raw: IO[bytes]) -> None:
        self.raw = raw

    def read(self, size: int = -1) -> bytes:
        return self.raw.read(GZIP_STEP if size < 0 else min(size, GZIP_STEP))


class Region:
    """Whole FASTA records read together (about a megabyte), kept as their bytes until asked for.

    ``records()`` parses them; ``key()`` names them by their bytes and their place in the file, so a
    campaign can recognise a stretch of a file it has screened before without parsing it again.
    """

    __slots__ = ("count", "data", "first_index", "first_line", "source")

    def __init__(self, source: InputFile, data: bytes, first_index: int, first_line: int, count: int) -> None:
        self.source, self.data = source, data  # the records, the first one's '>' left off
        self.first_index, self.first_line, self.count = first_index, first_line, count

    def key(self, *names: str) -> bytes:
        """sha256 over ``names``, this code's version, the record limit, the place in the file and the bytes."""
        from ..version import __version__

        head = "\0".join(["region-1", __version__, *names, str(self.source.max_record_bytes), str(self.first_index),
                          str(self.first_line)])
        return hashlib.sha256(head.encode() + b"\0" + self.data).digest()

    def records(self) -> list[Record]:
        """The records, each what ``InputFile.fasta_record`` would make of its bytes.

        Split at once on '\\n>'; a record that needs more than this loop checks (a header that is not ASCII,
        a carriage return, a stray byte, an empty sequence, one over the limit) goes to ``fasta_record``.
        """
        source, limit, line, index = self.source, self.source.max_record_bytes, self.first_line, self.first_index
        translate, whitespace, letters = bytes.translate, _WHITESPACE, _SEQUENCE_BYTES
        records = []
        for part in self.data.split(b"\n>"):
            newline = part.find(b"\n")
            header = part[:newline]
            sequence = translate(part[newline + 1:], None, whitespace)
            words = header.decode("ascii").split(None, 1) if header.isascii() else None
            if (newline < 0 or len(part) >= limit or not sequence or not words or b"\r" in header
                    or translate(sequence, None, letters)):
                records.append(source.fasta_record(index, line, b">" + part, over=len(part) >= limit))
            else:
                records.append(Record(index, words[0], sequence.upper().decode("ascii"), line))
            index += 1
            line += part.count(b"\n") + 1
        return records


class _FastaBlocks:
    """FASTA read a megabyte at a time and split on '\\n>': a million records in seconds, not minutes.

    A record is everything from its '>' to the next header line; one larger
    than the record limit is reported and skipped without being held.
    """

    def __init__(self, source: InputFile, stream: IO[bytes], truncated: bool, regions: bool = False) -> None:
        self.source, self.stream, self.truncated, self.regions = source, stream, truncated, regions
        self.limit = source.max_record_bytes
        self.buffer = b""
        self.dropped = 0  # bytes of the stream before the buffer's start
        self.position = 0  # bytes of the stream up to the end of the last record yielded
        self.line = 1  # the line the buffer starts on
        self.index = 0
        self.eof = False
        self.bom_checked = False

    def records(self) -> Iterator[Record]:
        started = skipping = False
        while not self.eof:
            data = self.stream.read(FASTA_BLOCK)
            self.eof = not data
            self.buffer += data
            if skipping and not self._skip():
                continue
            skipping = False
            if not self.bom_checked:  # a BOM is the file's first bytes: wait for all three of them
                if self.buffer and _BOM.startswith(self.buffer) and not self.eof:
                    continue
                if self.buffer.startswith(_BOM):
                    self._advance(len(_BOM))
                self.bom_checked = True
            if not started:
                started = yield from self._preamble()
                if not started or not self.buffer:
                    continue
            skipping = yield from self._complete_records()

    def _advance(self, to: int) -> None:
        """Drop the buffer up to ``to``, counting its lines."""
        self.line += self.buffer.count(b"\n", 0, to)
        self.buffer = self.buffer[to:]
        self.dropped += to

    def _skip(self) -> bool:
        """Inside a record over the limit: True once the next header is at the buffer's start."""
        found = self.buffer.find(b"\n>")
        if found < 0:
            # Keep the last byte: a '\n' there may be followed by '>' in the next block.
            self._advance(len(self.buffer) - 1 if not self.eof else len(self.buffer))
            return False
        self._advance(found + 1)
        return True

    def _preamble(self) -> Iterator[Record]:
        """Before the first header: anything but blank lines is one bad record. Returns whether a header came."""
        buffer = self.buffer
        first = 0 if buffer.startswith(b">") else buffer.find(b"\n>") + 1
        if first == 0 and not buffer.startswith(b">"):
            if not self.eof and len(buffer) <= self.limit:
                return False  # read on
            first = len(buffer)
        if buffer[:first].strip():
            yield self.source.bad(self.index, f"line-{self.line}", self.line,
                                  "sequence data before the first '>' header; is this FASTA?")
            self.index += 1
        self._advance(first)
        return bool(self.buffer) or self.eof

    def _complete_records(self) -> Iterator[Record | Region]:
        """Every record the buffer holds whole; returns True when one over the limit is being skipped."""
        base = self.dropped
        region = self._region()
        if region is not None:
            if self.regions:
                self.position = self.dropped
                yield region
            else:  # the parser's position moves through the region with its records, for fraction_read
                span = self.dropped - base
                for number, record in enumerate(region.records(), 1):
                    self.position = base + span * number // region.count
                    yield record
        buffer, at, skipping = self.buffer, 0, False
        while True:
            end = buffer.find(b"\n>", at + 1)
            if end < 0 and not self.eof:
                if len(buffer) - at > self.limit:  # over the limit and still going: report it, skip the rest
                    self.position = self.dropped + len(buffer)
                    yield self._record(buffer[at:at + self.limit], over=True)
                    self.line += buffer.count(b"\n", at, len(buffer) - 1)
                    at, skipping = len(buffer) - 1, True
                break
            last = end < 0
            end = len(buffer) if last else end
            if at < end:
                self.position = self.dropped + end
                yield self._record(buffer[at:end], over=end - at > self.limit, last=last and self.truncated)
            if last:
                at = end
                break
            self.line += buffer.count(b"\n", at, end) + 1
            at = end + 1
        self.buffer = buffer[at:]
        self.dropped += at
        return skipping

    def _region(self) -> Region | None:
        """The records before the buffer's last header, taken whole as one Region (the fast path for FASTA)."""
        buffer = self.buffer
        cut = buffer.rfind(b"\n>")
        if cut <= 0 or not buffer.startswith(b">"):
            return None
        data = buffer[1:cut]
        region = Region(self.source, data, self.index, self.line, data.count(b"\n>") + 1)
        self.index += region.count
        self.line += data.count(b"\n") + 1
        self.buffer = buffer[cut + 1:]
        self.dropped += cut + 1
        return region

    def _record(self, data: bytes, over: bool, last: bool = False) -> Record:
        record = self.source.fasta_record(self.index, self.line, data, over=over, last=last)
        self.index += 1
        return record


# Kernel and device filesystems: a name there is never an input file, whatever it is called or linked as.
SPECIAL_FOLDERS = ("/proc", "/sys", "/dev")


def open_input(path: Path) -> int:
    """Open an input file for reading, never following a link on any part of its path; returns the descriptor
    (blocking).

    An inbox others can write into may hold a link planted to your private files or to ``/proc/self/environ``, as
    the file itself or as a folder on the way (``inbox/sub`` -> your home), so: every folder of the path is opened
    one by one from ``/`` without following a link (O_NOFOLLOW on each, each held open while the next is opened,
    so a swap after a check changes nothing) and the file itself likewise; every special file is refused (checked
    on the opened file), as is anything under /proc, /sys or /dev by name and by filesystem, and a file with more
    than one hard link in a folder others can write, or that another user owns (a planted hard link to your file:
    where fs.protected_hardlinks is off, anyone may link to a file they cannot read). The file's owner does not
    matter: a colleague's file in a group inbox is fine. A refusal names the file and never quotes it.
    """
    where = {"path": str(path)}
    spelled = os.path.abspath(path)
    for real in (spelled, os.path.realpath(path)):
        for top in SPECIAL_FOLDERS:
            if real == top or real.startswith(top + "/"):
                raise InputError(f"{path}: lies under {top}, a kernel or device folder, never an input; give a "
                                 "FASTA, CSV, TSV or JSONL file", details=where)
    folder_fd = _open_folders(path, os.path.dirname(spelled))
    try:
        try:
            # O_NONBLOCK: a FIFO named seqs.fasta must not hang the campaign before it is refused.
            fd = os.open(os.path.basename(spelled), os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_NOCTTY
                         | os.O_CLOEXEC, dir_fd=folder_fd)
        except FileNotFoundError:
            raise InputError(f"{path}: no such input file; give a FASTA, CSV, TSV or JSONL file, or a folder of "
                             "them", details=where) from None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise InputError(f"{path}: a symbolic link; an input is opened, never followed: give the file "
                                 "itself", details=where) from None
            raise InputError(f"{path}: cannot be opened ({exc.strerror})", details=where) from None
        try:
            _check_opened(path, fd, os.fstat(folder_fd), where)
        except BaseException:
            os.close(fd)
            raise
    finally:
        os.close(folder_fd)
    return fd


def _open_folders(path: Path, folder: str) -> int:
    """``folder`` (absolute) opened component by component from ``/``, never through a link: its descriptor."""
    fd = os.open("/", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    walked = "/"
    try:
        for part in folder.split("/"):
            if not part:
                continue
            try:
                following = os.open(part, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            except OSError as exc:
                raise _folder_refused(path, os.path.join(walked, part), part, fd, exc) from None
            os.close(fd)
            fd, walked = following, os.path.join(walked, part)
        return fd
    except BaseException:
        os.close(fd)
        raise


def _folder_refused(path: Path, folder: str, name: str, parent_fd: int, exc: OSError) -> InputError:
    where = {"path": str(path)}
    try:
        is_link = stat.S_ISLNK(os.stat(name, dir_fd=parent_fd, follow_symlinks=False).st_mode)
    except OSError:
        is_link = False
    if is_link:
        return InputError(f"{path}: the folder {folder} on its way is a symbolic link; an input is opened, never "
                          "followed, on any part of its path: give the path without links", details=where)
    if exc.errno == errno.ENOENT:
        return InputError(f"{path}: no such input file ({folder} does not exist); give a FASTA, CSV, TSV or JSONL "
                          "file, or a folder of them", details=where)
    if exc.errno == errno.ENOTDIR:
        return InputError(f"{path}: {folder} is not a folder", details=where)
    return InputError(f"{path}: cannot be opened ({folder}: {exc.strerror})", details=where)


def _check_opened(path: Path, fd: int, folder: os.stat_result, where: dict[str, str]) -> None:
    """Refuse what ``fd`` must not be: a special file, a file of a kernel filesystem, a planted hard link."""
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        raise InputError(f"{path}: not a regular file (a FIFO, socket, device or folder); give a FASTA, CSV, "
                         "TSV or JSONL file", details=where)
    if info.st_dev in _special_devices():
        raise InputError(f"{path}: a file of a kernel or device filesystem, never an input", details=where)
    if info.st_nlink > 1:
        writable = others_may_write(folder)
        if folder.st_uid not in (os.getuid(), 0):  # its owner may plant a link as well as any writer
            writable.insert(0, f"its owner ({_user_name(folder.st_uid)})")
        if writable:
            raise InputError(
                f"{path}: has {info.st_nlink} hard links and lies in a folder {' and '.join(writable)} can write "
                "into, so it may be a link planted to someone's private file; copy the file in instead of "
                "linking it", details=where)
    os.set_blocking(fd, True)


def _user_name(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name}, uid {uid}"
    except KeyError:
        return f"uid {uid}"


def _special_devices() -> set[int]:
    devices = set()
    for top in SPECIAL_FOLDERS:
        try:
            devices.add(os.stat(top).st_dev)
        except OSError:
            continue
    return devices


def snippet(text: str, limit: int = 40) -> str:
    """At most ``limit`` characters of ``text`` quoted with escapes: what an error may show of an input."""
    return repr(text[:limit]) + ("..." if len(text) > limit else "")


def _count_headers(raw: IO[bytes] | _Bounded) -> int:
    """FASTA records: lines that start with '>' (after a BOM), counted a megabyte at a time."""
    count, previous, first = 0, b"\n", True
    while block := raw.read(FASTA_BLOCK):
        if first:
            block, first = block.removeprefix(_BOM), False
        count += block.count(b"\n>") + (previous == b"\n" and block[:1] == b">")
        previous = block[-1:]
    return count


def _count_lines(raw: IO[bytes] | _Bounded) -> int:
    """Lines that hold more than whitespace, as the JSONL and table readers skip blank ones, counted a
    megabyte at a time: a line of any length costs one block."""
    count, filled = 0, False  # filled: the line read so far holds more than whitespace
    while block := raw.read(FASTA_BLOCK):
        *complete, rest = block.split(b"\n")
        for line in complete:
            count += filled or bool(line.strip())
            filled = False
        filled = filled or bool(rest.strip())
    return count + filled


def _text_so_far(data: bytes) -> bool:
    """Non-blank UTF-8 text, allowing a character cut off at the end."""
    try:
        return bool(codecs.getincrementaldecoder("utf-8")().decode(data, final=False).strip())
    except UnicodeDecodeError:
        return False


def field_kind(name: str) -> str | None:
    """What a column or field of this name holds: "protein", "text", or None (a name of the caller's own)."""
    lowered = name.lower()
    return "protein" if lowered in SEQUENCE_FIELDS else "text" if lowered in TEXT_FIELDS else None


def _field(row: dict, names: tuple[str, ...]) -> tuple[str | None, object]:
    """The first of ``names`` the row holds (exactly, else ignoring case): its name and value."""
    for name in names:
        if name in row:
            return name, row[name]
    lowered = {str(key).lower(): value for key, value in row.items()}
    for name in names:
        if name.lower() in lowered:
            return name, lowered[name.lower()]
    return None, None


def _sequence_text(value: str) -> str:
    """A sequence field's text as FASTA's would be read: whitespace dropped, upper case. A value that is not
    sequence letters (a SMILES string, a sentence) is only stripped: never changed into another input."""
    if value.isascii() and value.isalpha() and value.isupper():  # already as FASTA's would be: most of them
        return value
    try:
        raw = value.encode("ascii").translate(None, _WHITESPACE)
    except UnicodeEncodeError:
        return value.strip()
    if raw.translate(None, _SEQUENCE_BYTES):
        return value.strip()
    return raw.upper().decode("ascii")


# Fed after a CSV line: a quote the line leaves open reads on into it, and the row is refused.
_AFTER_LINE = ("\n",)


def _csv_cells(text: str, kind: str) -> tuple[list[str] | None, str | None]:
    """One CSV line's cells, or why the line is not a row."""
    if '"' not in text and "\r" not in text:  # nothing quoted: the csv module would split on commas too
        return text.split(","), None
    reader = csv.reader(itertools.chain((text + "\n",), _AFTER_LINE))
    try:
        cells = next(reader)
    except csv.Error as exc:
        return None, f"not a valid {kind} row: {exc}"
    if reader.line_num > 1:
        return None, ("a quote opened in this row is never closed on its line (a stray '\"'?); quote a whole "
                      "field, double a quote inside one; a field may not span lines")
    return cells, None


def _tsv_cells(text: str, kind: str) -> tuple[list[str], None]:
    """One TSV line's cells: split on tabs, no quoting; a field wholly in quotes (as pandas writes one holding
    a tab) is unquoted."""
    cells = text.split("\t")
    if '"' not in text:
        return cells, None
    for at, cell in enumerate(cells):
        if len(cell) >= 2 and cell[0] == cell[-1] == '"':
            cells[at] = cell[1:-1].replace('""', '"')
    return cells, None
