"""The JIT cache: one folder per provider and stack key, its size in status, and `resident-pool cache prune`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from resident_pool.providers import jit_cache

DAY = 86400.0


def _key(base: Path, provider: str, key: str, age_days: float, size: int = 4096) -> Path:
    folder = base / provider / key
    folder.mkdir(parents=True)
    (folder / "kernel.bin").write_bytes(b"k" * size)
    stamp = time.time() - age_days * DAY
    os.utime(folder, (stamp, stamp))
    return folder


def test_a_key_becomes_a_folder_name_inside_the_root_and_each_start_marks_it_used(tmp_path):
    root = tmp_path / "jit" / "toy"
    folder = jit_cache.stack_folder(root, "toykit-1.0-cu124+torch2.13")
    assert folder == root / "toykit-1.0-cu124+torch2.13" and folder.is_dir()
    os.utime(folder, (0, 0))
    jit_cache.stack_folder(root, "toykit-1.0-cu124+torch2.13")
    assert time.time() - folder.stat().st_mtime < 60
    for hostile in ("../../etc", "a/b", ".hidden", "x" * 300, ""):
        odd = jit_cache.stack_folder(root, hostile)
        assert odd.parent == root and odd.name.startswith("key-")


def test_prune_keeps_each_providers_newest_key_and_recent_ones_and_removes_the_rest(tmp_path):
    base = tmp_path / "jit"
    newest = _key(base, "boltz", "kit-2.0", age_days=30)  # the newest of its provider, however old
    recent = _key(base, "boltz", "kit-1.9", age_days=2)
    stale = _key(base, "boltz", "kit-1.0", age_days=40, size=8192)
    only = _key(base, "esm", "kit-0.1", age_days=90)
    os.utime(newest, (time.time(), time.time()))
    removed, kept = jit_cache.prune(base, older_than_s=7 * DAY, dry_run=True)
    assert [r["path"] for r in removed] == [str(stale)] and stale.is_dir()  # a dry run removes nothing
    assert {k["path"] for k in kept} == {str(newest), str(recent), str(only)}
    assert removed[0]["bytes"] >= 8192 and removed[0]["provider"] == "boltz"
    removed, _ = jit_cache.prune(base, older_than_s=7 * DAY)
    assert not stale.exists() and newest.is_dir() and recent.is_dir() and only.is_dir()
    removed, _ = jit_cache.prune(base, older_than_s=0)
    assert [r["path"] for r in removed] == [str(recent)]  # with no grace, every superseded key goes


def test_the_size_report_counts_every_key_and_is_walked_at_most_once_per_ttl(tmp_path):
    root = tmp_path / "jit" / "toy"
    _key(tmp_path / "jit", "toy", "kit-1", age_days=1, size=10_000)
    sizes = jit_cache.JitSizes()
    report = sizes.report(root)
    assert report["root"] == str(root) and report["bytes"] >= 10_000
    assert [k["key"] for k in report["keys"]] == ["kit-1"]
    _key(tmp_path / "jit", "toy", "kit-2", age_days=0, size=10_000)
    assert sizes.report(root) == report  # cached
    assert [k["key"] for k in jit_cache.JitSizes(ttl_s=0).report(root)["keys"]] == ["kit-2", "kit-1"]


def test_the_cli_prunes_the_default_root_and_says_what_it_removed_and_kept(tmp_path):
    cache = tmp_path / "cache"
    base = cache / "resident-pool" / "jit"
    stale = _key(base, "boltz", "kit-1.0", age_days=40)
    newest = _key(base, "boltz", "kit-2.0", age_days=1)
    cli = [sys.executable, "-m", "resident_pool", "cache", "prune", "--older-than", "7", "--json"]
    env = {**os.environ, "XDG_CACHE_HOME": str(cache)}
    done = subprocess.run(cli, env=env, capture_output=True, text=True, timeout=120, check=True)
    report = json.loads(done.stdout)
    assert [r["path"] for r in report["removed"]] == [str(stale)] and not stale.exists()
    assert [k["path"] for k in report["kept"]] == [str(newest)] and newest.is_dir()
    text = subprocess.run([*cli[:-1], "--dry-run"], env=env, capture_output=True, text=True, timeout=120,
                          check=True).stdout
    assert "nothing to remove" in text and "kit-2.0" in text
