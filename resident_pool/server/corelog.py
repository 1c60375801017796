"""The decision core's event log: each event the core heard, with ``now``, and what it decided, one JSON line each.

Opt-in (``RESIDENT_POOL_CORE_LOG``). Its first line records the ``Timings``, the ``Policy`` and the starting
``now``, so ``replay`` can feed the events to a fresh core and check it decides the same actions: an incident,
taken home and stepped through (``resident-pool replay FILE``). Errors are written as their ``to_dict()``.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
import threading
import types
import typing
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ResidentPoolError, error_from_dict
from . import actions as c
from . import events as ev
from .actions import Policy, Timings
from .core import PoolState
from .replica import Spec

__all__ = ["FORMAT", "CoreLog", "Divergence", "decode", "encode", "read", "replay"]

FORMAT = "resident-pool core events 1"
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
    """Appends one line per event; opened by the pool at its start (the header line first)."""

    def __init__(self, path: Path, timings: Timings, policy: Policy, now: float) -> None:
        self.path = path
        self._lock = threading.Lock()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        self._out = os.fdopen(fd, "w", buffering=1)
        self._write({"format": FORMAT, "timings": encode(timings), "policy": encode(policy), "now": now})

    def write(self, now: float, event: ev.Event, decision: ev.Decision) -> None:
        self._write({"now": now, "event": encode(event), "decision": encode(decision)})

    def _write(self, line: dict[str, Any]) -> None:
        with self._lock:
            self._out.write(json.dumps(line, separators=(",", ":"), allow_nan=True) + "\n")

    def close(self) -> None:
        with self._lock:
            self._out.close()


def read(lines: Iterable[str]) -> tuple[dict[str, Any], Iterator[tuple[int, dict[str, Any]]]]:
    """The header and the (line number, entry) of each event after it."""
    numbered = enumerate(lines, start=1)
    _, first = next(numbered, (0, ""))
    header = json.loads(first) if first.strip() else {}
    if header.get("format") != FORMAT:
        raise ValueError(f"not a core event log (its first line says {str(header.get('format'))!r}, not {FORMAT!r})")
    return header, ((number, json.loads(line)) for number, line in numbered if line.strip())


@dataclass(frozen=True)
class Divergence:
    """Where a replayed core decided otherwise than the recorded one: the event's line and both decisions."""

    line: int
    event: dict[str, Any]
    recorded: dict[str, Any]
    replayed: dict[str, Any]


def replay(lines: Iterable[str]) -> tuple[int, Divergence | None]:
    """Feed a recorded log to a fresh core: how many events it took, and the first divergence (None: the same
    decisions throughout)."""
    header, entries = read(lines)
    timings, policy = decode(header["timings"]), decode(header["policy"])
    core = PoolState(timings, float(header["now"]), policy)
    count = 0
    for number, entry in entries:
        decision = encode(core.handle(float(entry["now"]), decode(entry["event"])))
        count += 1
        if decision != entry["decision"]:
            return count, Divergence(number, entry["event"], entry["decision"], decision)
    return count, None
