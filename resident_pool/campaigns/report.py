"""A campaign's HTML report: one self-contained file beside its output (inline SVG, no script, nothing fetched).

Inputs done, throughput and failures over time, from the campaign's timeline;
for a provider that answers with vectors, a 2-D map (PCA) of a uniform sample of
at most 10,000 of them. The sample is drawn while the output is written
(reservoir sampling: only a row the sample keeps is parsed) and held as float16
(7.7 MB for 10,000 of 384 dimensions), and the map is computed a row at a time
without numpy, so the report costs about 10 MB at most, however large the campaign.
"""

from __future__ import annotations

import base64
import binascii
import html
import itertools
import json
import math
import operator
import os
import random
import socket
import struct
import time
import uuid
from array import array
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..providers.manifest import DISTINCT_COSINE

__all__ = ["SAMPLE_LIMIT", "VectorSample", "pca_2d", "report_path", "write_report"]

SAMPLE_LIMIT = 10_000
_LOOK_FOR_VECTORS = 100  # rows without a vector before the sample stops looking: not an embedding provider
_FAILURES_SHOWN = 50


def report_path(output: str | os.PathLike[str]) -> Path:
    """``<output>.report.html``: beside the output, named after it."""
    output = Path(output)
    return output.with_name(output.name + ".report.html")


class VectorSample:
    """A uniform sample of at most ``limit`` result vectors, drawn from the results as they are written;
    ``coincide_cosine``: answers at least this alike are one answer on the map."""

    def __init__(self, limit: int = SAMPLE_LIMIT, seed: int = 0, coincide_cosine: float = DISTINCT_COSINE) -> None:
        self.limit = limit
        self.coincide_cosine = coincide_cosine  # answers this close are one answer (the provider's distinct_cosine)
        self.random = random.Random(seed)  # noqa: S311 - a sample for a picture, not a secret
        self.offered = 0
        self.dim = 0
        self.field: str | None = None
        self.ids: list[str] = []
        self.vectors: list[bytes] = []  # float16, little-endian, ``dim`` values each
        self.looking = True

    def offer(self, ident: str, result: str) -> None:
        """One written result (its JSON text); parsed only when the sample keeps it."""
        self._offer(ident, result)

    def offer_line(self, line: str) -> None:
        """One written JSON Lines record whole, its id in it (an earlier run's lines, written again whole)."""
        self._offer(None, line)

    def _offer(self, ident: str | None, result: str) -> None:
        if not self.looking:
            return
        self.offered += 1
        if len(self.vectors) < self.limit:
            slot = len(self.vectors)
        else:
            slot = self.random.randrange(self.offered)
            if slot >= self.limit:
                return
        parsed = _parsed(result)
        vector = self._vector(parsed) if parsed is not None else None
        if vector is None:
            if not self.vectors and self.offered >= _LOOK_FOR_VECTORS:
                self.looking = False  # this provider does not answer with vectors
            return
        if ident is None:  # a whole record: the id is its own field, the vector one of the others
            ident = str(parsed.get("id", ""))
        if slot == len(self.vectors):
            self.vectors.append(vector)
            self.ids.append(ident)
        else:
            self.vectors[slot], self.ids[slot] = vector, ident

    def _vector(self, result: dict[str, Any]) -> bytes | None:
        values = _values(result, self.field)
        if values is None:
            return None
        name, numbers = values
        if self.dim == 0:
            self.dim, self.field = len(numbers), name
        if len(numbers) != self.dim:
            return None
        try:
            return struct.pack(f"<{self.dim}e", *numbers)
        except (OverflowError, struct.error):
            return None  # a value float16 cannot hold: left out of the map, not the campaign's problem

    def matrix(self) -> list[list[float]]:
        return [list(struct.unpack(f"<{self.dim}e", vector)) for vector in self.vectors]


def _parsed(text: str) -> dict[str, Any] | None:
    try:
        result = json.loads(text)
    except ValueError:
        return None
    return result if isinstance(result, dict) else None


