"""Transcripts: a file of its own per start, notes that never crash a stop, tails read from the end."""

from __future__ import annotations

import os
import stat

from resident_pool.providers.transcripts import Transcript, read_tail, render_tail


def test_two_starts_in_the_same_second_get_two_files(tmp_path):
    first = Transcript.create(tmp_path, "demo", 0)
    second = Transcript.create(tmp_path, "demo", 0)
    try:
        assert first.path != second.path
        assert first.path.name.startswith("demo-0-") and first.path.suffix == ".log"
        assert stat.S_IMODE(os.stat(first.path).st_mode) == 0o600
    finally:
        first.close()
        second.close()


def test_a_note_after_close_is_dropped_not_raised(tmp_path):
    transcript = Transcript.create(tmp_path, "demo", 0)
    transcript.note("before")
    transcript.close()
    transcript.note("after")  # a release that comes after a stop must not fail on a closed file
    text = transcript.path.read_text()
    assert "before" in text and "after" not in text


def test_the_tail_is_read_from_the_end_and_rendered_for_messages(tmp_path):
    path = tmp_path / "t.log"
    path.write_text("".join(f"line {n}\n" for n in range(100_000)))
    tail = read_tail(path, 3)
    assert tail == ["line 99997", "line 99998", "line 99999"]
    assert render_tail(tail, 2) == "\n  last lines:\n    line 99998\n    line 99999"
    assert render_tail([]) == "" and read_tail(tmp_path / "missing.log") == []
