"""Log retention: transcripts capped per provider, never a live one; the pool's own log rotated."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from helpers import wait_until
from providers import write_provider

from resident_pool import Pool
from resident_pool.ops.retention import prune_transcripts, transcript_slugs


def _transcript(folder: Path, slug: str, n: int, size: int = 10, age_s: float = 0) -> Path:
    path = folder / f"{slug}-0-20260101-0000{n:02d}-{n:06x}.log"
    path.write_bytes(b"x" * size)
    stamp = time.time() - 1000 + n - age_s
    os.utime(path, (stamp, stamp))
    return path


def test_the_oldest_go_beyond_the_count_and_the_size_but_never_a_live_one(tmp_path):
    files = [_transcript(tmp_path, "fold", n, size=100) for n in range(8)]  # files[0] is the oldest
    other = [_transcript(tmp_path, "fold-b", n) for n in range(8)]  # another provider whose slug starts alike
    (tmp_path / "notes.txt").write_text("not a transcript")
    removed = prune_transcripts(tmp_path, "fold", keep=3, max_bytes=10_000, live={files[0]})
    assert sorted(removed) == sorted(files[1:6])  # the live one counts toward the 3, however old
    assert {p for p in files if p.exists()} == {files[0], files[6], files[7]}
    assert all(p.exists() for p in other) and (tmp_path / "notes.txt").exists()
    removed = prune_transcripts(tmp_path, "fold", keep=10, max_bytes=250, live=set())  # size: 2 of 100 bytes fit
    assert {p for p in files if p.exists()} == {files[6], files[7]}
    assert transcript_slugs(tmp_path) == {"fold", "fold-b"}


def test_a_transcript_some_process_holds_open_is_kept(tmp_path):
    files = [_transcript(tmp_path, "fold", n) for n in range(4)]
    with open(files[0], "a"):
        prune_transcripts(tmp_path, "fold", keep=2, max_bytes=10_000, live=set())
        assert files[0].exists() and files[3].exists()
        assert not files[1].exists() and not files[2].exists()


def test_transcripts_are_pruned_to_the_cap_of_3_while_a_live_workers_file_is_kept(pool_dir, monkeypatch, isolated_dirs):
    monkeypatch.setenv("RESIDENT_POOL_TRANSCRIPTS_KEEP", "3")
    # Started per request, one transcript each; a second replica serves while the first is held.
    write_provider(pool_dir, "perrequest", 'mode = "subprocess"\nmode_reason = "a test of one start per request"\n'
                                           "[lifecycle]\nmax_replicas = 2\n")
    logs = Path(isolated_dirs["logs"])

    def transcripts():  # oldest first; one pruned between the listing and its stat is gone, not an error
        found = []
        for path in logs.glob("perrequest-*.log"):
            try:
                found.append((path.stat().st_mtime, path))
            except FileNotFoundError:
                continue
        return [path for _, path in sorted(found)]

    with Pool() as pool, pool.session("perrequest") as held:
        live = Path(held.transcript)
        pids = [pool.predict("perrequest", {"action": "echo"})["pid"] for _ in range(5)]
        assert len(set(pids)) == 5  # a worker per request: five more transcripts
        wait_until(lambda: len(transcripts()) == 3, timeout=30, message="the transcripts pruned to 3")
        assert live.exists() and live == transcripts()[0]  # the oldest, kept: its worker lives
        assert held.predict({"action": "echo", "value": "alive"})["echo"] == "alive"


def test_the_pool_log_rotates_and_stderr_follows_to_the_new_file(tmp_path):
    script = textwrap.dedent(f"""
        import logging, sys
        from pathlib import Path
        from resident_pool.ops.retention import PoolLogHandler
        handler = PoolLogHandler(Path({str(tmp_path / "pool.log")!r}), max_bytes=2000)
        logging.basicConfig(level=logging.INFO, handlers=[handler])
        for n in range(200):
            logging.getLogger("t").info("line %d %s", n, "x" * 40)
        print("a stray line on stderr", file=sys.stderr, flush=True)
    """)
    subprocess.run([sys.executable, "-c", script], check=True, timeout=60)
    rotated = sorted(p.name for p in tmp_path.glob("pool.log*"))
    assert rotated == ["pool.log", "pool.log.1", "pool.log.2", "pool.log.3"]
    assert all(p.stat().st_size <= 2100 for p in tmp_path.glob("pool.log*"))
    current = (tmp_path / "pool.log").read_text()
    assert "line 199" in current and "a stray line on stderr" in current
