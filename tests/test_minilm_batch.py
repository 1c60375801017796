"""The demo provider's batch function (manifests/minilm/worker.py, ``embed_batch``), in this process: payloads of
several callers embedded in one model call each get their own answers, as they would alone, and a payload that
cannot be read fails alone."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import load_minilm_worker

from resident_pool.campaigns.inputs import InputFile
from resident_pool.providers.launch import weights_root
from resident_pool.providers.manifest import load_manifest

MINILM = Path(__file__).resolve().parents[1] / "manifests" / "minilm"
# Padding moves the last digits of a window's mean (one sequence alone and in a batch differed by 1.6e-7 here).
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def demo():
    worker = load_minilm_worker("minilm_worker")
    model = worker.load(str(weights_root(load_manifest(MINILM / "manifest.toml"))))
    return worker, model


def proteins() -> list[str]:
    """The smoke proteins, shortest first (49 residues and up); the last one long enough for two windows."""
    texts = sorted(record.text for record in InputFile(MINILM / "smoke" / "proteins.fasta").records())
    texts.sort(key=len)
    return [*texts[:8], next(text for text in texts if 254 < len(text) < 381)]


def test_each_payload_of_a_batch_gets_its_own_answers_as_it_would_alone(demo):
    worker, model = demo
    texts = proteins()
    payloads = [{"inputs": texts[0:1]}, {"inputs": texts[1:4]}, {"inputs": ["The cat sat.", "Hello"], "kind": "text"},
                {"inputs": []}, {"inputs": [texts[8], texts[4]]}, {"inputs": texts[0:1]}]
    together = worker.embed_batch(model, payloads)
    assert len(together) == len(payloads)
    for payload, (vectors, items) in zip(payloads, together, strict=True):
        alone, alone_items = worker.embed_batch(model, [payload])[0]
        assert items == alone_items and len(items) == len(payload["inputs"])
        if not payload["inputs"]:
            continue
        assert vectors.shape == (len(payload["inputs"]), 384)
        assert abs(vectors - alone).max() <= TOLERANCE, payload
    # and as embed() reads them, one request's inputs alone (the in-process baselines of bench/run.py)
    single, _ = worker.embed(model, payloads[4]["inputs"])
    assert abs(together[4][0] - single).max() <= TOLERANCE
    # the answers belong to their inputs: a payload's vector is nearest its own input's, not a neighbour's
    assert abs(together[0][0][0] - together[5][0][0]).max() <= TOLERANCE
    assert abs(together[0][0][0] - together[1][0][0]).max() > 0.01
    assert together[4][1][0]["windows"] == 2  # a long one: its windows were batched with the others' too


def test_a_payload_that_cannot_be_read_fails_alone_and_names_its_input(demo):
    worker, model = demo
    texts = proteins()
    good = [{"inputs": texts[5:7]}, {"inputs": texts[7:8]}]
    bad = [{"inputs": ["MKV", "MKV1"]}, "not a dict", {"inputs": "MKV"}, {"inputs": ["MKV"], "kind": "dna"},
           {"inputs": ["MKV", ""]}, {"inputs": ["   "], "kind": "text"}, {"inputs": ["MKV"], "batch_size": 0}]
    payloads = [good[0], *bad, good[1]]
    outcomes = worker.embed_batch(model, payloads)
    errors = [str(outcome) for outcome in outcomes[1:-1]]
    assert all(isinstance(outcome, ValueError) for outcome in outcomes[1:-1]), outcomes
    assert "input 2: '1' is not a residue letter" in errors[0]
    assert 'payload must be {"inputs": [str, ...]}' in errors[1] and errors[1] == errors[2]
    assert "kind must be one of protein, text, not 'dna'" in errors[3]
    assert "input 2 holds no residue" in errors[4] and "input 1 holds no text" in errors[5]
    assert "batch_size must be a whole number of at least 1, not 0" in errors[6]
    for payload, outcome in zip(good, (outcomes[0], outcomes[-1]), strict=True):
        alone = worker.embed_batch(model, [payload])[0]
        assert outcome[1] == alone[1] and abs(outcome[0] - alone[0]).max() <= TOLERANCE


def test_a_payloads_work_counts_the_tokens_its_windows_read_and_an_unreadable_one_counts_nothing(demo):
    worker, _ = demo
    assert worker.work({"inputs": ["M" * 10, "M" * 254]}) == 264
    assert worker.work({"inputs": ["M" * 300]}) == 2 * 254  # two windows overlapping by half
    assert worker.work({"inputs": "MKV"}) == worker.work("x") == worker.work({"inputs": [3]}) == 0
