"""The content-addressed result store: one SQLite file per provider, keyed by sha256(version, options, text).

It is the campaign's resume and its dedupe: whatever any earlier campaign of
this user computed with the same provider version and options is answered
from here and never sent to the model again. Beside each input's result it
keeps the output of whole stretches of FASTA files (``regions``), so a file
screened before is written again from a few lookups, not one per input.
SQLite gives atomic writes and locking between concurrent campaigns on the
host (WAL: readers never wait for a writer; a writer waits ``busy_timeout``
for another).
"""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import stat
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ..errors import ResidentPoolError
from ..host.paths import default_results_dir, ensure_private_dir
from ..providers.manifest import Manifest

__all__ = ["UNWRITABLE", "ResultStore", "default_results_dir", "provider_version", "result_key"]

# The reasons a campaign stops for: what it computes can no longer be kept (the store's or the output's disk).
UNWRITABLE = frozenset({"disk_full", "store_unwritable"})
BUSY_TIMEOUT_MS = 120_000  # another campaign's write is one chunk: milliseconds, but a slow disk may stall it
_SCHEMA = """
CREATE TABLE IF NOT EXISTS results (
    key BLOB PRIMARY KEY,   -- sha256(version, options, text)
    version TEXT NOT NULL,  -- which provider version computed it, to prune old ones
    result TEXT NOT NULL,   -- the provider's answer for this input, compact JSON
    created REAL NOT NULL
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS regions (
    key BLOB PRIMARY KEY,   -- inputs.Region.key: the records' bytes, their place in the file, version, options
    version TEXT NOT NULL,
    records INTEGER NOT NULL,
    output TEXT NOT NULL,   -- their JSON Lines records as a campaign wrote them, every one ok
    created REAL NOT NULL
) WITHOUT ROWID;
"""


# Keys looked up per statement, always this many (the last batch padded with b"", no key): each distinct
# statement is prepared and cached by the connection, and one with thousands of '?' marks holds most of a
# megabyte; batches of every length a file's stretches came in cached 128 of them, 90 MB (measured).
_LOOKUP = 1024
_LOOKUP_SQL = f"SELECT key, result FROM results WHERE key IN ({','.join('?' * _LOOKUP)})"  # noqa: S608 - only '?'


def provider_version(manifest: Manifest) -> str:
    """The provider version a result belongs to: part of every key, so a new version computes anew.

    The same version the pool stamps on the replicas it serves from (and on each lease): what
    changes answers, not a lifecycle or description edit.
    """
    return manifest.version()


def options_text(options: dict[str, Any]) -> str:
    return json.dumps(options, sort_keys=True, separators=(",", ":"))


def result_key(version: str, options: str, text: str) -> bytes:
    """sha256 over the version, the canonical options and the input's text (not its position or id)."""
    return hashlib.sha256(f"{version}\0{options}\0{text}".encode()).digest()




