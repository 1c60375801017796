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


@pytest.fixture(scope="module")
def kit_pythons(tmp_path_factory):
    """One throwaway venv per kit, made once for this module."""
    from providers import make_kit_venv

    made = {}

    def make(kit, checkout=True):
        if (kit, checkout) not in made:
            made[kit, checkout] = make_kit_venv(tmp_path_factory.mktemp(kit) / "venv", kit, checkout=checkout)
        return made[kit, checkout]

    return make


def _kit_provider(root, slug, python, kit_body):
    write_provider(root, slug, f'[env]\npython = "{python}"\n[kit]\n{kit_body}', worker="toyworker.py")


def test_check_applies_every_start_rule_and_names_the_one_broken(tmp_path, kit_pythons):
    """Each of these providers fails at every start; check must say so, not exit 0."""
    manifests = tmp_path / "manifests"
    _kit_provider(manifests, "emptyrow", kit_pythons("emptykit_opt"), 'name = "emptykit"\nmode = "any"\n')
    _kit_provider(manifests, "nomode", kit_pythons("nomodekit_opt"), 'name = "nomodekit"\nmode = "only"\n')
    _kit_provider(manifests, "optless", kit_pythons("optlesskit_opt"), 'name = "optlesskit"\nmode = "route"\n')
    _kit_provider(manifests, "sited", kit_pythons("toykit_opt", checkout=False), 'name = "toykit"\nmode = "fast"\n')
    # Declared, so the worker gets it; the kit polices its namespace and refuses it at every start.
    _kit_provider(manifests, "policed", kit_pythons("toykit_opt"),
                  'name = "toykit"\nmode = "fast"\n[kit.env]\nTOYKIT_OPT_BOGUS = "1"\n')
    _kit_provider(manifests, "good", kit_pythons("toykit_opt"), 'name = "toykit"\nmode = "fast"\n')
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache"), "XDG_DATA_HOME": str(tmp_path / "data")}
    done = run_check("--manifests", str(manifests), "--json", env=env)
    assert done.returncode == 1, done.stdout + done.stderr
    kit = {row["slug"]: row for row in json.loads(done.stdout) if row["step"] == "kit"}
    assert 'env_row = "none"' in kit["emptyrow"]["detail"]
    assert 'mode = "subprocess"' in kit["nomode"]["detail"]
    assert "launch_opts" in kit["optless"]["detail"]
    assert "export MODEL_OPT or set [kit] model_opt" in kit["sited"]["detail"]
    assert "REFUSED: undeclared variables TOYKIT_OPT_BOGUS" in kit["policed"]["detail"]
    assert kit["good"]["ok"] and "toykit_opt-checkout" in kit["good"]["detail"], kit["good"]["detail"]
    assert [slug for slug, row in kit.items() if not row["ok"]] == ["emptyrow", "nomode", "optless", "policed",
                                                                   "sited"]
