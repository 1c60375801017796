"""A campaign's HTML report: one self-contained file beside its output (inline SVG, no script, nothing fetched).

Inputs done, throughput and failures over time, from the campaign's timeline;
for a provider that answers with vectors, a 2-D map (PCA) of a uniform sample of
at most 10,000 of them. The sample is drawn while the output is written
(reservoir sampling: only a row the sample keeps is parsed) and held as float16,
so the report costs a few megabytes at most, however large the campaign.
"""

from __future__ import annotations

import base64
import binascii
import html
import itertools
import json
import math
import os
import random
import socket
import struct
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["SAMPLE_LIMIT", "VectorSample", "pca_2d", "report_path", "write_report"]

SAMPLE_LIMIT = 10_000
_LOOK_FOR_VECTORS = 100  # rows without a vector before the sample stops looking: not an embedding provider
_PURE_PYTHON_POINTS = 1_000  # without numpy the map is computed on this many of the sample's points
_FAILURES_SHOWN = 50


def report_path(output: str | os.PathLike[str]) -> Path:
    """``<output>.report.html``: beside the output, named after it."""
    output = Path(output)
    return output.with_name(output.name + ".report.html")


class VectorSample:
    """A uniform sample of at most ``limit`` result vectors, drawn from the results as they are written."""

    def __init__(self, limit: int = SAMPLE_LIMIT, seed: int = 0) -> None:
        self.limit = limit
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
    """The sample projected on its first two principal components: points, their ids, variance explained."""
    if len(sample.vectors) < 3 or sample.dim < 2:
        return [], [], (0.0, 0.0)
    try:
        import numpy
    except ImportError:
        return _pca_pure(sample)
    data = numpy.frombuffer(b"".join(sample.vectors), dtype="<f2").reshape(len(sample.vectors), sample.dim)
    data = data.astype(numpy.float64)
    data -= data.mean(axis=0)
    values, vectors = numpy.linalg.eigh(data.T @ data)  # dim x dim: 384 x 384 for an embedding, not n x n
    order = numpy.argsort(values)[::-1][:2]
    projected = data @ vectors[:, order]
    total = float(values.sum()) or 1.0
    explained = tuple(float(values[i]) / total for i in order)
    if len(explained) < 2:
        explained = (*explained, 0.0)
        projected = numpy.column_stack([projected[:, 0], numpy.zeros(len(projected))])
    return [(float(x), float(y)) for x, y in projected], list(sample.ids), (explained[0], explained[1])


def _pca_pure(sample: VectorSample) -> tuple[list[tuple[float, float]], list[str], tuple[float, float]]:
    """Power iteration without numpy, on at most _PURE_PYTHON_POINTS points of the sample."""
    rows = sample.matrix()[:_PURE_PYTHON_POINTS]
    ids = sample.ids[:len(rows)]
    dim = sample.dim
    mean = [sum(row[i] for row in rows) / len(rows) for i in range(dim)]
    centred = [[value - m for value, m in zip(row, mean, strict=True)] for row in rows]
    total = sum(value * value for row in centred for value in row) or 1.0
    components, explained = [], []
    for _ in range(2):
        vector = [1.0 / math.sqrt(dim)] * dim
        for _ in range(50):
            scores = [sum(a * b for a, b in zip(row, vector, strict=True)) for row in centred]
            nxt = [sum(score * row[i] for score, row in zip(scores, centred, strict=True)) for i in range(dim)]
            norm = math.sqrt(sum(value * value for value in nxt)) or 1.0
            vector = [value / norm for value in nxt]
        scores = [sum(a * b for a, b in zip(row, vector, strict=True)) for row in centred]
        explained.append(sum(score * score for score in scores) / total)
        components.append(scores)
        centred = [[value - score * v for value, v in zip(row, vector, strict=True)]
                   for row, score in zip(centred, scores, strict=True)]
    return list(zip(components[0], components[1], strict=True)), ids, (explained[0], explained[1])


