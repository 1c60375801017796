"""Kits probed and applied in an interpreter of their own (a throwaway venv)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from providers import make_kit_venv, write_provider

from resident_pool import KitUnavailable
from resident_pool.kit import kit_command, probe_kit, stray_variables
from resident_pool.launch import worker_for
from resident_pool.manifest import load_manifest


@pytest.fixture(scope="module")
def kit_python(tmp_path_factory):
    return str(make_kit_venv(tmp_path_factory.mktemp("kitvenv") / "venv"))


@pytest.fixture
def provider(tmp_path, kit_python, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))

    def make(slug, kit_body, extra=""):
        body = f'[env]\npython = "{kit_python}"\n{extra}[kit]\n{kit_body}'
        return load_manifest(write_provider(tmp_path, slug, body, worker="toyworker.py"))

    return make


AUTOLOAD = 'name = "toykit"\nmode = "fast"\nlevers_off = ["fusion", "graphs"]\n[kit.env]\nTOYKIT_OPT_TRACE = "1"\n'
LAUNCH = 'package = "launchkit_opt"\nmode = "triton"\n'


def test_probe_of_an_autoload_kit(provider, kit_python):
    manifest = provider("auto", AUTOLOAD)
    row = probe_kit(manifest, kit_python, {})
    assert row.package == "toykit_opt"
    assert Path(row.model_opt).name == "toykit_opt" and str(Path(kit_python).parents[1]) in row.model_opt
    assert row.mode_env == "TOYKIT_OPT_MODE"
    assert row.modes == ["fast", "safe"]
    assert row.resolve_shape == "resolve(mode)"
    assert row.row == {"TOY_FUSED_KERNELS": "1", "OMP_NUM_THREADS": "1"}
    assert row.jit_cache_key == "toykit-1.0-cpu-py311" and row.jit_cache_key_error is None
    assert row.extra_rows == {"alloc": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}}
    assert row.activation == "autoload" and row.launch_opts == []


def test_probe_of_a_worker_launch_kit(provider, kit_python):
    manifest = provider("launch", LAUNCH)
    row = probe_kit(manifest, kit_python, {})
    assert row.mode_env == "LAUNCHKIT_OPT_MODE"  # found as ENV_MODE on launchkit_opt.stack
    assert row.modes == ["triton", "eager"]
    assert row.resolve_shape == "resolve(mode, home)"
    assert row.row == {"LAUNCHKIT_HOME": row.model_opt, "LAUNCHKIT_FAST_PATH": "triton"}  # from .exports
    assert row.jit_cache_key is None
    assert row.jit_cache_key_error == "RuntimeError: no compiler found for the JIT cache key"
    assert row.activation == "worker_launch"
    assert row.launch_opts == ["--route", "triton", "--replicas", "1", "--profile", "defaults"]


def test_the_kit_polices_its_namespace_and_the_probe_scrubs_strays(provider, kit_python, monkeypatch):
    monkeypatch.setenv("TOYKIT_OPT_LEFTOVER", "1")
    refused = subprocess.run([kit_python, "-c", "pass"], capture_output=True, text=True, check=False)
    assert refused.returncode == 3 and "TOYKIT_OPT_LEFTOVER" in refused.stderr
    row = probe_kit(provider("scrub", AUTOLOAD), kit_python, {})
    assert row.package == "toykit_opt"


def test_levers_off_reach_the_probe(provider, kit_python, tmp_path):
    manifest = provider("levers", AUTOLOAD)
    spy = tmp_path / "spy.py"
    spy.write_text("import os, json; print('KITROW ' + json.dumps({'levers': os.environ.get('MODEL_OPT_LEVERS_OFF'),"
                   " 'strays': sorted(k for k in os.environ if k.startswith('TOYKIT_OPT_'))}))\n")
    env = {"TOYKIT_OPT_STRAY": "x", "TOYKIT_OPT_TRACE": "1"}
    import resident_pool.kit as kit_module

    original = kit_module.PROBE_PATH
    kit_module.PROBE_PATH = str(spy)
    try:
        row = probe_kit(manifest, kit_python, env)
    finally:
        kit_module.PROBE_PATH = original
    assert row.levers == "fusion,graphs"
    assert row.strays == ["TOYKIT_OPT_TRACE"]  # declared through [kit.env]; the stray is gone


def test_an_autoload_worker_really_runs_patched(provider, monkeypatch):
    monkeypatch.setenv("TOYKIT_OPT_UNDECLARED", "would make the kit exit 3")
    manifest = provider("toy", AUTOLOAD)
    worker = worker_for(manifest)
    try:
        assert worker.request({"x": 21}) == {"value": 42}
        pong = worker.ping()
    finally:
        worker.close()
    assert pong["patched"] == "toykit_opt:fast"
    env = pong["env"]
    assert env["TOYKIT_OPT_MODE"] == "fast"
    assert env["TOYKIT_OPT_TRACE"] == "1"
    assert "TOYKIT_OPT_UNDECLARED" not in env
    assert env["MODEL_OPT"].endswith("toykit_opt")
    assert env["MODEL_OPT_STACK_KEY"] == "toykit-1.0-cpu-py311"
    assert env["MODEL_OPT_LEVERS_OFF"] == "fusion,graphs"
    assert env["MODEL_OPT_JIT_ROOT"].endswith(os.path.join("resident-pool", "jit", "toy"))
    assert os.path.isdir(env["MODEL_OPT_JIT_ROOT"])
    assert env["TOY_FUSED_KERNELS"] == "1" and env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"


def test_a_worker_launch_worker_runs_under_the_kits_route(provider):
    worker = worker_for(provider("launched", LAUNCH))
    try:
        assert worker.request({"x": 2}) == {"value": 4}
        pong = worker.ping()
    finally:
        worker.close()
    assert pong["patched"] == "launchkit_opt:triton"
    assert pong["env"]["LAUNCHKIT_ROUTE"] == "triton"
    assert pong["env"]["LAUNCHKIT_FAST_PATH"] == "triton"
    assert "MODEL_OPT_STACK_KEY" not in pong["env"]  # its key failed: recorded, not invented


def test_an_empty_row_is_an_error_unless_declared(provider, kit_python):
    manifest = provider("empty", 'name = "emptykit"\nmode = "any"\n')
    row = probe_kit(manifest, kit_python, {})
    with pytest.raises(KitUnavailable, match='env_row = "none"'):
        kit_command(manifest, row, kit_python, ["w.py"])
    declared = provider("emptyok", 'name = "emptykit"\nmode = "any"\nenv_row = "none"\nenv_row_reason = "CPU only"\n')
    argv, env = kit_command(declared, probe_kit(declared, kit_python, {}), kit_python, ["w.py"])
    assert argv == [kit_python, "w.py"] and env["EMPTYKIT_OPT_MODE"] == "any"


def test_a_kit_without_a_mode_variable_belongs_in_subprocess_mode(provider, kit_python):
    manifest = provider("nomode", 'name = "nomodekit"\nmode = "only"\n')
    with pytest.raises(KitUnavailable, match='mode = "subprocess"'):
        kit_command(manifest, probe_kit(manifest, kit_python, {}), kit_python, ["w.py"])


def test_a_kit_that_is_not_installed_is_named_with_the_probe_output(provider, kit_python):
    manifest = provider("absent", 'name = "absent"\nmode = "x"\n')
    with pytest.raises(KitUnavailable) as info:
        probe_kit(manifest, kit_python, {})
    assert "absent_opt gave no KITROW line" in str(info.value)
    assert info.value.exit_code == 1
    assert any("ModuleNotFoundError" in line for line in info.value.transcript_tail)


def test_stray_variables():
    environ = {"BOLTZ_OPT_MODE": "x", "BOLTZ_OPT_OLD": "y", "BOLTZ_OPTIONS": "z", "OTHER": "1"}
    assert stray_variables("boltz_opt", environ, {"BOLTZ_OPT_MODE"}) == {"BOLTZ_OPT_OLD": None}
