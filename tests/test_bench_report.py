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


def _adhoc():
    spec = importlib.util.spec_from_file_location("bench_adhoc", ROOT / "bench" / "adhoc.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_adhoc_case_ends_every_process_carrying_its_tag_its_sessions_included(tmp_path):
    """A failed adhoc_predict left the pool daemon, its model worker and a `python -m prefect.engine` running:
    everything the case starts carries its tag, and its close ends each one, and each group one leads."""
    import os
    import subprocess
    import uuid

    from helpers import wait_until

    from resident_pool.host.procs import pid_alive

    adhoc = _adhoc()
    tag = uuid.uuid4().hex
    env = {**os.environ, adhoc.TAG_VARIABLE: tag}
    untagged = {name: value for name, value in os.environ.items() if name != adhoc.TAG_VARIABLE}
    # A session leader with a child that dropped the tag (as a model worker's own environment may): its group ends.
    leader = subprocess.Popen(["sh", "-c", f"env -u {adhoc.TAG_VARIABLE} sleep 300 & echo $!; wait"], env=env,
                              stdout=subprocess.PIPE, text=True, start_new_session=True)
    child = int(leader.stdout.readline())
    loner = subprocess.Popen(["sleep", "300"], env=env)
    bystander = subprocess.Popen(["sleep", "300"], env=untagged)
    server = subprocess.Popen(["sleep", "300"], env=env)  # between two workers, the server is spared
    try:
        # (the child too, where it was caught before `env` dropped the tag)
        assert {leader.pid, loner.pid} <= set(adhoc.end_tagged(tag, spare=server.pid))
        assert leader.wait(timeout=10) and loner.wait(timeout=10)
        wait_until(lambda: not pid_alive(child), timeout=10, message="the leader's untagged child gone")
        assert bystander.poll() is None and server.poll() is None
        assert adhoc.end_tagged(tag) == [server.pid]
    finally:
        for process in (leader, loner, bystander, server):
            if process.poll() is None:
                process.kill()
            process.wait(timeout=10)
        leader.stdout.close()


def test_a_screen_that_gives_no_answer_in_time_fails_its_row_with_the_reason_and_the_case_goes_on(tmp_path,
                                                                                                   monkeypatch):
    import types

    import resident_pool.client

    adhoc = _adhoc()
    bench = _bench()
    closed = []

    class Stack:
        def __init__(self, env, tmp):
            pass

        def start_worker(self, kind, name, **extra):
            self.kind = kind

        def predict_once(self):
            return 0.5 if self.kind == "resident-process" else 10.0

        def screen_once(self, name):
            if self.kind == "process":
                raise TimeoutError("flow run x gave no answer within 300 s")
            return 30.0

        def stop_worker(self):
            pass

        def close(self):
            closed.append(True)

    monkeypatch.setattr(adhoc, "Stack", Stack)
    monkeypatch.setattr(resident_pool.client, "shutdown_pool", lambda *args, **kwargs: None)
    table = bench.Table()
    adhoc.case_adhoc_predict(table, types.SimpleNamespace(tmp=tmp_path), quick=True)
    assert closed == [True]
    row = next(row for row in table.rows if row["measure"] == "screen: ours / process worker (defaults)")
    assert row["met"] is False and "process worker (defaults): flow run x gave no answer within 300 s" in row["note"]
    assert next(row for row in table.rows if row["measure"] == "warm: ours / process worker (defaults)")["met"]