# -- the page -------------------------------------------------------------------------
_STYLE = """
body{font:14px/1.45 system-ui,sans-serif;margin:24px auto;max-width:980px;color:#1d2330;padding:0 16px}
h1{font-size:20px;margin:0 0 4px}h2{font-size:16px;margin:28px 0 8px}
.meta{color:#5b6475}table{border-collapse:collapse;margin:8px 0}td,th{padding:3px 10px;border-bottom:1px solid #e3e6ec;
text-align:left;vertical-align:top}th{color:#5b6475;font-weight:600}
.charts{display:flex;flex-wrap:wrap;gap:12px}svg{background:#fafbfc;border:1px solid #e3e6ec;border-radius:6px}
svg text{font:11px system-ui,sans-serif;fill:#5b6475}.none{color:#5b6475;font-style:italic}
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
    rates = [(t, (d1 - d0) / (t - t0)) for (t0, d0, _), (t, d1, _) in itertools.pairwise(timeline) if t > t0]
    rows = "".join(f"<tr><th>{e(str(name))}</th><td>{e(_text(value))}</td></tr>" for name, value in summary.items())
    charts = [
        _line_chart("inputs done", seconds, done, "inputs"),
        _line_chart("throughput", [t for t, _ in rates], [r for _, r in rates], "inputs/s"),
        _line_chart("failed inputs", seconds, failed, "inputs", colour="#c0392b"),
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


def _text(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.2f}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    if isinstance(value, dict):
        return ", ".join(f"{k}: {v}" for k, v in value.items()) or "none"
    return str(value)


def _ticks(low: float, high: float, count: int = 5) -> list[float]:
    if high <= low:
        return [low]
    step = 10 ** math.floor(math.log10((high - low) / count))
    for factor in (1, 2, 5, 10):
        if (high - low) / (step * factor) <= count:
            step *= factor
            break
    first = math.ceil(low / step) * step
    return [first + i * step for i in range(int((high - first) / step) + 1)]


def _number(value: float) -> str:
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:.3g}"


def _line_chart(name: str, xs: Sequence[float], ys: Sequence[float], unit: str, colour: str = "#2f6fdb") -> str:
    width, height, left, right, top, bottom = 310, 200, 48, 10, 24, 30
    head = (f'<svg class=chart data-chart="{html.escape(name)}" width={width} height={height} '
            f'viewBox="0 0 {width} {height}" role=img aria-label="{html.escape(name)} over time">'
            f'<text x={left} y=15 style="font-weight:600;fill:#1d2330">{html.escape(name)} ({unit})</text>')
    if len(xs) < 2:
        return head + f'<text x={left} y={height // 2}>too short a campaign to chart</text></svg>'
    x0, x1 = min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1
    y0, y1 = 0.0, max(*ys, 1e-9)
    span_x, span_y = width - left - right, height - top - bottom

    def px(x: float) -> float:
        return left + (x - x0) / (x1 - x0) * span_x

    def py(y: float) -> float:
        return top + span_y - (y - y0) / (y1 - y0) * span_y

    grid = []
    for tick in _ticks(y0, y1, 4):
        grid.append(f'<line x1={left} x2={width - right} y1="{py(tick):.1f}" y2="{py(tick):.1f}" stroke="#e3e6ec"/>'
                    f'<text x={left - 4} y="{py(tick) + 4:.1f}" text-anchor=end>{_number(tick)}</text>')
    for tick in _ticks(x0, x1, 4):
        grid.append(f'<text x="{px(tick):.1f}" y={height - 12} text-anchor=middle>{_number(tick)}</text>')
    grid.append(f'<text x={width - right} y={height - 1} text-anchor=end>seconds</text>')
    points = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in zip(xs, ys, strict=True))
    return head + "".join(grid) + f'<polyline fill=none stroke="{colour}" stroke-width=1.6 points="{points}"/></svg>'


def _map_section(sample: VectorSample | None) -> str:
    if sample is None or not sample.vectors:
        return ("<h2>Map</h2><p class=none>no map: the provider's answers hold no vector (a list of numbers or "
                "a base64 <code>*_f32</code> field)</p>")
    points, ids, explained = pca_2d(sample)
    if not points:
        return "<h2>Map</h2><p class=none>no map: fewer than three vectors</p>"
    size, pad = 560, 16
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    x0, x1 = min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1
    y0, y1 = min(ys), max(ys) if max(ys) > min(ys) else min(ys) + 1
    dots = "".join(
        f'<circle cx="{pad + (x - x0) / (x1 - x0) * (size - 2 * pad):.1f}" '
        f'cy="{size - pad - (y - y0) / (y1 - y0) * (size - 2 * pad):.1f}" r=2><title>{html.escape(ident)}</title>'
        "</circle>" for (x, y), ident in zip(points, ids, strict=True))
    shown = len(points)
    note = (f"{shown:,} of {sample.offered:,} results (a uniform sample), {sample.dim}-dimensional "
            f"<code>{html.escape(sample.field or '')}</code> projected on its first two principal components "
            f"(they explain {explained[0]:.0%} and {explained[1]:.0%} of the sample's variance)")
    return (f"<h2>Map</h2><p class=meta>{note}</p><svg class=map data-chart=map width={size} height={size} "
            f'viewBox="0 0 {size} {size}" role=img aria-label="PCA map"><g fill="#2f6fdb" fill-opacity=0.45>'
            f"{dots}</g></svg>")


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
