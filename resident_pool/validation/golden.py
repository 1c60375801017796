"""Compare a smoke answer with its expected (golden) answer, field by field, within tolerances.

Pure: no files, no processes. Numbers compare within ``atol + rtol * |expected|``;
lists of numbers elementwise (and, with ``cosine_min``, by cosine similarity);
other lists item by item; strings, booleans and null exactly. Fields named by a
``float32_base64`` pattern hold little-endian float32 arrays in base64 and are
decoded first, so two encodings of nearly equal vectors compare as numbers.

Field patterns (``ignore``, ``float32_base64``): segments separated by dots,
``[i]`` and ``.i`` alike for list items, each segment a shell glob (``*``
matches any key or index). A pattern of one segment matches that key at any
depth (``pid``, ``elapsed*``); a longer one matches from the top
(``items.*.tokens``).
"""

from __future__ import annotations

import base64
import binascii
import fnmatch
import json
import math
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["EXACT", "Mismatch", "Tolerance", "compare", "decode_f32", "format_path", "normalize", "summary"]

MAX_DEPTH = 64  # a JSON answer nested deeper than this is reported, not recursed into
SHOWN = 5  # mismatches spelled out in a summary; the rest are counted

Path = tuple[str | int, ...]


@dataclass(frozen=True)
class Tolerance:
    """How close a found answer must be to the expected one."""

    atol: float = 0.0
    rtol: float = 0.0
    cosine_min: float | None = None
    ignore: tuple[str, ...] = ()
    float32_base64: tuple[str, ...] = ()

    def allows(self, expected: float, found: float) -> bool:
        if isinstance(expected, int) and isinstance(found, int):
            # Integers compare as integers, at any size: 2**53 + 1 is not 2**53.
            if expected == found or self.exact:
                return expected == found
            try:
                return abs(found - expected) <= self.atol + self.rtol * abs(expected)
            except OverflowError:  # past what a float holds: only equal ones pass
                return False
        try:
            expected, found = float(expected), float(found)
        except OverflowError:
            return False
        if math.isnan(expected) or math.isnan(found):
            return math.isnan(expected) and math.isnan(found)
        if math.isinf(expected) or math.isinf(found):
            return expected == found
        return abs(found - expected) <= self.atol + self.rtol * abs(expected)

    @property
    def exact(self) -> bool:
        return self.atol == 0 and self.rtol == 0 and self.cosine_min is None

    @property
    def beyond(self) -> str:
        """How a mismatch is worded: a diff says "differs", a check "beyond the tolerance"."""
        return "differ" if self.exact else "beyond the tolerance"

    def describe(self) -> str:
        if self.exact:
            return "exactly"
        words = f"atol {self.atol:g} + rtol {self.rtol:g} x |expected|"
        return words + (f", cosine >= {self.cosine_min:g}" if self.cosine_min is not None else "")


EXACT = Tolerance()


@dataclass(frozen=True)
class Mismatch:
    """One field that differs: where, what was expected, what was found, and by how much."""

    path: str
    why: str
    expected: Any = None
    found: Any = None
    deviation: float | None = None  # the worst absolute difference, for numbers and numeric lists

    def describe(self, expected_label: str = "expected", found_label: str = "found") -> str:
        text = f"{self.path or '(the answer)'}: {self.why}"
        if self.expected is not None or self.found is not None:
            text += f"; {expected_label} {_show(self.expected)}, {found_label} {_show(self.found)}"
        if self.deviation is not None:
            text += f"; deviation {self.deviation:.3g}"
        return text

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "why": self.why, "expected": self.expected, "found": self.found,
                "deviation": None if self.deviation is None or math.isnan(self.deviation) else self.deviation}


def _show(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, float) else repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _segments(pattern: str) -> list[str]:
    return [s for s in re.sub(r"\[([^\]]*)\]", r".\1", pattern).split(".") if s]


def _matches(path: Path, patterns: Sequence[str]) -> bool:
    if not path:
        return False
    names = [str(part) for part in path]
    for pattern in patterns:
        segments = _segments(pattern)
        if len(segments) == 1:
            if fnmatch.fnmatchcase(names[-1], segments[0]):
                return True
        elif len(segments) == len(names) and all(map(fnmatch.fnmatchcase, names, segments)):
            return True
    return False


def format_path(path: Path) -> str:
    """``items[0].embedding[17]``; a key that would read ambiguously is quoted."""
    text = ""
    for part in path:
        if isinstance(part, int):
            text += f"[{part}]"
        elif re.fullmatch(r"[A-Za-z_][A-Za-z0-9_\-]*", part):
            text += f".{part}" if text else part
        else:
            text += f"[{json.dumps(part)}]"
    return text


def decode_f32(text: str) -> list[float]:
    """Little-endian float32 values from base64; ValueError if it is not that."""
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"not base64: {exc}") from None
    if len(raw) % 4:
        raise ValueError(f"{len(raw)} bytes is not a whole number of float32 values")
    # Nine significant digits round-trip a float32 and keep a recorded file short.
    return [float(f"{value:.9g}") for value in struct.unpack(f"<{len(raw) // 4}f", raw)]


