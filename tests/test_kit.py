"""Kits probed and applied in an interpreter of their own: each kit alone in a throwaway venv."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from helpers import as_the_pool, configured
from providers import make_kit_venv, write_provider

from resident_pool import KitUnavailable
from resident_pool.providers import kit_rules
from resident_pool.providers.kit_rules import KitRow, stray_variables
from resident_pool.providers.launch import LaunchPlan, plan_launch, worker_for
from resident_pool.providers.manifest import load_manifest


@pytest.fixture(scope="module")
def kit_venv(tmp_path_factory):
    """``kit_venv(kit, checkout=True)``: the python of a venv holding that one kit (made once per module)."""
    made: dict[tuple[str, bool], Path] = {}

    def make(kit: str, checkout: bool = True) -> Path:
        if (kit, checkout) not in made:
            folder = tmp_path_factory.mktemp(f"{kit}-{'checkout' if checkout else 'site'}")
            made[kit, checkout] = make_kit_venv(folder / "venv", kit, checkout=checkout)
        return made[kit, checkout]

    return make


def kit_tree(python: Path, kit: str) -> str:
    """Where the kit's checkout is: two levels above its package directory."""
    return str(python.parents[1] / f"{kit}-checkout")


@pytest.fixture
def provider(tmp_path, kit_venv, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("MODEL_OPT", raising=False)
    monkeypatch.delenv("MODEL_OPT_JIT_ROOT", raising=False)

    def make(slug, kit, kit_body, extra="", checkout=True, worker_args=None):
        python = kit_venv(kit, checkout)
        body = f'[env]\npython = "{python}"\n{extra}[kit]\n{kit_body}'
        if worker_args is not None:
            body = f"worker_args = {worker_args!r}\n".replace("'", '"') + body
        return load_manifest(write_provider(tmp_path, slug, body, worker="toyworker.py"))

    return make


def probe(manifest, socket="/tmp/unused.sock"):
    return LaunchPlan.resolve(manifest, socket, **as_the_pool()).probe()


def serve_once(manifest, payload):
    worker = worker_for(manifest, config=configured()[0])
    try:
        result = worker.predict(payload)
        pong = worker.ping()
    finally:
        worker.close()
    return result, pong


AUTOLOAD = 'name = "toykit"\nmode = "fast"\nlevers_off = ["fusion", "graphs"]\n[kit.env]\nTOYKIT_OPT_TRACE = "1"\n'
LAUNCH = 'package = "launchkit_opt"\nmode = "triton"\n'


def test_probe_of_an_autoload_kit_names_the_kit_tree(provider, kit_venv):
    manifest = provider("auto", "toykit_opt", AUTOLOAD)
    row = probe(manifest)
    assert row.package == "toykit_opt"
    assert row.model_opt == kit_tree(kit_venv("toykit_opt"), "toykit_opt")
    assert row.model_opt_source == "kit tree" and row.model_opt_error is None
    assert row.mode_env == "TOYKIT_OPT_MODE"  # ENV on toykit_opt._autoload
    assert row.modes == ["fast", "safe"]
    assert row.resolve_shape == "resolve(mode)"
    assert row.row == {"TOY_FUSED_KERNELS": "1", "OMP_NUM_THREADS": "1"}
    assert row.jit_cache_key == "toykit-1.0-cpu-py311" and row.jit_cache_key_error is None
    assert row.extra_rows == {"alloc": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}}
    assert row.activation == "autoload" and row.launch_opts == []


def test_probe_of_a_worker_launch_kit_hands_the_kit_tree_to_resolve(provider, kit_venv):
    manifest = provider("launch", "launchkit_opt", LAUNCH)
    row = probe(manifest)
    tree = kit_tree(kit_venv("launchkit_opt"), "launchkit_opt")
    assert row.mode_env == "LAUNCHKIT_OPT_MODE"  # ENV_MODE on launchkit_opt.stack
    assert row.modes == ["triton", "eager"]
    assert row.resolve_shape == "resolve(mode, home)"
    assert row.row == {"LAUNCHKIT_HOME": tree, "LAUNCHKIT_FAST_PATH": "triton"}  # from .exports
    assert row.jit_cache_key is None
    assert row.jit_cache_key_error == "RuntimeError: no compiler found for the JIT cache key"
    assert row.activation == "worker_launch"
    assert row.launch_opts == ["--route", "triton", "--replicas", "1", "--profile", "defaults"]


