"""resident_pool.campaigns.report: a bounded sample of vectors, its 2-D map, and a page that fetches nothing."""

from __future__ import annotations

import base64
import json
import random
import re
import struct
import subprocess
import sys

import pytest

from resident_pool.campaigns import report
from resident_pool.campaigns.report import SAMPLE_LIMIT, VectorSample, pca_2d, write_report


def _row(vector) -> str:
    return json.dumps({"embedding": vector, "tokens": 3})


def test_the_sample_never_holds_more_than_its_limit_and_is_uniform_over_what_was_offered():
    sample = VectorSample(limit=200, seed=7)
    for n in range(20_000):
        sample.offer(f"s{n}", _row([float(n), 1.0]))
    assert len(sample.vectors) == 200 and sample.offered == 20_000
    kept = sorted(int(ident[1:]) for ident in sample.ids)
    halves = sum(1 for n in kept if n < 10_000)
    assert 70 <= halves <= 130  # as many from the first half as from the second, within chance
    assert {struct.unpack("<2e", vector)[1] for vector in sample.vectors} == {1.0}


def test_only_rows_the_sample_keeps_are_parsed(monkeypatch):
    parsed = []
    real = report.json.loads
    monkeypatch.setattr(report.json, "loads", lambda text: parsed.append(1) or real(text))
    sample = VectorSample(limit=100)
    for n in range(100_000):
        sample.offer(f"s{n}", _row([1.0, float(n)]))
    assert len(parsed) < 1_500  # about limit x (1 + ln(n / limit)), not one per row


def test_a_provider_without_vectors_stops_being_looked_at():
    sample = VectorSample()
    for n in range(10_000):
        sample.offer(f"s{n}", json.dumps({"length": n}))
    assert not sample.vectors and not sample.looking and sample.offered == 100


def test_minilms_base64_float32_is_read_as_its_vector():
    vector = [0.5, -0.25, 0.125, 1.0]
    sample = VectorSample()
    sample.offer("a", json.dumps({"embedding_f32": base64.b64encode(struct.pack("<4f", *vector)).decode(),
                                  "tokens": 4}))
    assert sample.dim == 4 and sample.field == "embedding_f32" and sample.matrix() == [vector]


def test_the_map_finds_the_direction_the_points_spread_along():
    sample = VectorSample()
    for n in range(300):  # along (1, 1, 0, 0), with a little noise on the third axis
        t = (n - 150) / 10
        sample.offer(f"p{n}", _row([t, t, 0.01 * (n % 3), 0.0]))
    points, ids, explained = pca_2d(sample)
    assert len(points) == 300 and len(ids) == 300
    assert explained[0] > 0.99
    xs = [x for x, _ in points]
    assert max(xs) - min(xs) == pytest.approx(2 ** 0.5 * 29.9, rel=0.01)


def test_the_map_of_384_dimensional_vectors_orders_its_axes_by_spread():
    """Two directions stand out of noise, one three times the spread of the other: the first axis is the wider."""
    rng = random.Random(3)
    sample = VectorSample()
    for n in range(2000):
        wide, narrow = rng.gauss(0, 6), rng.gauss(0, 2)
        values = [rng.gauss(0, 0.2) for _ in range(384)]
        values[5] += wide
        values[200] += narrow
        sample.offer(f"p{n}", _row(values))
    points, _, explained = pca_2d(sample)
    spread = [max(p[i] for p in points) - min(p[i] for p in points) for i in (0, 1)]
    assert 2 < spread[0] / spread[1] < 4.5 and explained[0] > explained[1] > 0.05


def _apart(n: int) -> list[float]:
    """A vector of its own direction for each n < 105: no two within cosine 0.9999, where the map groups answers
    ([n, n % 7, 1] were: their directions converge as n grows)."""
    return [float(n % 5), float(n % 7), float(n % 3) + 1.0, 1.0]