def normalize(value: Any, tolerance: Tolerance, path: Path = ()) -> Any:
    """``value`` without its ignored fields, and with its float32 base64 fields decoded to numbers."""
    if len(path) >= MAX_DEPTH:
        return value
    if isinstance(value, dict):
        return {key: normalize(item, tolerance, (*path, key)) for key, item in value.items()
                if not _matches((*path, key), tolerance.ignore)}
    if isinstance(value, list):
        return [normalize(item, tolerance, (*path, index)) for index, item in enumerate(value)]
    if isinstance(value, str) and _matches(path, tolerance.float32_base64):
        try:
            return decode_f32(value)
        except ValueError:
            return value  # left as found: the comparison then names it as not float32 base64
    return value


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _kind(value: Any) -> str:
    if isinstance(value, list):
        return f"a list of {len(value)}"
    return {dict: "an object", str: "a string", bool: "a boolean", type(None): "null"}.get(type(value), "a number")


def compare(expected: Any, found: Any, tolerance: Tolerance, path: Path = ()) -> list[Mismatch]:
    """Every field where ``found`` differs from ``expected`` beyond ``tolerance`` (both normalized first)."""
    if not path:
        expected, found = normalize(expected, tolerance), normalize(found, tolerance)
    where = format_path(path)
    if len(path) >= MAX_DEPTH:
        try:
            same = expected == found
        except RecursionError:  # deeper than the interpreter compares: reported as differing, not raised
            same = False
        return [] if same else [Mismatch(where, f"differs (nested deeper than {MAX_DEPTH} levels)")]
    if isinstance(expected, dict) and isinstance(found, dict):
        out: list[Mismatch] = []
        for key, value in expected.items():
            if key not in found:
                out.append(Mismatch(format_path((*path, key)), "missing from the answer", expected=value))
            else:
                out += compare(value, found[key], tolerance, (*path, key))
        out += [Mismatch(format_path((*path, key)), "not in the expected answer", found=value)
                for key, value in found.items() if key not in expected]
        return out
    if isinstance(expected, list) and isinstance(found, list):
        if expected and found and all(map(_is_number, expected)) and all(map(_is_number, found)):
            return _compare_vector(expected, found, tolerance, path)
        out = []
        if len(expected) != len(found):
            out.append(Mismatch(where, f"{len(expected)} items expected, {len(found)} found"))
        for index, (want, got) in enumerate(zip(expected, found, strict=False)):
            out += compare(want, got, tolerance, (*path, index))
        return out
    if _is_number(expected) and _is_number(found):
        if tolerance.allows(expected, found):
            return []
        return [Mismatch(where, "differs" if tolerance.exact else "beyond the tolerance", expected, found,
                         _deviation(expected, found))]
    if type(expected) is type(found) and expected == found:
        return []
    if isinstance(expected, list) and isinstance(found, str) and _matches(path, tolerance.float32_base64):
        return [Mismatch(where, "is not float32 base64", f"{len(expected)} numbers", found)]
    if type(expected) is type(found) or (_is_number(expected) and _is_number(found)):
        return [Mismatch(where, "differs", expected, found)]
    return [Mismatch(where, f"{_kind(expected)} expected, {_kind(found)} found", expected, found)]


def _deviation(expected: float, found: float) -> float:
    if expected == found:  # equal integers, or equal infinities
        return 0.0
    try:
        expected, found = float(expected), float(found)
    except OverflowError:
        return math.inf
    if math.isnan(expected) or math.isnan(found):
        return math.nan
    return abs(found - expected)


def _rank(deviation: float) -> tuple[bool, float]:
    """NaN ranks worst (it compares false with everything), then the larger difference."""
    return (math.isnan(deviation), 0.0 if math.isnan(deviation) else deviation)


def _compare_vector(expected: list, found: list, tolerance: Tolerance, path: Path) -> list[Mismatch]:
    where = format_path(path)
    if len(expected) != len(found):
        return [Mismatch(where, f"{len(expected)} numbers expected, {len(found)} found")]
    out: list[Mismatch] = []
    beyond = [i for i, (want, got) in enumerate(zip(expected, found, strict=True))
              if not tolerance.allows(want, got)]
    if beyond:
        worst = max(beyond, key=lambda i: _rank(_deviation(expected[i], found[i])))
        out.append(Mismatch(
            format_path((*path, worst)),
            f"{len(beyond)} of {len(expected)} numbers {tolerance.beyond}; the worst is this one",
            expected[worst], found[worst], _deviation(expected[worst], found[worst]),
        ))
    if tolerance.cosine_min is not None and len(expected) > 1:
        cosine = _cosine(expected, found)
        if not cosine >= tolerance.cosine_min:
            worst = max(range(len(expected)), key=lambda i: _rank(_deviation(expected[i], found[i])))
            out.append(Mismatch(where, f"cosine similarity {cosine:.6f} below the floor {tolerance.cosine_min:g}",
                                deviation=_deviation(expected[worst], found[worst])))
    return out


def _cosine(a: list, b: list) -> float:
    dot = sum(float(x) * float(y) for x, y in zip(a, b, strict=True))
    norm = math.sqrt(sum(float(x) ** 2 for x in a)) * math.sqrt(sum(float(y) ** 2 for y in b))
    if norm == 0.0:
        return 1.0 if not any(a) and not any(b) else 0.0
    return dot / norm


def summary(mismatches: Sequence[Mismatch], expected_label: str = "expected", found_label: str = "found") -> str:
    """The first few mismatches spelled out, the rest counted."""
    lines = [m.describe(expected_label, found_label) for m in mismatches[:SHOWN]]
    if len(mismatches) > SHOWN:
        lines.append(f"... and {len(mismatches) - SHOWN} more")
    return "\n".join(lines)