def test_the_kit_polices_its_namespace_and_the_probe_scrubs_strays(provider, kit_venv, monkeypatch):
    monkeypatch.setenv("TOYKIT_OPT_LEFTOVER", "1")
    refused = subprocess.run([kit_venv("toykit_opt"), "-c", "pass"], capture_output=True, text=True, check=False)
    assert refused.returncode == 3 and "TOYKIT_OPT_LEFTOVER" in refused.stderr
    assert probe(provider("scrub", "toykit_opt", AUTOLOAD)).package == "toykit_opt"


def test_the_probe_runs_under_the_workers_environment(provider, tmp_path, monkeypatch):
    """levers_off, the declared kit variables, the passthrough list and the weights root reach the probe."""
    weights = tmp_path / "weights"
    weights.mkdir()
    manifest = provider("levers", "toykit_opt", AUTOLOAD,
                        extra=f'passthrough = []\n[weights]\nroot_env = "TOYWEIGHTS"\nroot = "{weights}"\n')
    spy = tmp_path / "spy.py"
    spy.write_text("import os, json; print('KITROW ' + json.dumps({'env': dict(os.environ)}))\n")
    monkeypatch.setenv("TOYKIT_OPT_STRAY", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "hunter2")
    monkeypatch.setattr(kit_rules, "PROBE_PATH", str(spy))
    env = probe(manifest).data["env"]
    assert env["MODEL_OPT_LEVERS_OFF"] == "fusion,graphs"
    assert env["TOYKIT_OPT_TRACE"] == "1"  # declared through [kit.env]; the stray is gone
    assert "TOYKIT_OPT_STRAY" not in env
    assert "AWS_SECRET_ACCESS_KEY" not in env  # not on the passthrough list: the worker will not see it either
    assert env["TOYWEIGHTS"] == str(weights)
    assert os.path.isfile(env["RESIDENT_POOL_WORKER_BASE"])


def test_an_autoload_worker_runs_patched_with_model_opt_the_kit_tree(provider, kit_venv, monkeypatch):
    monkeypatch.setenv("TOYKIT_OPT_UNDECLARED", "would make the kit exit 3")
    manifest = provider("toy", "toykit_opt", AUTOLOAD, worker_args=["{socket}", "{kit}"])
    result, pong = serve_once(manifest, {"x": 21})
    assert result == {"value": 42}
    assert pong["patched"] == "toykit_opt:fast"
    env = pong["env"]
    tree = kit_tree(kit_venv("toykit_opt"), "toykit_opt")
    assert env["MODEL_OPT"] == tree and pong["argv"][2] == tree  # {kit} is the same path
    assert env["TOYKIT_OPT_MODE"] == "fast"
    assert env["TOYKIT_OPT_TRACE"] == "1"
    assert "TOYKIT_OPT_UNDECLARED" not in env
    assert env["MODEL_OPT_STACK_KEY"] == "toykit-1.0-cpu-py311"
    assert env["MODEL_OPT_LEVERS_OFF"] == "fusion,graphs"
    # One folder per provider and stack key: a kit upgrade starts a fresh cache beside the old one.
    assert env["MODEL_OPT_JIT_ROOT"].endswith(os.path.join("resident-pool", "jit", "toy", "toykit-1.0-cpu-py311"))
    assert os.path.isdir(env["MODEL_OPT_JIT_ROOT"])
    assert env["TOY_FUSED_KERNELS"] == "1" and env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"


def test_an_exported_model_opt_wins_over_the_kit_tree(provider, tmp_path, monkeypatch):
    elsewhere = tmp_path / "models-opt"
    elsewhere.mkdir()
    monkeypatch.setenv("MODEL_OPT", str(elsewhere))
    manifest = provider("exported", "launchkit_opt", LAUNCH)
    row = probe(manifest)
    assert row.model_opt == str(elsewhere) and row.model_opt_source == "environment"
    assert row.row["LAUNCHKIT_HOME"] == str(elsewhere)  # resolve(mode, home) got it too
    _, pong = serve_once(manifest, {"x": 1})
    assert pong["env"]["MODEL_OPT"] == str(elsewhere)


