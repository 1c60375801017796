"""Outside review of issues 23 (code written to the original design) and 24 (trust, third round).

Each test is one defect found by trying to break what was built: it fails now. Workers, kits and callers are in
tests/review_r2324/, written from the original design's three reference files alone.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest
from providers import make_kit_venv, write_provider

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).parent / "review_r2324"
KITS = HERE / "kits"
STACK = ROOT / "infra" / "local" / "stack.sh"
sys.path.insert(0, str(ROOT / "flows"))


# -- at HEAD (94b768c): no pool starts any worker ------------------------------------------------------------------


def test_review_a_pool_starts_a_plain_worker_at_all(pool_dir):
    """server/starts.py:54 writes ``self.workers[...]`` on the Starter, which has no ``workers``: every first start
    of a replica fails with AttributeError, so every pool, CLI and Prefect path of both issues is down at HEAD."""
    from resident_pool import Pool

    write_provider(pool_dir, "echo", "")
    with Pool(manifests=pool_dir) as pool:
        answer = pool.predict("echo", {"x": 1})
        pool.stop("echo")
    assert answer is not None


# -- issue 23: a kit laid out for the original launcher --------------------------------------------------------------


@pytest.fixture
def kit_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    for name in ("MODEL_OPT", "MODEL_OPT_JIT_ROOT", "MODEL_OPT_LEVERS_OFF"):
        monkeypatch.delenv(name, raising=False)
    return tmp_path


def test_review_a_kit_whose_resolve_answers_a_read_only_mapping_gets_its_row_read(tmp_path, kit_home):
    """The original probe's `_row_of` tries `getattr(resolution, "env")`, then `resolution["env"]`: any mapping
    answers. kit_probe.py's `_vars` subscripts only a `dict` (else getattr), so a kit whose resolve() hands out a
    `types.MappingProxyType` (or a UserDict, or any Mapping) exports "an empty environment row" and the
    provider is refused. Expected: the row the original launcher reads, {"PROXIED_OPT_ROUTE": "triton"}."""
    from resident_pool.kit import ask_kit

    python = make_kit_venv(tmp_path / "venv", "proxied_opt", kits_dir=KITS)
    answer = ask_kit(python, "proxied_opt", "fast")
    assert answer["env"] == {"PROXIED_OPT_ROUTE": "triton"}, answer


def test_review_a_kit_whose_resolve_answers_a_read_only_mapping_serves_under_the_pool(pool_dir, tmp_path,
                                                                                       kit_home):
    from resident_pool import Pool

    python = make_kit_venv(tmp_path / "venv", "proxied_opt", kits_dir=KITS)
    write_provider(pool_dir, "proxied", f'[env]\npython = "{python}"\n[kit]\npackage = "proxied_opt"\n',
                   worker=ROOT / "tests" / "original" / "worker.py")
    with Pool(manifests=pool_dir) as pool:
        answer = pool.predict("proxied", {"sequence": "MKVLA", "report": True})
        pool.stop("proxied")
    assert answer["report"]["env"]["MODEL_OPT"], answer


def test_review_the_originals_kit_env_takes_a_number_as_its_text(tmp_path):
    """The original launcher applies `[kit] env` with `env[str(key)] = str(value)`: `POST_RELEASE_NTOK = 0` is
    "0". Here `Kit.env` is dict[str, str] under a strict model, so a manifest the original ran is a
    ManifestError ("Input should be a valid string"). Expected: loaded, the value "0"."""
    from resident_pool.manifest import load_manifest

    folder = tmp_path / "manifests" / "numbered"
    folder.mkdir(parents=True)
    shutil.copy(ROOT / "tests" / "original" / "worker.py", folder / "worker.py")
    (folder / "manifest.toml").write_text('slug = "numbered"\nworker = "worker.py"\n[kit]\npackage = "proxied_opt"\n'
                                          "[kit.env]\nPROXIED_OPT_POST_RELEASE_NTOK = 0\nPROXIED_OPT_CAP = 1.5\n")
    manifest = load_manifest(folder / "manifest.toml")
    assert manifest.kit.env == {"PROXIED_OPT_POST_RELEASE_NTOK": "0", "PROXIED_OPT_CAP": "1.5"}


# -- issue 23: a caller written to the original supervisor -----------------------------------------------------------


def test_review_a_build_command_whose_argv_holds_paths_starts_its_worker():
    """The original supervisor hands `build_command`'s argv to Popen as it is, and Popen takes path objects: a
    caller's builder written as `[python, Path(__file__).with_name("worker.py"), worker.socket_path]` ran. Here
    the worker is spawned, then `WorkerProcess._started` joins the argv for its note (`' '.join(launch.argv)`,
    worker_process.py:224) and raises a bare TypeError; the spawned worker is killed and the caller gets neither
    a reply nor a WorkerStartError. Expected: the reply."""
    from resident_pool.supervisor import ResidentWorker

    python = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable
    script = Path(__file__).parent / "original" / "worker.py"

    def build(worker):
        return [python, script, worker.socket_path], {"ORIGINAL_CALLER": "1"}

    worker = ResidentWorker("origin", build)
    try:
        with worker.lock:
            reply = worker.request({"op": "predict", "sequence": "MKV"})
    finally:
        worker.stop()
    assert reply["ok"] and reply["result"]["reversed"] == "VKM"
