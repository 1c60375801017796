"""The decision core's event log: each event the core heard, with ``now``, and what it decided, one JSON line each.

Opt-in (``RESIDENT_POOL_CORE_LOG``). Its first line records the ``Timings``, the ``Policy`` and the starting
``now``, so ``replay`` can feed the events to a fresh core and check it decides the same actions: an incident,
taken home and stepped through (``resident-pool replay FILE``). Errors are written as their ``to_dict()``. Each
pool start writes a new file, 0600 in a folder only its user reaches; the one before is kept as ``FILE.1``.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import logging
import os
import stat
import threading
import types
import typing
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from ..errors import ResidentPoolError, error_from_dict
from ..host.trust import check_chain
from . import actions as c
from . import events as ev
from .actions import Policy, Timings
from .core import PoolState
from .replica import Spec

__all__ = ["DEFAULT_MAX_BYTES", "FORMAT", "KEPT", "CoreLog", "CoreLogError", "Divergence", "check_path", "decode",
           "encode", "open_new", "read", "replay"]

log = logging.getLogger("resident_pool.pool")

FORMAT = "resident-pool core events 1"
VARIABLE = "RESIDENT_POOL_CORE_LOG"
DEFAULT_MAX_BYTES = 256 * 2**20  # RESIDENT_POOL_CORE_LOG_MAX_MB's default
KEPT = 3  # earlier pools' logs kept beside the current one: FILE.1 (the last pool's) to FILE.3
_RECORDS = {cls.__name__: cls for cls in (*typing.get_args(ev.Event), *typing.get_args(c.Action), ev.Decision, Spec,
                                          Timings, Policy)}


# -- JSON and back, by the records' own type hints ---------------------------------------------------------
def encode(value: Any) -> Any:
    """``value`` as JSON data: a record as ``{"type": name, field: value...}``, an error as ``{"$error": ...}``."""
    if isinstance(value, ResidentPoolError):
        return {"$error": value.to_dict()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {"type": type(value).__name__,
                **{f.name: encode(getattr(value, f.name)) for f in dataclasses.fields(value)}}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, dict):
        return {str(key): encode(item) for key, item in value.items()}
    if isinstance(value, list | tuple | frozenset | set):
        return [encode(item) for item in (sorted(value) if isinstance(value, frozenset | set) else value)]
    return value


def decode(data: dict[str, Any]) -> Any:
    """A record ``encode`` wrote, rebuilt with each field of its declared type."""
    cls = _RECORDS.get(data.get("type", ""))
    if cls is None:
        raise ValueError(f"not a record of the core: {str(data)[:200]}")
    hints = typing.get_type_hints(cls)
    return cls(**{f.name: _as(hints[f.name], data[f.name]) for f in dataclasses.fields(cls) if f.name in data})


def _as(hint: Any, value: Any) -> Any:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        return _as(next(arg for arg in args if arg is not type(None)), value)
    if hint is ResidentPoolError:
        return error_from_dict(value["$error"])
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return hint(value)
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return decode(value)
    if origin is dict:
        key, item = args
        return {_as(key, k): _as(item, v) for k, v in value.items()}
    if origin in (frozenset, tuple, list):
        if origin is tuple and len(args) == 2 and args[1] is not Ellipsis:
            return tuple(_as(arg, item) for arg, item in zip(args, value, strict=True))
        inner = args[0] if args else Any
        items = [_as(inner, item) for item in value]
        return origin(items)
    if hint is float and isinstance(value, int):
        return float(value)
    if hint is int and isinstance(value, str):
        return int(value)  # a dict key written as text
    return value


# -- the log ----------------------------------------------------------------------------------------------
class CoreLog:
    """Appends one line per event; opened by the pool at its start (the header line first).

    It never stops the pool: a line that cannot be written, or the cap reached, ends the log (said once in the
    pool's log, and, at the cap, in a last line that ``replay`` reads), and the pool serves on without it. The
    log is not rotated while the pool runs: a replay starts from a fresh core, so only a whole log from the
    pool's start replays; the cap keeps that beginning.
    """

    def __init__(self, path: Path, timings: Timings, policy: Policy, now: float,
                 max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self.stopped: str | None = None  # why it ended early; None while it logs
        self._lock = threading.Lock()
        self._written = 0
        self._out: TextIO | None = os.fdopen(open_new(path), "w", buffering=1, encoding="utf-8")
        self._write({"format": FORMAT, "timings": encode(timings), "policy": encode(policy), "now": now})

    def write(self, now: float, event: ev.Event, decision: ev.Decision) -> None:
        if self.stopped is not None:
            return
        try:
            line = {"now": now, "event": encode(event), "decision": encode(decision)}
        except (TypeError, ValueError) as exc:  # a record the encoder does not know: a bug, never the pool's end
            self._stop(f"an event could not be written as JSON ({type(exc).__name__}: {exc})")
            return
        self._write(line)

    def _write(self, line: dict[str, Any]) -> None:
        try:
            text = json.dumps(line, separators=(",", ":"), allow_nan=True) + "\n"
        except (TypeError, ValueError) as exc:
            self._stop(f"an event could not be written as JSON ({type(exc).__name__}: {exc})")
            return
        with self._lock:
            if self._out is None:
                return
            if self._written + len(text) > self.max_bytes:
                self._stop(f"it reached its cap of {self.max_bytes / 2**20:g} MB (RESIDENT_POOL_CORE_LOG_MAX_MB); "
                           "later events are not logged", said=True)
                return
            try:
                self._out.write(text)
            except OSError as exc:  # a full disk, a removed mount: the decisions stand, only their record ends
                self._stop(f"it could not be written ({type(exc).__name__}: {exc}); later events are not logged")
                return
            self._written += len(text)

    def _stop(self, why: str, said: bool = False) -> None:
        """End the log once, saying why in the pool's log (and, ``said``, as its last line)."""
        if self.stopped is not None:
            return
        self.stopped = why
        log.error("core event log %s: %s; the pool serves on without it", self.path, why)
        out, self._out = self._out, None
        if out is None:
            return
        try:
            if said:
                out.write(json.dumps({"stopped": why}) + "\n")
            out.close()
        except OSError:  # its disk is full or gone: the pool's log says why already
            pass

    def close(self) -> None:
        with self._lock:
            out, self._out = self._out, None
        if out is not None:
            try:
                out.close()
            except OSError as exc:
                log.error("core event log %s: its last lines could not be written (%s)", self.path, exc)


# -- where it is written -----------------------------------------------------------------------------------
class CoreLogError(ResidentPoolError):
    """RESIDENT_POOL_CORE_LOG names a file the pool must not, or cannot, write its core's log to."""

    default_reason = "bad_setting"


def _refuse(path: Path, what: str) -> CoreLogError:
    return CoreLogError(f"{VARIABLE}={path}: {what}; set {VARIABLE} to a file in a folder only you can reach "
                        "(mode 0700, yours), such as the pool's log folder (RESIDENT_POOL_LOG_DIR), or unset it")


def check_path(path: Path) -> Path:
    """``path`` as the core log may be written there: absolute, in a folder that is yours and 0700 (made so if it
    is missing), with nothing of another's on the way, and not a link, nor anything but a file of yours."""
    if not path.is_absolute():
        raise _refuse(path, "not an absolute path (the pool runs from its state folder)")
    folder = path.parent
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = folder.stat()
    except OSError as exc:
        raise _refuse(path, f"its folder cannot be made ({exc.strerror})") from None
    if not stat.S_ISDIR(info.st_mode):
        raise _refuse(path, f"{folder} is not a folder")
    if info.st_uid != os.getuid():
        raise _refuse(path, f"its folder {folder} is owned by uid {info.st_uid}, not by you (uid {os.getuid()})")
    if info.st_mode & 0o077:
        raise _refuse(path, f"its folder {folder} has mode {stat.S_IMODE(info.st_mode):04o}, open to group or "
                            f"others (`chmod 700 {folder}`)")
    try:
        check_chain(path, "the core log", error=CoreLogError)  # a folder above it another user can write
    except CoreLogError as exc:
        raise _refuse(path, exc.headline) from None
    try:
        found = path.lstat()
    except FileNotFoundError:
        return path
    except OSError as exc:
        raise _refuse(path, f"it cannot be read ({exc.strerror})") from None
    if stat.S_ISLNK(found.st_mode) or not stat.S_ISREG(found.st_mode):
        raise _refuse(path, "it is a link or not a plain file")
    if found.st_uid != os.getuid():
        raise _refuse(path, f"it is owned by uid {found.st_uid}, not by you")
    return path


def _kept(path: Path, n: int) -> Path:
    return path if n == 0 else path.with_name(f"{path.name}.{n}")


def open_new(path: Path) -> int:
    """A new, empty log at ``path``, mode 0600: an earlier pool's log there is kept as ``path.1`` (the one before
    as ``.2``, up to ``.{KEPT}``), never overwritten: a dead pool's log is an incident's evidence."""
    check_path(path)
    try:
        for n in range(KEPT, 0, -1):
            if os.path.lexists(_kept(path, n - 1)):
                os.replace(_kept(path, n - 1), _kept(path, n))
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise _refuse(path, f"it cannot be written ({exc.strerror})") from None
    os.fchmod(fd, 0o600)  # whatever the umask
    return fd


def read(lines: Iterable[str], notes: list[str] | None = None
         ) -> tuple[dict[str, Any], Iterator[tuple[int, dict[str, Any]]]]:
    """The header and the (line number, entry) of each event after it. A last line cut short (the pool was killed
    mid-write) is left out, said in ``notes``; a line that does not read anywhere else is an error."""
    numbered = enumerate(lines, start=1)
    _, first = next(numbered, (0, ""))
    header = json.loads(first) if first.strip() else {}
    if header.get("format") != FORMAT:
        raise ValueError(f"not a core event log (its first line says {str(header.get('format'))!r}, not {FORMAT!r})")
    return header, _entries(numbered, notes if notes is not None else [])


def _entries(numbered: Iterator[tuple[int, str]], notes: list[str]) -> Iterator[tuple[int, dict[str, Any]]]:
    held: tuple[int, str] | None = None  # one line behind: only the last may be cut
    for number, line in numbered:
        if not line.strip():
            continue
        if held is not None:
            yield held[0], _entry(*held)
        held = number, line
    if held is None:
        return
    try:
        entry = json.loads(held[1])
    except json.JSONDecodeError:
        notes.append(f"line {held[0]}, the last, was cut short (the pool ended while writing it): left out")
        return
    yield held[0], entry


def _entry(number: int, line: str) -> dict[str, Any]:
    try:
        entry: dict[str, Any] = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"line {number} is not JSON ({exc}); only the last line of a log may be cut short") from None
    return entry


@dataclass(frozen=True)
class Divergence:
    """Where a replayed core decided otherwise than the recorded one: the event's line and both decisions."""

    line: int
    event: dict[str, Any]
    recorded: dict[str, Any]
    replayed: dict[str, Any]


def replay(lines: Iterable[str], notes: list[str] | None = None) -> tuple[int, Divergence | None]:
    """Feed a recorded log to a fresh core: how many events it took, and the first divergence (None: the same
    decisions throughout). ``notes`` hears what was left out: a cut last line, the lines after the log stopped."""
    notes = notes if notes is not None else []
    header, entries = read(lines, notes)
    timings, policy = decode(header["timings"]), decode(header["policy"])
    core = PoolState(timings, float(header["now"]), policy)
    count = 0
    for number, entry in entries:
        if "stopped" in entry:
            notes.append(f"line {number}: the pool stopped logging there ({entry['stopped']})")
            break
        decision = encode(core.handle(float(entry["now"]), decode(entry["event"])))
        count += 1
        if decision != entry["decision"]:
            return count, Divergence(number, entry["event"], entry["decision"], decision)
    return count, None