def test_a_model_opt_in_the_manifest_is_what_the_kit_sees(provider, tmp_path, monkeypatch):
    tree = tmp_path / "boltz-checkout"
    tree.mkdir()
    monkeypatch.setenv("MODEL_OPT", str(tmp_path / "another-kits-tree"))
    manifest = provider("declared", "launchkit_opt", LAUNCH + f'model_opt = "{tree}"\n')
    _, pong = serve_once(manifest, {"x": 1})
    assert pong["env"]["MODEL_OPT"] == str(tree) and pong["env"]["LAUNCHKIT_HOME"] == str(tree)


def test_a_kit_in_site_packages_has_no_kit_tree_and_needs_model_opt(provider, tmp_path, monkeypatch):
    manifest = provider("sited", "toykit_opt", AUTOLOAD, checkout=False)
    row = probe(manifest)
    assert row.model_opt is None and "site-packages" in row.model_opt_error
    with pytest.raises(KitUnavailable, match=r"export MODEL_OPT or set \[kit\] model_opt") as info:
        plan_launch(manifest, "/tmp/unused.sock", **as_the_pool()).command()
    assert "site-packages" in str(info.value)
    exported = tmp_path / "toykit-tree"
    exported.mkdir()
    monkeypatch.setenv("MODEL_OPT", str(exported))
    _, pong = serve_once(manifest, {"x": 1})
    assert pong["env"]["MODEL_OPT"] == str(exported) and pong["patched"] == "toykit_opt:fast"


def test_a_worker_launch_worker_runs_under_the_kits_route_without_its_mode_variable(provider, monkeypatch):
    """The mode variable would arm the kit's hook a second time inside the worker: it exits 3."""
    monkeypatch.setenv("LAUNCHKIT_OPT_MODE", "triton")  # left in the pool's environment, and declared
    manifest = provider("launched", "launchkit_opt", LAUNCH + 'mode_env = "LAUNCHKIT_OPT_MODE"\n')
    result, pong = serve_once(manifest, {"x": 2})
    assert result == {"value": 4}
    assert pong["patched"] == "launchkit_opt:triton"
    assert "LAUNCHKIT_OPT_MODE" not in pong["env"]
    assert pong["env"]["LAUNCHKIT_ROUTE"] == "triton"
    assert pong["env"]["LAUNCHKIT_FAST_PATH"] == "triton"
    assert "MODEL_OPT_STACK_KEY" not in pong["env"]  # its key failed: recorded, not invented


def test_the_jit_root_from_the_environment_is_used_as_is(provider, tmp_path, monkeypatch):
    shared = tmp_path / "jit-shared"
    monkeypatch.setenv("MODEL_OPT_JIT_ROOT", str(shared))
    _, pong = serve_once(provider("jitenv", "toykit_opt", AUTOLOAD), {"x": 1})
    assert pong["env"]["MODEL_OPT_JIT_ROOT"] == str(shared) and shared.is_dir()


def test_the_manifests_jit_root_wins_over_the_environment(provider, tmp_path, monkeypatch):
    monkeypatch.setenv("MODEL_OPT_JIT_ROOT", str(tmp_path / "jit-shared"))
    mine = tmp_path / "jit-mine"
    _, pong = serve_once(provider("jitmine", "toykit_opt", AUTOLOAD.replace("[kit.env]", f'jit_root = "{mine}"\n'
                                                                                         "[kit.env]")), {"x": 1})
    assert pong["env"]["MODEL_OPT_JIT_ROOT"] == str(mine)


def test_a_worker_launch_kit_without_launch_opts_cannot_start(provider):
    manifest = provider("optless", "optlesskit_opt", 'name = "optlesskit"\nmode = "route"\n')
    row = probe(manifest)
    assert row.activation == "worker_launch" and row.launch_opts is None
    with pytest.raises(KitUnavailable, match="launch_opts"):
        plan_launch(manifest, "/tmp/unused.sock", **as_the_pool()).command()


def test_an_empty_row_is_an_error_unless_declared(provider):
    manifest = provider("empty", "emptykit_opt", 'name = "emptykit"\nmode = "any"\n')
    with pytest.raises(KitUnavailable, match='env_row = "none"'):
        plan_launch(manifest, "/tmp/unused.sock", **as_the_pool()).command()
    declared = provider("emptyok", "emptykit_opt",
                        'name = "emptykit"\nmode = "any"\nenv_row = "none"\nenv_row_reason = "CPU only"\n')
    argv, env = plan_launch(declared, "/tmp/unused.sock", **as_the_pool()).command()
    assert argv[1:] == [str(declared.worker_path), "/tmp/unused.sock"] and env["EMPTYKIT_OPT_MODE"] == "any"


