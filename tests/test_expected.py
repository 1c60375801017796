"""The expected-answer file: read with suspicion, compared, blessed with a diff."""

from __future__ import annotations

import json
import os

import pytest
from providers import write_provider

from resident_pool import GoldenMismatch, ManifestError, ResidentPoolError
from resident_pool.providers.manifest import load_manifest
from resident_pool.validation.expected import bless, read_expected, smoke_set, verdict

ANSWER = {"items": [{"embedding": [0.1, 0.2, 0.3], "tokens": 4}], "pid": 123, "device": "cpu"}


@pytest.fixture
def provider(tmp_path):
    def make(smoke='expected = "smoke/expected.json"\natol = 1e-4\n'):
        return load_manifest(write_provider(tmp_path, "model", f'[smoke]\npayload = {{ inputs = ["MKV"] }}\n{smoke}'))

    return make


def test_bless_records_the_answer_without_its_varying_fields_then_it_matches(provider):
    manifest = provider()
    detail, data = bless(manifest, manifest.smoke.payload, ANSWER, {"manifest.fingerprint": "f00", "smoke.transcript": "/x.log"}, force=False)
    assert data["written"] and detail.endswith("a new file")
    document = read_expected(manifest)
    assert document["result"] == {"items": [{"embedding": [0.1, 0.2, 0.3], "tokens": 4}]}
    assert document["payload"] == {"inputs": ["MKV"]}
    assert document["blessed"]["provenance"] == {"manifest.fingerprint": "f00"}  # a local log path is not committed
    other_run = {**ANSWER, "pid": 456, "device": "cuda"}
    assert verdict(manifest, manifest.smoke.payload, other_run, None)[0].startswith("the answer matches")


def test_bless_refuses_an_existing_file_without_force_and_says_what_would_change(provider):
    manifest = provider()
    bless(manifest, manifest.smoke.payload, ANSWER, {}, force=False)
    path = manifest.directory / "smoke" / "expected.json"
    before = path.read_bytes()
    moved = {"items": [{"embedding": [0.1, 0.2, 0.35], "tokens": 4}]}
    with pytest.raises(ResidentPoolError) as info:
        bless(manifest, manifest.smoke.payload, moved, {}, force=False)
    assert info.value.reason == "expected_exists"
    assert "1 field(s) differ from the old file, 1 of them beyond the tolerance" in str(info.value)
    assert info.value.details["diff"] == [
        "items[0].embedding[2]: 1 of 3 numbers differ; the worst is this one; old 0.3, new 0.35; deviation 0.05"]
    assert path.read_bytes() == before
    detail, data = bless(manifest, manifest.smoke.payload, moved, {}, force=True)
    assert data["written"] and "1 field(s) differ" in detail
    assert read_expected(manifest)["result"] == moved


def test_a_reblessed_identical_answer_says_nothing_changed(provider):
    manifest = provider()
    bless(manifest, manifest.smoke.payload, ANSWER, {}, force=False)
    detail, data = bless(manifest, manifest.smoke.payload, ANSWER, {}, force=True)
    assert "no field differs from the old file" in detail and data["diff"] == []


def test_a_changed_answer_fails_naming_the_field_expected_found_and_deviation(provider):
    manifest = provider()
    bless(manifest, manifest.smoke.payload, ANSWER, {}, force=False)
    with pytest.raises(GoldenMismatch) as info:
        verdict(manifest, manifest.smoke.payload, {**ANSWER, "items": [{"embedding": [0.1, 0.2, 0.31], "tokens": 4}]}, None)
    message = str(info.value)
    assert "differs from" in message and "atol 0.0001 + rtol 0.0001" in message
    assert "items[0].embedding[2]" in message and "expected 0.3, found 0.31; deviation 0.01" in message
    (miss,) = info.value.details["mismatches"]
    assert miss["path"] == "items[0].embedding[2]" and miss["deviation"] == pytest.approx(0.01)
    loose = provider('expected = "smoke/expected.json"\natol = 0.011\n')  # a tolerance that admits the change
    said, _ = verdict(loose, loose.smoke.payload, {**ANSWER, "items": [{"embedding": [0.1, 0.2, 0.31], "tokens": 4}]},
                      None)
    assert said.startswith("the answer matches") and "within atol 0.011" in said


