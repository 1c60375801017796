"""A screening campaign's bookkeeping: inputs, chunks, cache keys and the output file.

No Prefect here: ``flows/screen.py`` orchestrates; this keeps the promise that
every input ends with exactly one record, a result or a failure with its reason.
"""

from __future__ import annotations

import csv
import hashlib
import json
import os
import statistics
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["Item", "OutputFile", "chunk_key", "chunks", "failure_records", "read_inputs", "summarize"]

TEXT_FIELDS = ("sequence", "text", "input", "seq")
ID_FIELDS = ("id", "name", "accession")


@dataclass(frozen=True)
class Item:
    index: int  # position in the input: the key of its one output record
    id: str
    text: str


class InputError(ValueError):
    """An input file that cannot be read as a campaign's inputs."""


def read_inputs(path: str | os.PathLike[str]) -> tuple[list[Item], list[dict[str, Any]]]:
    """Items to predict, and records for inputs that failed before any prediction (empty, malformed)."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path}: no such input file; give a FASTA, CSV or JSONL file")
    suffix = path.suffix.lower()
    if suffix in (".fasta", ".fa", ".faa", ".fas"):
        raw = _fasta(path)
    elif suffix == ".csv":
        raw = _csv(path)
    elif suffix in (".jsonl", ".ndjson"):
        raw = _jsonl(path)
    else:
        raise InputError(f"{path}: unknown input format {suffix!r}; use .fasta, .csv or .jsonl")
    items, failures = [], []
    for index, (identifier, text, problem) in enumerate(raw):
        why = problem if problem is not None or text else "empty sequence"
        if why is not None:
            failures.append({"index": index, "id": identifier, "ok": False, "reason": "bad_input", "error": why})
        else:
            items.append(Item(index, identifier, text))
    return items, failures


def _fasta(path: Path) -> Iterable[tuple[str, str, str | None]]:
    identifier, parts, seen = None, [], False
    with open(path, encoding="utf-8") as handle:
        for number, raw_line in enumerate(handle, 1):
            line = raw_line.strip()
            if line.startswith(">"):
                if identifier is not None:
                    yield identifier, "".join(parts).upper(), None
                identifier = line[1:].split()[0] if line[1:].split() else f"line-{number}"
                parts, seen = [], True
            elif line and not seen:
                raise InputError(f"{path}:{number}: sequence data before the first '>' header; is it FASTA?")
            elif line:
                parts.append("".join(line.split()))
    if identifier is not None:
        yield identifier, "".join(parts).upper(), None


def _pick(row: dict[str, Any], names: tuple[str, ...]) -> Any:
    for name in names:
        if name in row:
            return row[name]
    return None


def _csv(path: Path) -> Iterable[tuple[str, str, str | None]]:
    with open(path, newline="", encoding="utf-8") as handle:
        reader = csv.DictReader(handle)
        if not reader.fieldnames or not set(reader.fieldnames) & set(TEXT_FIELDS):
            raise InputError(f"{path}: no column named {' or '.join(TEXT_FIELDS)}; found {reader.fieldnames}")
        for number, row in enumerate(reader, 2):
            identifier = str(_pick(row, ID_FIELDS) or f"row-{number}")
            yield identifier, (_pick(row, TEXT_FIELDS) or "").strip(), None


def _jsonl(path: Path) -> Iterable[tuple[str, str, str | None]]:
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as exc:
                yield f"line-{number}", "", f"line {number} is not JSON: {exc}"
                continue
            if not isinstance(row, dict):
                yield f"line-{number}", "", f"line {number} is not a JSON object"
                continue
            text = _pick(row, TEXT_FIELDS)
            identifier = str(_pick(row, ID_FIELDS) or f"line-{number}")
            if not isinstance(text, str):
                yield identifier, "", f"line {number} has no string field {' or '.join(TEXT_FIELDS)}"
                continue
            yield identifier, text.strip(), None


def chunks(items: list[Item], size: int) -> list[list[Item]]:
    if size < 1:
        raise ValueError(f"chunk_size must be at least 1, not {size}")
    return [items[start : start + size] for start in range(0, len(items), size)]


def chunk_key(provider: str, fingerprint: str, chunk: list[dict[str, Any]]) -> str:
    """Same inputs, same provider, same pins: the same key, so a re-run recomputes nothing."""
    digest = hashlib.sha256()
    digest.update(f"{provider}\0{fingerprint}\0".encode())
    for item in chunk:
        digest.update(f"{item['index']}\0{item['id']}\0{item['text']}\n".encode())
    return f"screen-{provider}-{digest.hexdigest()[:32]}"


def failure_records(chunk: list[dict[str, Any]], reason: str, error: str) -> list[dict[str, Any]]:
    return [{"index": item["index"], "id": item["id"], "ok": False, "reason": reason, "error": error}
            for item in chunk]


class OutputFile:
    """Records appended as chunks finish; compacted at the end to one record per input."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def append(self, records: list[dict[str, Any]]) -> None:
        with open(self.path, "a", encoding="utf-8") as out:
            out.writelines(json.dumps(record) + "\n" for record in records)
            out.flush()
            os.fsync(out.fileno())

    def records(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        with open(self.path, encoding="utf-8") as handle:
            return [json.loads(line) for line in handle if line.strip()]

    def compact(self, total: int) -> list[dict[str, Any]]:
        """Keep one record per input index, a result over a failure, the latest of each; in input order."""
        best: dict[int, dict[str, Any]] = {}
        for record in self.records():
            if record["index"] >= total:
                continue
            current = best.get(record["index"])
            if current is None or record["ok"] or not current["ok"]:
                best[record["index"]] = record
        ordered = [best[index] for index in sorted(best)]
        handle, temp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.")
        with os.fdopen(handle, "w", encoding="utf-8") as out:
            out.writelines(json.dumps(record) + "\n" for record in ordered)
        os.replace(temp, self.path)
        return ordered


def summarize(records: list[dict[str, Any]], chunk_stats: list[dict[str, Any]], total: int,
              wall_s: float) -> dict[str, Any]:
    """The campaign's table: inputs, ok, failed, cold starts, warm median latency, throughput."""
    computed = [s for s in chunk_stats if not s.get("cached")]
    warm = [s["latency_s"] for s in computed if not s.get("cold") and s.get("latency_s") is not None]
    ok = sum(1 for r in records if r["ok"])
    reasons: dict[str, int] = {}
    for record in records:
        if not record["ok"]:
            reasons[record["reason"]] = reasons.get(record["reason"], 0) + 1
    return {
        "inputs": total,
        "ok": ok,
        "failed": len(records) - ok,
        "missing": total - len(records),
        "failure_reasons": reasons,
        "chunks": len(chunk_stats),
        "cached_chunks": sum(1 for s in chunk_stats if s.get("cached")),
        "cold_starts": sum(1 for s in computed if s.get("cold")),
        "warm_median_chunk_latency_ms": round(statistics.median(warm) * 1000, 1) if warm else None,
        "throughput_inputs_per_s": round(total / wall_s, 1) if wall_s > 0 else None,
        "wall_s": round(wall_s, 2),
        "workers": sorted({s["pid"] for s in computed if s.get("pid")}),
    }


