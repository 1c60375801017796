"""The bench's report: what its last line counts, and that its table prints row text as written."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from rich.console import Console

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))  # run.py imports its neighbours (contention.py) as a script does


def _bench():
    spec = importlib.util.spec_from_file_location("bench_run", ROOT / "bench" / "run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_target_without_its_baseline_is_counted_not_measured_never_met():
    """Without Ray the bench printed "0 target(s) not met": the rows measured against Ray were simply left out,
    so a run that measured none of them read as if every target were met."""
    bench = _bench()
    table = bench.Table()
    table.add("call path (echo)", "session p50 / floor p50", 1.2, "x", "<= 1.5", True)
    table.add("call path (echo)", "1 MiB JSON", 3.5, "x", "<= 3", False)
    table.unmeasured("call path (echo)", "session p50 / Ray p50", "<= 0.15", bench.RAY_MISSING)
    table.unmeasured("call path (arrays)", "256 MiB round trip: session / Ray", "<= 0.8", bench.RAY_MISSING)
    line = bench.summary(table.rows)
    assert line.startswith("1 target(s) not met, 2 not measured"), line
    assert "pip install -e .[bench]" in line
    assert [bench.verdict(row) for row in table.rows] == ["met", "NOT MET", "not measured", "not measured"]


def test_the_table_prints_an_install_hint_as_written():
    """rich read `.[bench]` in the install hint as a markup tag and printed `pip install -e .`."""
    bench = _bench()
    table = bench.Table()
    table.unmeasured("call path (echo)", "Pool.predict p50 / Ray p50", "<= 0.25", bench.RAY_MISSING)
    table.add("case [x]", "a [bold]measure[/bold]", 1.0, "x", "", None, note="[red]plain[/]")
    console = Console(width=300, record=True, color_system=None)
    bench.print_table(table.rows, console)
    text = console.export_text()
    assert "pip install -e .[bench]" in text
    assert "case [x]" in text and "a [bold]measure[/bold]" in text and "[red]plain[/]" in text
    assert "not measured" in text


def test_a_case_whose_thread_raised_fails_and_prints_no_rows_from_what_was_left(monkeypatch, tmp_path, capsys):
    """Issue 31, finding 8: the admission case ran each provider's stream in a thread; one stream died on a raw
    ConnectionResetError, the makespan was taken over fewer requests, and the row read NOT MET without saying
    why (or could have read met). A thread that raises now fails its case, and the bench exits nonzero."""
    bench = _bench()
    rows_after = []

    def case_with_a_dying_stream(table, env, quick):
        def stream(slug):
            if slug == "b":
                raise ConnectionResetError(104, "Connection reset by peer")

        bench._run_streams(stream, ["a", "b", "c"])
        rows_after.append("the case went on")
        table.add("streams", "makespan", 1.0, "x", "<= 1.15", True)

    class NoEnv:
        def close(self):
            pass

    monkeypatch.setattr(bench, "CASES", {"dying": case_with_a_dying_stream})
    monkeypatch.setattr(bench, "Env", NoEnv)
    monkeypatch.setattr(bench, "RESULTS", tmp_path)
    monkeypatch.setattr(bench, "restart_pool", lambda: None)
    monkeypatch.setattr(sys, "argv", ["run.py"])
    assert bench.main() == 1
    assert not rows_after
    rows = __import__("json").loads((tmp_path / "latest.json").read_text())["rows"]
    assert [(row["case"], row["measure"], row["met"]) for row in rows] == [("dying", "the case raised", False)]
    assert "1 of 3 thread(s) raised" in rows[0]["note"] and "ConnectionResetError" in capsys.readouterr().err
