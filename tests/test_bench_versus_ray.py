"""The Ray Serve comparison's setup (bench/versus_ray.py): which demo provider it measures, and its rows without Ray."""

from __future__ import annotations

import importlib.util
import itertools
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))  # versus_ray.py imports its neighbour run.py as a script does


def _versus_ray():
    spec = importlib.util.spec_from_file_location("versus_ray_under_test", ROOT / "bench" / "versus_ray.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_demo_without_a_batch_function_is_measured_through_a_batching_copy_and_left_as_shipped(tmp_path):
    from resident_pool.providers.manifest import load_manifest

    versus_ray = _versus_ray()
    (tmp_path / "minilm").mkdir()
    (tmp_path / "minilm" / "worker.py").write_text(
        "def main():\n    def on_predict(payload):\n        return payload\n\n" + versus_ray.SERVE_CALL + "\n")
    (tmp_path / "minilm" / "manifest.toml").write_text(
        (ROOT / "manifests" / "minilm" / "manifest.toml").read_text().split("\n[batching]")[0])
    before = {path.name: path.read_text() for path in (tmp_path / "minilm").iterdir()}

    slug, how = versus_ray.batching_minilm(tmp_path)

    assert slug == versus_ray.BATCHING_SLUG and "temporary copy" in how
    manifest = load_manifest(tmp_path / slug / "manifest.toml")
    assert manifest.slug == slug and manifest.batching is not None and manifest.batching.max_batch_size == 64
    script = (tmp_path / slug / "worker.py").read_text()
    compile(script, "worker.py", "exec")
    assert "on_predict_batch=on_predict_batch" in script and f'slug="{slug}"' in script
    assert {path.name: path.read_text() for path in (tmp_path / "minilm").iterdir()} == before


def test_the_shipped_demo_is_measured_batching_whether_or_not_it_batches_yet(tmp_path):
    from resident_pool.providers.manifest import load_manifest

    versus_ray = _versus_ray()
    shutil.copytree(ROOT / "manifests" / "minilm", tmp_path / "minilm")
    slug, _ = versus_ray.batching_minilm(tmp_path)
    assert load_manifest(tmp_path / slug / "manifest.toml").batching is not None
    script = (tmp_path / slug / "worker.py").read_text()
    compile(script, "worker.py", "exec")
    assert "on_predict_batch=" in script


def test_a_demo_that_batches_is_measured_as_shipped(tmp_path):
    versus_ray = _versus_ray()
    shutil.copytree(ROOT / "manifests" / "minilm", tmp_path / "minilm")
    manifest = tmp_path / "minilm" / "manifest.toml"
    if "[batching]" not in manifest.read_text():
        manifest.write_text(manifest.read_text() + "\n[batching]\nmax_batch_size = 32\n")
    worker = tmp_path / "minilm" / "worker.py"
    if "on_predict_batch" not in worker.read_text():
        worker.write_text(worker.read_text() + "\n# on_predict_batch\n")

    assert versus_ray.batching_minilm(tmp_path)[0] == "minilm"
    assert not (tmp_path / versus_ray.BATCHING_SLUG).exists()


def test_without_ray_serve_each_target_is_counted_not_measured(monkeypatch):
    import run

    versus_ray = _versus_ray()
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray raises ImportError
    monkeypatch.setitem(sys.modules, "ray.serve", None)
    table = run.Table()
    versus_ray.case_versus_ray(table, env=None, quick=True)
    assert table.rows and all(row.get("measured") is False for row in table.rows)
    assert all("pip install -e .[bench]" in row["note"] for row in table.rows)


def test_arrivals_are_poisson_at_the_rate_asked_and_the_same_for_the_same_seed():
    versus_ray = _versus_ray()
    times = versus_ray.arrivals(50.0, 4000, seed=7)
    assert times == versus_ray.arrivals(50.0, 4000, seed=7)
    assert all(later > earlier for earlier, later in itertools.pairwise(times))
    assert abs(len(times) / times[-1] - 50.0) < 5.0