class ResultStore:
    """One provider's stored results. Not thread-safe: one connection, used by one thread."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        ensure_private_dir(self.path.parent, "result store directory", "RESIDENT_POOL_RESULTS_DIR")
        try:
            info = self.path.lstat()
        except FileNotFoundError:
            info = None
        if info is not None and not stat.S_ISREG(info.st_mode):
            raise ResidentPoolError(f"result store {self.path} is not a plain file (a symlink?); remove it or set "
                                    "RESIDENT_POOL_RESULTS_DIR to a directory you own", reason="store_unsafe")
        try:
            self.connection = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_MS / 1000, isolation_level=None,
                                              check_same_thread=False)
            self.connection.execute("PRAGMA journal_mode=WAL")
            self.connection.execute("PRAGMA synchronous=NORMAL")  # durable at each checkpoint; WAL keeps it atomic
            self.connection.executescript(_SCHEMA)
        except sqlite3.DatabaseError as exc:
            full = _unwritable(self.path, exc)
            if full is not None:
                raise full from None
            raise ResidentPoolError(f"result store {self.path} cannot be opened ({exc}); move it aside and the next "
                                    "campaign starts a new one", reason="store_unreadable") from None

    @classmethod
    def for_provider(cls, slug: str, root: str | os.PathLike[str]) -> ResultStore:
        """The store every campaign of this user uses for ``slug`` under ``root`` (a slug is a safe file name)."""
        return cls(Path(root) / f"{slug}.sqlite3")

    def close(self) -> None:
        self.connection.close()

    def __enter__(self) -> ResultStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def present(self, keys: list[bytes]) -> set[bytes]:
        """Which of ``keys`` have a stored result."""
        return set(self.results(keys))

    def results(self, keys: list[bytes]) -> dict[bytes, str]:
        """The stored result (its JSON text) of each of ``keys`` that has one."""
        found: dict[bytes, str] = {}
        keys = sorted(keys)  # in the table's order: each page of it is read once per batch, not once per key
        for start in range(0, len(keys), _LOOKUP):
            batch = keys[start:start + _LOOKUP]
            found.update(self.connection.execute(_LOOKUP_SQL, batch + [b""] * (_LOOKUP - len(batch))))
        return found

    def region(self, key: bytes) -> tuple[int, str] | None:
        """A stretch of a file screened before (its record count and output lines), or None."""
        row = self.connection.execute("SELECT records, output FROM regions WHERE key = ?", (key,)).fetchone()
        return None if row is None else (row[0], row[1])

    def put_region(self, key: bytes, version: str, records: int, output: str) -> None:
        with self.transaction():
            self.connection.execute("INSERT OR IGNORE INTO regions (key, version, records, output, created) "
                                    "VALUES (?, ?, ?, ?, ?)", (key, version, records, output, time.time()))

    def get(self, key: bytes) -> dict[str, Any] | None:
        row = self.connection.execute("SELECT result FROM results WHERE key = ?", (key,)).fetchone()
        return None if row is None else json.loads(row[0])

    def put(self, version: str, items: Iterable[tuple[bytes, str]]) -> None:
        """Store ``(key, result JSON)`` pairs in one transaction; a key already there keeps its first result."""
        now = time.time()
        # In key order: keys are hashes, so rows in input order land on pages all over the table; sorted, each
        # page is written once per transaction (half the time per row for 16,384 rows into a million, measured).
        rows = sorted((key, version, text, now) for key, text in items)
        with self.transaction():
            self.connection.executemany("INSERT OR IGNORE INTO results (key, version, result, created) "
                                        "VALUES (?, ?, ?, ?)", rows)

    def forget(self, keys: list[bytes]) -> None:
        """Remove the results of ``keys`` (ones that turned out not to be writable)."""
        if keys:
            with self.transaction():
                self.connection.executemany("DELETE FROM results WHERE key = ?", ((key,) for key in keys))

    def count(self, version: str | None = None) -> int:
        if version is None:
            return self.connection.execute("SELECT count(*) FROM results").fetchone()[0]
        return self.connection.execute("SELECT count(*) FROM results WHERE version = ?", (version,)).fetchone()[0]

    def prune(self, keep_version: str) -> int:
        """Drop every result not computed by ``keep_version``; returns how many went."""
        with self.transaction():
            self.connection.execute("DELETE FROM regions WHERE version != ?", (keep_version,))
            return self.connection.execute("DELETE FROM results WHERE version != ?", (keep_version,)).rowcount

    def transaction(self) -> _Transaction:
        return _Transaction(self.connection, self.path)


class _Transaction:
    """BEGIN IMMEDIATE .. COMMIT (ROLLBACK on error): take the write lock up front, wait for it, never deadlock.

    A write the store's disk has no room for (or cannot take) is rolled back and raised as one sentence naming
    the store and the fix; what earlier transactions stored stays."""

    def __init__(self, connection: sqlite3.Connection, path: Path) -> None:
        self.connection = connection
        self.path = path

    def __enter__(self) -> sqlite3.Connection:
        try:
            self.connection.execute("BEGIN IMMEDIATE")
        except sqlite3.DatabaseError as exc:
            raise _unwritable(self.path, exc) or exc from None
        return self.connection

    def __exit__(self, kind, value, traceback) -> None:
        if kind is None:
            try:
                self.connection.execute("COMMIT")
                return
            except sqlite3.DatabaseError as exc:
                kind, value = type(exc), exc
        if self.connection.in_transaction:  # a failed COMMIT may have rolled back already
            self.connection.execute("ROLLBACK")
        if isinstance(value, sqlite3.DatabaseError):
            full = _unwritable(self.path, value)
            if full is not None:
                raise full from None
            raise value


def _unwritable(path: Path, exc: sqlite3.DatabaseError) -> ResidentPoolError | None:
    """The store's disk is full (or will not take a write): the campaign's sentence for it; None for another
    error."""
    code = getattr(exc, "sqlite_errorcode", None)
    if code == sqlite3.SQLITE_FULL:
        why, reason = "no space left on its disk", "disk_full"
    elif code is not None and code & 0xFF == sqlite3.SQLITE_IOERR:
        why, reason = f"its disk did not take a write ({exc}: full, over a quota, or failing)", "store_unwritable"
    else:
        return None
    return ResidentPoolError(
        f"result store {path}: {why}; free space there (or set RESIDENT_POOL_RESULTS_DIR to a folder on a disk with "
        "room) and run the campaign again: every result stored so far is kept and is not computed again",
        reason=reason, details={"path": str(path)})