def test_a_kit_without_a_mode_variable_belongs_in_subprocess_mode(provider):
    manifest = provider("nomode", "nomodekit_opt", 'name = "nomodekit"\nmode = "only"\n')
    with pytest.raises(KitUnavailable, match='mode = "subprocess"'):
        plan_launch(manifest, "/tmp/unused.sock", **as_the_pool()).command()


def test_a_kit_that_is_not_installed_is_named_with_the_probe_output(provider, kit_venv):
    manifest = provider("absent", "toykit_opt", 'name = "absent"\nmode = "x"\n')
    with pytest.raises(KitUnavailable) as info:
        probe(manifest)
    assert "absent_opt gave no KITROW line" in str(info.value)
    assert f"is it installed in {kit_venv('toykit_opt')}?" in str(info.value)
    assert info.value.exit_code == 1
    assert any("ModuleNotFoundError" in line for line in info.value.transcript_tail)


def test_a_policing_refusal_in_the_probe_is_quoted_not_taken_for_a_missing_kit(provider):
    manifest = provider("policed", "toykit_opt", AUTOLOAD.replace('TRACE = "1"', 'TRACE = "1"\nTOYKIT_OPT_BOGUS = "1"'))
    with pytest.raises(KitUnavailable) as info:
        plan_launch(manifest, "/tmp/unused.sock", **as_the_pool()).command()
    message = str(info.value)
    assert "refused" in message and "REFUSED: undeclared variables TOYKIT_OPT_BOGUS" in message
    assert "is it installed" not in message
    assert info.value.exit_code == 3


def test_stray_variables():
    environ = {"BOLTZ_OPT_MODE": "x", "BOLTZ_OPT_OLD": "y", "BOLTZ_OPTIONS": "z", "OTHER": "1"}
    assert stray_variables("boltz_opt", environ, {"BOLTZ_OPT_MODE"}) == {"BOLTZ_OPT_OLD": None}


def test_each_stack_key_gets_its_own_jit_folder_under_the_default_root_and_the_old_one_stays(provider, tmp_path):
    manifest = provider("upgraded", "toykit_opt", AUTOLOAD)
    plan = LaunchPlan.resolve(manifest, "/tmp/unused.sock", **as_the_pool())
    row = plan.probe()
    before = plan.with_kit(row).env["MODEL_OPT_JIT_ROOT"]
    upgraded = KitRow({**row.data, "jit_cache_key": "toykit-2.0-cpu-py311"})
    after = plan.with_kit(upgraded).env["MODEL_OPT_JIT_ROOT"]
    root = tmp_path / "cache" / "resident-pool" / "jit" / "upgraded"
    assert (before, after) == (str(root / "toykit-1.0-cpu-py311"), str(root / "toykit-2.0-cpu-py311"))
    assert os.path.isdir(before) and os.path.isdir(after)
    odd = plan.with_kit(KitRow({**row.data, "jit_cache_key": "../../escape me"})).env["MODEL_OPT_JIT_ROOT"]
    assert Path(odd).parent == root and Path(odd).name.startswith("key-")  # never a path out of the root


def test_the_pool_reports_each_kit_providers_jit_cache_and_its_size(provider, tmp_path, monkeypatch):
    from resident_pool import Pool

    manifest = provider("sized", "toykit_opt", AUTOLOAD)
    monkeypatch.setenv("RESIDENT_POOL_QUIET_EXIT_S", "120")
    root = tmp_path / "cache" / "resident-pool" / "jit" / "sized"
    with Pool(manifests=manifest.directory.parent) as pool:
        try:
            pool.predict("sized", {"x": 1})
            (root / "toykit-1.0-cpu-py311" / "compiled.bin").write_bytes(b"k" * 100_000)
            cache = pool.status()["providers"]["sized"]["jit_cache"]
        finally:
            pool.shutdown()
    assert cache["root"] == str(root) and [k["key"] for k in cache["keys"]] == ["toykit-1.0-cpu-py311"]
    assert cache["bytes"] >= 100_000