def test_the_page_is_self_contained_and_charts_what_it_is_given(tmp_path):
    sample = VectorSample()
    for n in range(50):
        sample.offer(f"id<{n}>", _row(_apart(n)))
    timeline = [(0.0, 0, 0), (1.0, 100, 1), (2.5, 400, 3)]
    failures = [{"index": 3, "id": "<script>x</script>", "reason": "bad_input", "error": "a.fasta:7: empty & odd"}]
    path = write_report(tmp_path / "out.jsonl.report.html", title="embedder screening: a.fasta",
                        summary={"inputs": 400, "failed": 3, "failure reasons": "bad_input: 3"}, timeline=timeline,
                        sample=sample, failures=failures)
    page = path.read_text()
    assert page.count("<polyline") == 3 and page.count("<circle") == 50
    assert not re.search(r"(src|href)=|url\(|@import|<script|https?://", page)  # nothing to fetch, nothing to run
    assert "&lt;script&gt;x&lt;/script&gt;" in page and "id&lt;7&gt;" in page and "empty &amp; odd" in page
    assert not list(tmp_path.glob(".*.tmp"))


# Memory is measured as the issue states it, the growth of a process's peak resident memory, in a fresh process:
# tracemalloc would count every float the plain-Python map makes (tens of millions) and cost 13 s of CPU for a
# report that takes 1.2 s to write.
_MEASURED = """
import ctypes

def kib(field):
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(field))

def measured(step):  # the growth of the peak resident memory over the resident memory before the step, in bytes
    # Memory freed before the step but still resident (a hole in malloc's heap) would be reused by the step without
    # raising the peak: given back first, so the step's own allocations count whatever came before.
    ctypes.CDLL(None).malloc_trim(0)
    before = kib("VmRSS:")
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")  # the peak is reset to what is resident now
    step()
    return (kib("VmHWM:") - before) * 1024
"""

