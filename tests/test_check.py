"""`resident-pool check`, run as a user runs it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from providers import write_provider

from resident_pool.launch import weights_root
from resident_pool.manifest import load_manifest

ROOT = Path(__file__).resolve().parents[1]


def run_check(*args, env=None):
    return subprocess.run([sys.executable, "-m", "resident_pool", "check", *args], cwd=ROOT, capture_output=True,
                          text=True, env={**os.environ, "COLUMNS": "400", **(env or {})}, timeout=300, check=False)


@pytest.mark.slow
def test_check_smoke_minilm_passes_and_writes_junit(tmp_path):
    report = tmp_path / "check.xml"
    done = run_check("--smoke", "minilm", "--junit", str(report))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 failed" in done.stdout
    suite = ET.parse(report).getroot().find("testsuite")
    assert suite.get("failures") == "0"
    steps = {case.get("name") for case in suite.iter("testcase")}
    assert steps == {"manifest", "interpreter", "weights", "kit", "smoke"}
    assert all(case.get("classname") == "resident-pool.minilm" for case in suite.iter("testcase"))


def test_one_altered_byte_fails_check_naming_the_file_and_both_hashes_and_restoring_passes(tmp_path):
    original = weights_root(load_manifest(ROOT / "manifests" / "minilm" / "manifest.toml"))
    copy = tmp_path / "minilm"
    shutil.copytree(original, copy)
    env = {"MINILM_WEIGHTS": str(copy), "RESIDENT_POOL_CACHE_DIR": str(tmp_path / "cache")}
    target = copy / "config.json"
    pristine = target.read_bytes()
    expected = "953f9c0d463486b10a6871cc2fd59f223b2c70184f49815e7efbcab5d8908b41"

    bent = bytearray(pristine)
    bent[10] ^= 0x01
    target.write_bytes(bytes(bent))
    failed = run_check("minilm", "--json", env=env)
    assert failed.returncode == 1
    rows = {row["step"]: row for row in json.loads(failed.stdout)}
    assert not rows["weights"]["ok"]
    import hashlib

    found = hashlib.sha256(bytes(bent)).hexdigest()
    assert f"config.json sha256 {expected} expected, {found} found" in rows["weights"]["detail"]
    table = run_check("minilm", env=env)
    assert table.returncode == 1 and "FAILED" in table.stdout and "config.json" in table.stdout

    target.write_bytes(pristine)
    restored = run_check("minilm", env=env)
    assert restored.returncode == 0, restored.stdout


def test_check_of_every_shipped_provider_passes_without_smoke():
    done = run_check("--json")
    assert done.returncode == 0, done.stdout + done.stderr
    slugs = {row["slug"] for row in json.loads(done.stdout)}
    assert {"minilm", "echo"} <= slugs and "boltz2" not in slugs


def test_a_bad_manifest_and_an_absent_kit_fail_check(tmp_path):
    write_provider(tmp_path, "broken", "colour = 1\n")
    write_provider(tmp_path, "kitless", '[kit]\nname = "absent"\nmode = "x"\n')
    done = run_check("--manifests", str(tmp_path), "--json")
    assert done.returncode == 1
    rows = {(row["slug"], row["step"]): row for row in json.loads(done.stdout)}
    assert "colour" in rows[("broken", "manifest")]["detail"]
    assert rows[("broken", "weights")]["skipped"]
    assert "absent_opt gave no KITROW line" in rows[("kitless", "kit")]["detail"]


def test_an_unknown_slug_is_a_failure():
    done = run_check("nosuch", "--json")
    assert done.returncode == 1
    assert "no such manifest file" in done.stdout
