"""Review 36 (outside reviewer): probes of the suite-time changes for issue 32 (eb6b9d8, f26f2be, aa64d15).

Each is small: a tokenizer, the demo model on a dozen proteins, a stand-in container engine; no pool.
"""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
from helpers import as_the_pool, load_minilm_worker, read_fasta
from providers import write_provider

from resident_pool.providers.launch import plan_launch, weights_root
from resident_pool.providers.manifest import load_manifest

ROOT = Path(__file__).resolve().parents[1]
MINILM = ROOT / "manifests" / "minilm"
DEMO = ROOT / "data" / "uniprot-500.fasta"
FIRST_ANSWERS = 64  # the demo file's answers tests/test_ui.py's quick run still checks
THREADS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


def test_r36_every_protein_of_the_demo_file_reads_without_an_unknown_token():
    """eb6b9d8 moved the check of the demo file's 500 answers (each ok, no unknown token) from the suite to `make
    bench`; the UI's quick run checks the first 64. Those hold no 'X' (six proteins past the 268th do) and the smoke
    set none either, so a worker that read X as [UNK] passed the suite. All 500 read as the worker reads them,
    tokenizer only (no model): well under a second."""
    pytest.importorskip("transformers")
    from transformers import AutoTokenizer

    proteins = read_fasta(DEMO)
    tokenizer = AutoTokenizer.from_pretrained(weights_root(load_manifest(MINILM / "manifest.toml")))
    ids, unknown = load_minilm_worker("r36_minilm_worker").token_ids(tokenizer, list(proteins.values()), "protein")
    assert [len(row) for row in ids] == [len(text) for text in proteins.values()]
    bad = [name for name, count in zip(proteins, unknown, strict=True) if count]
    assert not bad, f"{len(bad)} demo proteins read with unknown tokens, first {bad[:3]}"


def _tail(proteins: dict[str, str]) -> list[str]:
    """What only the part of the demo file past the quick run's first answers holds: a protein with a letter the
    first ones lack, the shortest and the longest, and each repeated sequence's copies."""
    names = list(proteins)
    head = set("".join(proteins[name] for name in names[:FIRST_ANSWERS]))
    chosen = [name for name in names[FIRST_ANSWERS:] if set(proteins[name]) - head]
    by_length = sorted(names, key=lambda name: len(proteins[name]))
    chosen += [by_length[0], by_length[-1]]
    copies: dict[str, list[str]] = {}
    for name in names:
        copies.setdefault(proteins[name], []).append(name)
    chosen += [name for group in copies.values() if len(group) > 1 for name in group]
    return list(dict.fromkeys(chosen))


@pytest.mark.slow
@pytest.mark.e2e  # the model: out of the fast tier
def test_r36_the_demo_proteins_only_the_files_tail_holds_get_real_distinct_answers():
    """The demo file's tail through the model (12 proteins, 86 windows): the proteins with an 'X', the shortest (8
    residues; the first 64 start at 31), the longest (4,291: 33 windows; the first 64 reach 15) and the repeated
    sequences, whose copies must share their answer (the old check's 498 distinct of 500)."""
    pytest.importorskip("sentence_transformers")
    proteins = read_fasta(DEMO)
    chosen = _tail(proteins)
    assert any("X" in proteins[name] for name in chosen) and len(chosen) >= 10
    worker = load_minilm_worker("r36_minilm_worker")
    model = worker.load(weights_root(load_manifest(MINILM / "manifest.toml")))
    texts = [proteins[name] for name in chosen]
    vectors, items = worker.embed(model, texts)
    assert [item["unknown_tokens"] for item in items] == [0] * len(chosen), list(zip(chosen, items, strict=True))
    assert [item["windows"] for item in items] == [len(worker.windows(len(text))) for text in texts]
    answers = {text: set() for text in texts}
    for text, vector in zip(texts, vectors, strict=True):
        answers[text].add(vector.tobytes())
    assert all(len(found) == 1 for found in answers.values()), "a repeated sequence got two answers"
    assert len({next(iter(found)) for found in answers.values()}) == len(answers), "two proteins got one answer"


@pytest.mark.parametrize("engine", ["docker", "podman", "apptainer"])
def test_r36_the_pools_thread_limits_reach_a_container_worker_as_they_reach_a_venv_one(tmp_path, monkeypatch, engine):
    """docs/security.md (eb6b9d8): a worker's fixed base holds OMP_NUM_THREADS, MKL_NUM_THREADS and
    OPENBLAS_NUM_THREADS, "so a pool started under a CPU limit keeps its workers within it". Only a venv worker's
    did: a container's worker saw none of them, and torch in it started a thread per host core."""
    stand_in = tmp_path / "bin" / engine
    stand_in.parent.mkdir()
    stand_in.write_text("#!/bin/sh\nexit 0\n")
    stand_in.chmod(stand_in.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{stand_in.parent}:{__import__('os').environ['PATH']}")
    for name in THREADS:
        monkeypatch.setenv(name, "3")
    weights, work = tmp_path / "weights", tmp_path / "work"
    weights.mkdir()
    body = (f'work_root = "{work}"\n[env]\nkind = "container"\nengine = "{engine}"\nimage = "img"\n'
            f'[weights]\nroot = "{weights}"\n')
    manifest = load_manifest(write_provider(tmp_path / "manifests", "threads", body))
    run_dir = tmp_path / "w" / "threads-0-1"
    run_dir.mkdir(parents=True)
    argv, env = plan_launch(manifest, str(run_dir / "worker.sock"), name="rp-threads", **as_the_pool()).command()
    if engine == "apptainer":
        assert {name: env.get(f"APPTAINERENV_{name}") for name in THREADS} == dict.fromkeys(THREADS, "3"), env
    else:
        passed = {argv[i + 1] for i, item in enumerate(argv) if item == "--env"}
        assert set(THREADS) <= passed, argv
        assert {name: env.get(name) for name in THREADS} == dict.fromkeys(THREADS, "3"), env
