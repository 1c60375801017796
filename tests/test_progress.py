"""resident_pool.campaigns.progress: done over known, never down, 100 only at the end; rate and ETA in a line."""

from __future__ import annotations

import concurrent.futures
import gzip
import sys
import time
from pathlib import Path

from resident_pool.campaigns.campaign import Campaign, CampaignSettings
from resident_pool.campaigns.inputs import InputFile
from resident_pool.campaigns.progress import Progress, Timeline
from resident_pool.campaigns.results import ResultStore

ROOT = Path(__file__).resolve().parents[1]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_counted_file_is_exact_and_the_percentage_follows_what_is_done():
    clock = Clock()
    progress = Progress(clock)
    entry = progress.add_file("a.fasta", 2000, 50_000)
    progress.begin(entry)
    seen = []
    for done in range(0, 2000, 100):
        clock.now += 1
        progress.update(entry, seen=min(2000, done + 1024), done=done, failed=0, fraction_read=1.0)
        seen.append(progress.percent())
    assert seen == [done / 20 for done in range(0, 2000, 100)]  # done over the 2,000 counted, from the start
    assert progress.exact and "of 2,000 inputs done" in progress.line() and "about" not in progress.line()
    progress.finish(entry, seen=2000, done=2000, failed=0)
    assert progress.percent() == 100


def test_an_estimate_that_grows_never_takes_the_percentage_back_and_says_about():
    """A .gz file: known is estimated from the bytes read; when the estimate grows, the percentage holds."""
    clock = Clock()
    progress = Progress(clock)
    entry = progress.add_file("a.fasta.gz", None, 1_000_000)
    progress.begin(entry)
    values = []
    # The first megabyte read held few records, the rest many: the estimate of the total grows as it reads.
    for seen, done, fraction in ((100, 80, 0.5), (300, 200, 0.6), (2000, 300, 0.7), (2500, 2000, 0.9)):
        clock.now += 2
        progress.update(entry, seen=seen, done=done, failed=1, fraction_read=fraction)
        values.append(progress.percent())
        assert "of about " in progress.line()
    assert values == sorted(values) and values[-1] < 100, values
    progress.finish(entry, seen=2600, done=2600, failed=1)
    assert progress.percent() == 100 and "2,600 of 2,600 inputs done (100.0%)" in progress.line()


def test_files_not_read_yet_are_estimated_from_those_read_and_100_waits_for_the_last():
    clock = Clock()
    progress = Progress(clock)
    first = progress.add_file("a.fasta.gz", None, 1000)
    second = progress.add_file("b.fasta.gz", None, 3000)
    progress.begin(first)
    progress.finish(first, seen=100, done=100, failed=0)
    assert progress.known() == 400  # b is three times a's size: about 300 more
    assert progress.percent() == 25.0
    progress.begin(second)
    progress.update(second, seen=10, done=10, failed=0, fraction_read=0.001)
    assert progress.percent() < 100  # 10 of b read, from 0.1 % of its bytes: not done, however it is estimated
    progress.finish(second, seen=250, done=250, failed=0)
    assert progress.percent() == 100 and progress.known() == 350


def test_the_rate_is_over_the_last_minute_and_the_eta_follows_it():
    clock = Clock()
    progress = Progress(clock)
    entry = progress.add_file("a.jsonl", 10_000, 1)
    progress.begin(entry)
    for step in range(1, 121):  # 100 inputs a second for a minute, then 20 a second for a minute
        clock.now += 1
        done = step * 100 if step <= 60 else 6000 + (step - 60) * 20
        progress.update(entry, seen=10_000, done=done, failed=0, fraction_read=1.0)
    assert 19 <= progress.rate() <= 22  # the last minute's, not the whole run's 60
    assert abs(progress.eta_s() - (10_000 - progress.done) / progress.rate()) < 1e-6
    assert "inputs/s" in progress.line() and "ETA" in progress.line()


def test_an_empty_campaign_is_done():
    assert Progress().percent() == 100


def test_a_timeline_keeps_a_bounded_evenly_thinned_record_and_its_end():
    timeline = Timeline(limit=64)
    for second in range(1_000_000):
        timeline.add(second, second, 0)
    timeline.close(1_000_000.5, 1_000_000, 3)
    assert len(timeline.points) <= 65
    gaps = {b[0] - a[0] for a, b in zip(timeline.points, timeline.points[1:-1], strict=False)}
    assert len(gaps) == 1  # evenly spaced
    assert timeline.points[0][0] == 0 and timeline.points[-1] == (1_000_000.5, 1_000_000, 3)