def _values(result: dict[str, Any], field: str | None) -> tuple[str, Sequence[float]] | None:
    """The result's vector: its ``*_f32`` base64 field or a list of at least two numbers (``field`` first)."""
    names = [field] if field else list(result)
    for name in names:
        value = result.get(name)
        if isinstance(value, str) and name.endswith("_f32"):
            try:
                raw = base64.b64decode(value, validate=True)
            except (binascii.Error, ValueError):
                continue
            if len(raw) >= 8 and len(raw) % 4 == 0:
                return name, struct.unpack(f"<{len(raw) // 4}f", raw)
        elif (isinstance(value, list) and len(value) >= 2
              and all(isinstance(x, int | float) and not isinstance(x, bool) for x in value)):
            return name, value
    return None


# -- the map ------------------------------------------------------------------------
def pca_2d(sample: VectorSample) -> tuple[list[tuple[float, float]], list[str], tuple[float, float]]:
    """The sample projected on its first two principal components: points, their ids, variance explained.

    In plain Python, a row at a time, so the map costs little beyond the sample itself: numpy's import and
    LAPACK alone raised a flow process's peak memory by about 20 MB, and a float64 copy of a full sample is
    30 MB more. The plane and the variance it explains are found on an evenly spaced subset of at most
    AXES_POINTS rows (held as float32), by subspace iteration; then every point of the sample is projected.
    """
    n, dim = len(sample.vectors), sample.dim
    if n < 3 or dim < 2:
        return [], [], (0.0, 0.0)
    unpack = struct.Struct(f"<{dim}e").unpack
    subset = sample.vectors[::-(-n // AXES_POINTS)]
    total = [0.0] * dim
    for vector in subset:
        total = list(map(operator.add, total, unpack(vector)))
    mean = [value / len(subset) for value in total]
    rows = [array("f", map(operator.sub, unpack(vector), mean)) for vector in subset]
    axes, spread = _plane(rows, dim)
    variance = math.fsum(_dot(row, row) for row in rows)  # the sum of the variances along every axis
    explained = (spread[0] / variance, spread[1] / variance) if variance > 0 else (0.0, 0.0)
    points = []
    for vector in sample.vectors:  # the mean's shift is left in: the map is drawn to its points' bounds
        row = unpack(vector)
        points.append((_dot(row, axes[0]), _dot(row, axes[1])))
    return points, list(sample.ids), explained


AXES_POINTS = 500  # rows the plane is found from: enough for a picture; each iteration reads them all
# A picture needs the plane to a few degrees: 25 iterations leave 0.9 ** 25 = 7 % of a third direction whose spread
# is 90 % of the second's (and less of any further one); those that settle sooner stop sooner.
_ITERATIONS = 25


def _dot(a: Sequence[float], b: Sequence[float]) -> float:
    return sum(map(operator.mul, a, b))


def _plane(rows: list[array], dim: int) -> tuple[list[list[float]], tuple[float, float]]:
    """The two directions along which the (centred) rows spread most, the first the most, and the sum of the
    squares along each: subspace iteration from a seeded random start, then the 2 x 2 problem in its plane."""
    rng = random.Random(0)  # noqa: S311 - a starting direction, not a secret
    columns = [array("f", (row[i] for row in rows)) for i in range(dim)]

    def spread(vector: list[float]) -> list[float]:  # the rows' scatter matrix times the vector
        scores = [_dot(row, vector) for row in rows]
        return [_dot(column, scores) for column in columns]

    basis = _orthonormal([[rng.gauss(0, 1) for _ in range(dim)] for _ in range(2)])
    for _ in range(_ITERATIONS):
        moved = _orthonormal([spread(vector) for vector in basis])
        settled = all(abs(_dot(old, new)) > 1 - 1e-4 for old, new in zip(basis, moved, strict=True))
        basis = moved
        if settled:
            break
    images = [spread(vector) for vector in basis]
    a, b, c = _dot(basis[0], images[0]), _dot(basis[0], images[1]), _dot(basis[1], images[1])
    angle = 0.5 * math.atan2(2 * b, a - c)  # the rotation in the plane that diagonalises [[a, b], [b, c]]
    cos, sin = math.cos(angle), math.sin(angle)
    first = [cos * x + sin * y for x, y in zip(*basis, strict=True)]
    second = [-sin * x + cos * y for x, y in zip(*basis, strict=True)]
    along = (cos * cos * a + 2 * cos * sin * b + sin * sin * c, sin * sin * a - 2 * cos * sin * b + cos * cos * c)
    return [first, second], along


def _orthonormal(vectors: list[list[float]]) -> list[list[float]]:
    """As many orthonormal vectors as given, by Gram-Schmidt; one that vanishes against those before it (rows
    spread along fewer axes than asked) is replaced by the next unit axis that does not."""
    dim = len(vectors[0])
    axes = ([1.0 if i == axis else 0.0 for i in range(dim)] for axis in range(dim))
    done: list[list[float]] = []
    for given in itertools.chain(vectors, axes):
        if len(done) == len(vectors):
            break
        vector = given
        for kept in done:
            along = _dot(vector, kept)
            vector = [x - along * k for x, k in zip(vector, kept, strict=True)]
        norm = math.sqrt(_dot(vector, vector))
        if norm > 1e-9 * math.sqrt(_dot(given, given)):
            done.append([x / norm for x in vector])
    return done


# -- the page -------------------------------------------------------------------------
_STYLE = """
body{font:14px/1.45 system-ui,sans-serif;margin:24px auto;max-width:980px;color:#1d2330;padding:0 16px}
h1{font-size:20px;margin:0 0 4px}h2{font-size:16px;margin:28px 0 8px}
.meta{color:#5b6475}table{border-collapse:collapse;margin:8px 0}td,th{padding:3px 10px;border-bottom:1px solid #e3e6ec;
text-align:left;vertical-align:top}th{color:#5b6475;font-weight:600}
.charts{display:flex;flex-wrap:wrap;gap:12px}svg{background:#fafbfc;border:1px solid #e3e6ec;border-radius:6px}
svg text{font:11px system-ui,sans-serif;fill:#5b6475}.none{color:#5b6475;font-style:italic}
.warn{color:#8a4b00;background:#fff4e0;padding:6px 10px;border-radius:4px}
"""


def write_report(path: str | os.PathLike[str], *, title: str, summary: dict[str, Any],
                 timeline: Sequence[tuple[float, int, int]], sample: VectorSample | None,
                 failures: Sequence[dict[str, Any]]) -> Path:
    """Write the report to ``path`` (a temporary file, then renamed into place); returns its path."""
    path = Path(path)
    page = _page(title, summary, timeline, sample, failures)
    temp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(page)
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    return path


def _page(title: str, summary: dict[str, Any], timeline: Sequence[tuple[float, int, int]],
          sample: VectorSample | None, failures: Sequence[dict[str, Any]]) -> str:
    e = html.escape
    seconds = [t for t, _, _ in timeline]
    done = [d for _, d, _ in timeline]
    failed = [f for _, _, f in timeline]
    rates = _rates(timeline)
    rows = "".join(f"<tr><th>{e(str(name))}</th><td>{e(_text(value))}</td></tr>" for name, value in summary.items())
    charts = [
        _line_chart("inputs done", seconds, done, "inputs", counts=True),
        _line_chart("throughput", [t for t, _ in rates], [r for _, r in rates], "inputs/s"),
        _line_chart("failed inputs", seconds, failed, "inputs", colour="#c0392b", counts=True),
    ]
    parts = [
        "<!doctype html><html lang=en><head><meta charset=utf-8>",
        # No request may leave the host: nothing here refers to anything outside this file.
        "<meta http-equiv=Content-Security-Policy content=\"default-src 'none'; style-src 'unsafe-inline'\">",
        f"<title>{e(title)}</title><style>{_STYLE}</style></head><body>",
        f"<h1>{e(title)}</h1><p class=meta>written {e(time.strftime('%Y-%m-%d %H:%M:%S %Z'))} on "
        f"{e(socket.gethostname())}</p>",
        f"<h2>Summary</h2><table>{rows}</table>",
        "<h2>Over time</h2><div class=charts>" + "".join(charts) + "</div>",
        _map_section(sample),
        _failures_section(failures, summary),
        "</body></html>\n",
    ]
    return "".join(parts)


def _rates(timeline: Sequence[tuple[float, int, int]]) -> list[tuple[float, float]]:
    """Inputs done per second over a sliding window (a twentieth of the run, at least a second or a quarter of
    it): two replicas finishing 50 inputs each a few milliseconds apart are not 25,000 inputs/s."""
    if len(timeline) < 2:
        return []
    span = timeline[-1][0] - timeline[0][0]
    window = max(span / 20, min(1.0, span / 4))
    rates, start = [], 0
    for t, done, _ in timeline:
        while start + 1 < len(timeline) and t - timeline[start + 1][0] >= window:
            start += 1
        t0, d0, _ = timeline[start]
        if window > 0 and t - t0 >= window:
            rates.append((t, (done - d0) / (t - t0)))
    return rates


def _text(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.2f}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    if isinstance(value, dict):
        return ", ".join(f"{k}: {v}" for k, v in value.items()) or "none"
    return str(value)


def _ticks(low: float, high: float, count: int = 5, whole: bool = False) -> list[float]:
    """Round values from ``low`` to ``high``, about ``count`` of them; whole numbers only when ``whole``."""
    if high <= low:
        return [low]
    step = 10 ** math.floor(math.log10((high - low) / count))
    for factor in (1, 2, 5, 10):
        if (high - low) / (step * factor) <= count:
            step *= factor
            break
    if whole:
        step = max(step, 1)
    first = math.ceil(low / step) * step
    return [first + i * step for i in range(int((high - first) / step) + 1)]


def _number(value: float) -> str:
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:.3g}"


def _line_chart(name: str, xs: Sequence[float], ys: Sequence[float], unit: str, colour: str = "#2f6fdb",
                counts: bool = False) -> str:
    """One line over time; ``counts``: the values are whole numbers (an axis of none failed runs 0 to 1)."""
    width, height, left, right, top, bottom = 310, 200, 48, 10, 24, 30
    head = (f'<svg class=chart data-chart="{html.escape(name)}" width={width} height={height} '
            f'viewBox="0 0 {width} {height}" role=img aria-label="{html.escape(name)} over time">'
            f'<text x={left} y=15 style="font-weight:600;fill:#1d2330">{html.escape(name)} ({unit})</text>')
    if len(xs) < 2:
        return head + f'<text x={left} y={height // 2}>too short a campaign to chart</text></svg>'
    x0, x1 = min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1
    y0, y1 = 0.0, max(ys)
    if y1 <= 0 or counts:
        y1 = max(y1, 1.0)
    span_x, span_y = width - left - right, height - top - bottom

    def px(x: float) -> float:
        return left + (x - x0) / (x1 - x0) * span_x

    def py(y: float) -> float:
        return top + span_y - (y - y0) / (y1 - y0) * span_y

    grid = []
    for tick in _ticks(y0, y1, 4, whole=counts):
        grid.append(f'<line x1={left} x2={width - right} y1="{py(tick):.1f}" y2="{py(tick):.1f}" stroke="#e3e6ec"/>'
                    f'<text x={left - 4} y="{py(tick) + 4:.1f}" text-anchor=end>{_number(tick)}</text>')
    for tick in _ticks(x0, x1, 4):
        grid.append(f'<text x="{px(tick):.1f}" y={height - 12} text-anchor=middle>{_number(tick)}</text>')
    grid.append(f'<text x={width - right} y={height - 1} text-anchor=end>seconds</text>')
    points = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in zip(xs, ys, strict=True))
    return head + "".join(grid) + f'<polyline fill=none stroke="{colour}" stroke-width=1.6 points="{points}"/></svg>'