_PEAK_GROWTH = _MEASURED + """
import base64, json, struct, sys
import numpy
from resident_pool.campaigns.report import VectorSample, write_report

def offered(sample, count, vector):
    for n in range(count):
        sample.offer(f"seq{n}", vector(n))

out = {}
same = json.dumps({"embedding_f32": base64.b64encode(struct.pack("<384f", *([0.01] * 384))).decode()})
sample = VectorSample()
out["offers"] = measured(lambda: offered(sample, 25_000, lambda n: same))
out["kept"] = len(sample.vectors)
# Noise: the map's plane never settles, the slowest case. Drawn at once (4.6 million random() calls cost seconds).
noise = numpy.random.default_rng(1).random((12_000, 384), dtype=numpy.float32) - numpy.float32(0.5)
rows = [base64.b64encode(values.tobytes()).decode() for values in noise.astype("<f4")]
del noise
sample = VectorSample()
offered(sample, len(rows), lambda n: json.dumps({"embedding_f32": rows[n]}))
del rows
out["held"] = sum(map(len, sample.vectors))
out["report"] = measured(lambda: write_report(sys.argv[1], title="t", summary={"inputs": 12_000},
                                              timeline=[(0.0, 0, 0), (1.0, 12_000, 0)], sample=sample, failures=[]))
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def peak_growth(tmp_path_factory) -> dict:
    """One fresh process offers a full sample and writes the report of another: the figures both tests read."""
    page = tmp_path_factory.mktemp("report") / "r.html"
    done = subprocess.run([sys.executable, "-c", _PEAK_GROWTH, str(page)], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    return {**json.loads(done.stdout), "page": page.read_text()}


def test_the_measure_counts_memory_a_step_reuses_from_what_was_freed_before_it():
    """The report's figure is taken after the sample's 25 MB of base64 rows were freed: a hole in malloc's heap, still
    resident, which a report holding 20 MB of small blocks (a list of rows, say) filled without raising the peak
    (measured 4.7 MiB with and without it; 30 MB planted showed as 10 MiB more)."""
    code = _MEASURED + (
        "rows = [bytes(2048) for _ in range(12_000)]\n"
        "kept = [bytes(768) for _ in range(10_000)]\n"  # allocated after the rows: freeing them leaves a hole
        "del rows\n"
        "print(measured(lambda: [bytes(1500) for _ in range(20 * 2**20 // 1500)]))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) >= 18 * 2**20, f"20 MiB held by the step counted as {int(done.stdout) / 2**20:.1f} MiB"


def test_a_full_sample_of_384_dimensional_vectors_costs_under_10_mb(peak_growth):
    """10,000 vectors held as float16: under 10 MB, however many more are offered (the sample only replaces)."""
    assert peak_growth["kept"] == SAMPLE_LIMIT
    assert peak_growth["offers"] < 10 * 2**20, f"25,000 offers raised the peak by {peak_growth['offers'] / 2**20:.1f} MiB"


def test_the_report_of_an_embedding_campaign_costs_under_20_mb_with_its_sample(peak_growth):
    """The issue: a campaign's peak memory grows by under 20 MB with the report on. For an embedding provider (the
    case with a map) the sample held 7.7 MB and the PCA made a float64 copy (30 MB) and more: 49 MiB at once.
    (The reviewer measured 100,000 inputs of a 384-d provider end to end: peak RSS 147 MB without the report,
    205 MB with it; `make bench` now measures that case too.)"""
    held, peak = peak_growth["held"], peak_growth["report"]
    assert peak_growth["page"].count("<circle") == SAMPLE_LIMIT
    assert held + peak < 20 * 2**20, f"sample {held / 2**20:.1f} MiB + writing the report {peak / 2**20:.1f} MiB"


def _chart_ticks(page: str, name: str) -> list[float]:
    svg = page.split(f'data-chart="{name}"', 1)[1].split("</svg>", 1)[0]
    return [float(text.replace(",", "")) for text in re.findall(r"text-anchor=end>([-0-9.,e]+)</text>", svg)]


def test_the_throughput_chart_shows_the_campaigns_rate_not_the_gap_between_two_updates(tmp_path):
    """A steady 400 inputs/s campaign (two replicas, each finishing 50 inputs every 0.25 s, 2 ms apart): the chart
    divided 50 inputs by the 2 ms between two updates and drew 25,000 inputs/s. Seen live: a screen whose summary
    said 277.6 inputs/s drew a throughput chart peaking at 12,500."""
    timeline, done = [(0.0, 0, 0)], 0
    for step in range(1, 40):
        for offset in (0.0, 0.002):
            done += 50
            timeline.append((round(step * 0.25 + offset, 3), done, 0))
    path = write_report(tmp_path / "r.html", title="t", summary={"inputs": done}, timeline=timeline, sample=None,
                        failures=[])
    ticks = _chart_ticks(path.read_text(), "throughput")
    assert 400 <= max(ticks) <= 1_000, f"the throughput axis runs to {max(ticks):,.0f} inputs/s for a steady 400"


def test_a_slow_models_throughput_under_one_input_a_second_is_still_charted(tmp_path):
    timeline = [(float(t), t // 4, 0) for t in range(0, 400, 4)]  # one input every 4 s: 0.25 inputs/s
    page = write_report(tmp_path / "r.html", title="t", summary={"inputs": 99}, timeline=timeline, sample=None,
                        failures=[]).read_text()
    ticks = _chart_ticks(page, "throughput")
    assert 0.2 <= max(ticks) <= 0.25 and ticks[0] == 0, ticks


def test_the_failed_inputs_chart_of_a_campaign_without_failures_has_no_1e_09_axis(tmp_path):
    path = write_report(tmp_path / "r.html", title="t", summary={"inputs": 100},
                        timeline=[(0.0, 0, 0), (1.0, 50, 0), (2.0, 100, 0)], sample=None, failures=[])
    ticks = _chart_ticks(path.read_text(), "failed inputs")
    assert ticks == [0.0, 1.0], f"the failed-inputs axis is labelled {ticks}"


def test_the_map_names_its_axes_labels_each_dot_by_id_and_says_when_many_answers_coincide(tmp_path):
    """Issue 33: the map of the old demo's answers was one unlabelled dot beside a cloud (453 of 500 proteins
    shared an embedding), with unnamed axes; it now names its axes and its dots, and says so."""
    sample = VectorSample()
    for n in range(40):  # 30 inputs answered alike, 10 apart
        sample.offer(f"p{n}", _row([1.0, 2.0, 3.0, 4.0] if n < 30 else _apart(n)))
    page = write_report(tmp_path / "r.html", title="t", summary={}, timeline=[], sample=sample,
                        failures=[]).read_text()
    assert page.count("<circle") == 11  # the 30 alike are one dot
    assert "<title>30 answers alike: p0, p1, p2, p3, p4 and 25 more</title>" in page and "<title>p35</title>" in page
    assert "principal component 1 (" in page and "principal component 2 (" in page and "hover a dot for its id" in page
    assert "30 of these 40 answers (75%) coincide with another's (within cosine 0.9999), the largest group 30 " \
           "alike" in page
    distinct = VectorSample()
    for n in range(40):
        distinct.offer(f"p{n}", _row(_apart(n)))
    assert "coincide" not in write_report(tmp_path / "d.html", title="t", summary={}, timeline=[], sample=distinct,
                                          failures=[]).read_text()