class _Shown:
    """What flows/screen.py's _Progress does with each update, without Prefect: (inputs done, the percent shown)."""

    def __init__(self):
        self.tally = Progress()
        self.shown = []

    def update(self, entry, **counts):
        self.tally.update(entry, **counts)
        self.shown.append((self.tally.done, round(self.tally.percent(), 1)))


def _screened(tmp_path, source, chunk_size=64, window=4):
    """One input file through screen's own _FileRun, each chunk answered by a thread: every update shown."""
    sys.path.insert(0, str(ROOT / "flows"))
    import screen

    progress = _Shown()
    entry = progress.tally.add_file(str(source.path), source.record_count(), source.size())
    progress.tally.begin(entry)
    store = ResultStore.for_provider("fake", tmp_path / "results")
    campaign = Campaign(store, "v1", {}, chunk_size, tmp_path / "out.jsonl")
    pool = concurrent.futures.ThreadPoolExecutor(2)

    def submit(_task, params):
        def answer():
            time.sleep(0.002)  # a chunk takes a moment, as a model's does: the reading runs ahead of it
            return {"results": [{"n": len(t)} for t in params["texts"].items], "failed": {}, "cold": False, "pid": 1,
                    "version": "v1", "latency_s": 0.0}
        return pool.submit(answer)

    run = screen._FileRun(source, campaign, entry, provider="fake", manifests=str(tmp_path), options={},
                          submit=submit, window=window, progress=progress,
                          limits=CampaignSettings(results_dir=tmp_path / "results"))
    try:
        run.run()
    finally:
        campaign.close()
        store.close()
        pool.shutdown()
    return progress.shown


def test_a_small_gzip_inputs_progress_is_an_estimate_within_20_points_of_the_inputs_done(tmp_path):
    """The reviewer's run: the .gz estimate took the whole compressed size as read from the first record on (under
    gzip's own 128 KiB read), so 768 of 2,000 inputs done (38 %) was shown as 75 %, then stood still at 75 %."""
    letters = "ACDEFGHIKLMNPQRSTVWY"
    path = tmp_path / "in.fasta.gz"
    with gzip.open(path, "wt") as out:
        out.write("".join(f">s{n}\nMKV{''.join(letters[n // 20 ** k % 20] for k in range(4))}ACDEFGHIKLMNPQRSTVWY\n"
                          for n in range(2000)))
    shown = _screened(tmp_path, InputFile(path))
    assert shown == sorted(shown) and shown[-1] == (2000, 99.9)  # 100 is said when the file is finished
    worst = max(shown, key=lambda pair: abs(pair[1] - pair[0] / 20))
    assert abs(worst[1] - worst[0] / 20) < 20, (f"{worst[0]} of 2,000 inputs done ({worst[0] / 20:.1f} %) was shown "
                                               f"as {worst[1]} %; every update: {shown}")


def test_a_file_that_stops_short_leaves_the_campaign_short_of_100_and_its_line_says_why():
    """Issue 31 finding 11: a campaign whose disk filled logged "15,379 of 15,379 inputs done (100.0%)" for a
    24,000-record file: the file was counted done with what had been read."""
    clock = Clock()
    progress = Progress(clock)
    entry = progress.add_file("a.fasta", 24_000, 1_000_000)
    later = progress.add_file("b.fasta", 100, 5_000)
    progress.begin(entry)
    clock.now += 10
    progress.update(entry, seen=15_379, done=15_000, failed=0, fraction_read=0.64)
    progress.stop(entry, "disk_full", seen=15_379, done=15_000, failed=0)
    line = progress.line()
    assert progress.percent() < 100 and line.startswith("15,000 of 24,100 inputs done (62.2%)"), line
    assert "1 file stopped short (disk_full)" in line and "ETA" in line  # b.fasta is still to come
    progress.begin(later)
    progress.finish(later, seen=100, done=100, failed=0)
    assert progress.percent() < 100 and "ETA" not in progress.line()  # nothing runs, and it never reached 100