def coinciding(sample: VectorSample) -> list[list[int]]:
    """The sample's answers in groups of those that coincide, as the [answers] distinct check counts them alike:
    equal answers, and answers within ``sample.coincide_cosine`` of each other (a chain of such pairs is one
    group); each group in sample order, the groups in the order of their first answer.

    Equal answers are grouped over the whole sample; near ones by comparing every pair of distinct answers, but
    of an evenly spaced subset of at most COINCIDE_POINTS of them (245,000 pairs; 10,000 would be 50 million dot
    products in plain Python), each pair first on the PREFILTER_AXES coordinates that vary most: unit vectors
    within cosine c lie within sqrt(2 - 2c) of each other, so in every coordinate too.
    """
    equal: dict[bytes, list[int]] = {}
    for at, vector in enumerate(sample.vectors):
        equal.setdefault(vector, []).append(at)
    groups = list(equal.values())
    if len(groups) < 2:
        return groups
    unpack = struct.Struct(f"<{sample.dim}e").unpack
    axes = _varied_axes(sample, unpack)
    radius = math.sqrt(max(2.0 - 2.0 * sample.coincide_cosine, 0.0))
    compared = list(range(0, len(groups), -(-len(groups) // COINCIDE_POINTS)))
    units: list[array | None] = []
    for group in compared:
        row = unpack(sample.vectors[groups[group][0]])
        norm = math.sqrt(_dot(row, row))
        units.append(array("f", (x / norm for x in row)) if norm else None)  # a zero one is equal to zeros only
    keys = [[unit[axis] for axis in axes] if unit is not None else None for unit in units]
    parent = list(range(len(groups)))

    def root(group: int) -> int:
        while parent[group] != group:
            parent[group] = parent[parent[group]]
            group = parent[group]
        return group

    for i, (first, first_key) in enumerate(zip(units, keys, strict=True)):
        if first is None or first_key is None:
            continue
        for j in range(i + 1, len(units)):
            second, second_key = units[j], keys[j]
            if second is None or second_key is None:
                continue
            if all(abs(a - b) <= radius for a, b in zip(first_key, second_key, strict=True)) \
                    and _dot(first, second) >= sample.coincide_cosine:
                parent[root(compared[j])] = root(compared[i])
    merged: dict[int, list[int]] = {}
    for group, members in enumerate(groups):
        merged.setdefault(root(group), []).extend(members)
    return sorted((sorted(members) for members in merged.values()), key=lambda members: members[0])


COINCIDE_POINTS = 700  # distinct answers compared pair by pair for the map's note
PREFILTER_AXES = 8  # coordinates compared before a whole dot product


def _varied_axes(sample: VectorSample, unpack: Any) -> list[int]:
    """The PREFILTER_AXES coordinates of the unit answers that vary most, the most first, over an evenly spaced
    subset of at most AXES_POINTS answers."""
    subset = sample.vectors[::-(-len(sample.vectors) // AXES_POINTS)]
    total = [0.0] * sample.dim
    squares = [0.0] * sample.dim
    for vector in subset:
        row = unpack(vector)
        norm = math.sqrt(_dot(row, row)) or 1.0
        unit = [x / norm for x in row]
        total = list(map(operator.add, total, unit))
        squares = list(map(operator.add, squares, map(operator.mul, unit, unit)))
    count = len(subset)
    variance = [sq / count - (t / count) ** 2 for t, sq in zip(total, squares, strict=True)]
    return sorted(range(sample.dim), key=lambda axis: -variance[axis])[:min(PREFILTER_AXES, sample.dim)]


COINCIDE_NOTE = 0.05  # the share of mapped answers that coincide with another's past which the map says so


def _map_section(sample: VectorSample | None) -> str:
    if sample is None or not sample.vectors:
        return ("<h2>Map</h2><p class=none>no map: the provider's answers hold no vector (a list of numbers or "
                "a base64 <code>*_f32</code> field)</p>")
    points, ids, explained = pca_2d(sample)
    if not points:
        return "<h2>Map</h2><p class=none>no map: fewer than three vectors</p>"
    size, pad, axis = 560, 16, 30  # ``axis``: room for the axes' names, below and to the left
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    x0, x1 = min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1
    y0, y1 = min(ys), max(ys) if max(ys) > min(ys) else min(ys) + 1
    # Answers that coincide (within the provider's distinct_cosine) are one dot, drawn larger, its label naming them
    # all: a model that answers many inputs alike shows as one dot beside a cloud, and says so.
    groups = coinciding(sample)
    dots = []
    for members in groups:
        x, y = points[members[0]]
        named = [ids[at] for at in members]
        label = named[0] if len(named) == 1 else (
            f"{len(named)} answers alike: " + ", ".join(named[:5]) + (f" and {len(named) - 5} more"
                                                                     if len(named) > 5 else ""))
        radius = 2 if len(named) == 1 else min(12.0, 2 + 2 * math.log2(len(named)))
        dots.append(f'<circle cx="{axis + pad + (x - x0) / (x1 - x0) * (size - axis - 2 * pad):.1f}" '
                    f'cy="{size - axis - pad - (y - y0) / (y1 - y0) * (size - axis - 2 * pad):.1f}" r={radius:g}>'
                    f"<title>{html.escape(label)}</title></circle>")
    alike_count = sum(len(members) for members in groups if len(members) > 1)
    shown = len(points)
    note = (f"{shown:,} of {sample.offered:,} results (a uniform sample), {sample.dim}-dimensional "
            f"<code>{html.escape(sample.field or '')}</code> projected on its first two principal components "
            f"(they explain about {explained[0]:.0%} and {explained[1]:.0%} of its variance); hover a dot for its "
            "id")
    alike = ""
    if alike_count >= 3 and alike_count >= COINCIDE_NOTE * shown:
        largest = max(len(members) for members in groups)
        alike = (f"<p class=warn>{alike_count:,} of these {shown:,} answers ({alike_count / shown:.0%}) coincide with "
                 f"another's (within cosine {sample.coincide_cosine:g}), the largest group {largest:,} alike, each "
                 "group drawn as one larger dot. A "
                 "repeated input shares its answer by right; distinct inputs that share one mean a model that does "
                 "not read them (<code>resident-pool check --smoke</code> judges it)</p>")
    names = (f'<text x={axis + pad} y={size - 8}>principal component 1 ({explained[0]:.0%} of the variance)</text>'
             f'<text transform="translate(14 {size - axis - pad}) rotate(-90)">principal component 2 '
             f"({explained[1]:.0%})</text>")
    return (f"<h2>Map</h2><p class=meta>{note}</p>{alike}<svg class=map data-chart=map width={size} height={size} "
            f'viewBox="0 0 {size} {size}" role=img aria-label="PCA map">{names}<g fill="#2f6fdb" '
            f'fill-opacity=0.45>{"".join(dots)}</g></svg>')


def _failures_section(failures: Sequence[dict[str, Any]], summary: dict[str, Any]) -> str:
    if not failures:
        return "<h2>Failed inputs</h2><p class=none>none</p>"
    e = html.escape
    rows = "".join(f"<tr><td>{row['index']}</td><td>{e(str(row['id']))}</td><td>{e(str(row['reason']))}</td>"
                   f"<td>{e(str(row['error']))}</td></tr>" for row in failures[:_FAILURES_SHOWN])
    total = summary.get("failed", len(failures))
    more = f"<p class=meta>the first {min(len(failures), _FAILURES_SHOWN)} of {total:,}; every one is in the " \
           "output, with its reason and error</p>" if total > _FAILURES_SHOWN else ""
    return (f"<h2>Failed inputs</h2><table><tr><th>index</th><th>id</th><th>reason</th><th>error</th></tr>{rows}"
            f"</table>{more}")