def test_an_expected_file_others_can_write_is_refused(provider):
    manifest = provider()
    bless(manifest, manifest.smoke.payload, ANSWER, {}, force=False)
    path = manifest.directory / "smoke" / "expected.json"
    os.chmod(path, 0o666)
    with pytest.raises(ManifestError, match=r"is writable by others .*`chmod go-w"):
        read_expected(manifest)


@pytest.mark.parametrize(
    ("content", "words"),
    [
        (b"{not json", "cannot be read as JSON"),
        (b"[1, 2]", "is not an expected-answer file"),
        (json.dumps({"format": 99, "payload": {}, "result": 1}).encode(), "is not an expected-answer file"),
        (b"[" * 100_000 + b"]" * 100_000, "cannot be read as JSON"),
    ],
)
def test_a_malformed_expected_file_is_named_with_the_fix(provider, content, words):
    manifest = provider()
    path = manifest.directory / "smoke" / "expected.json"
    path.parent.mkdir()
    path.write_bytes(content)
    with pytest.raises(ManifestError) as info:
        read_expected(manifest)
    assert words in str(info.value) and str(path) in str(info.value)
    assert info.value.details["field"] == "smoke.expected"


def test_a_symlinked_expected_file_is_refused_and_bless_replaces_the_link_not_its_target(provider, tmp_path):
    manifest = provider()
    target = tmp_path / "elsewhere.json"
    target.write_text("keep me")
    path = manifest.directory / "smoke" / "expected.json"
    path.parent.mkdir()
    path.symlink_to(target)
    with pytest.raises(ManifestError, match="not a plain file"):
        read_expected(manifest)
    bless(manifest, manifest.smoke.payload, ANSWER, {}, force=True)
    assert target.read_text() == "keep me" and not path.is_symlink()


@pytest.mark.parametrize("value", ["/etc/expected.json", "../expected.json", "smoke/", ""])
def test_the_expected_path_must_be_a_file_beside_the_manifest(provider, value):
    with pytest.raises(ManifestError, match=r"smoke\.expected: .* must be a file relative to the manifest"):
        provider(f'expected = "{value}"\n')


def test_an_ignore_pattern_that_matches_everything_is_refused(provider):
    with pytest.raises(ManifestError, match="matches every field"):
        provider('ignore = ["*"]\n')


def test_smoke_inputs_come_from_a_file_read_and_ruled_as_a_campaigns_are(tmp_path):
    """[smoke] inputs: a FASTA file beside the manifest, each input ruled by [inputs]; one the provider would
    refuse fails the check by its line and id, before any worker starts."""
    path = write_provider(tmp_path, "model", '[inputs]\nkinds = ["protein", "text"]\n[smoke]\ninputs = "smoke/in.fasta"\n'
                                            'payload = { digits = 3 }\n')
    (path.parent / "smoke").mkdir()
    (path.parent / "smoke" / "in.fasta").write_text(">first one\nmkv*\n>second\nMKA\nLL\n")
    chosen = smoke_set(load_manifest(path))
    assert chosen.payload == {"digits": 3, "inputs": ["MKV", "MKALL"], "kind": "protein"}
    assert chosen.ids == ["first", "second"] and chosen.texts == ["MKV", "MKALL"]
    (path.parent / "smoke" / "in.fasta").write_text(">first\nMKV\n>gapped\nMK-V\n")
    with pytest.raises(ManifestError) as refused:
        smoke_set(load_manifest(path))
    assert f"{path.parent / 'smoke' / 'in.fasta'}:3: gapped: position 3 is a gap (-)" in str(refused.value)
    os.chmod(path.parent / "smoke" / "in.fasta", 0o666)
    with pytest.raises(ManifestError, match="is writable by others"):
        smoke_set(load_manifest(path))
