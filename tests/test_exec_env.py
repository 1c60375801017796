"""Container and venv commands, argument by argument (tests/test_containers.py runs them in stand-in engines)."""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

import pytest
from helpers import as_the_pool, configured
from providers import write_provider

import resident_pool
from resident_pool import ManifestError, WorkerStartError
from resident_pool.providers.exec_env import engine_controls, interpreter, passthrough_env, wrap
from resident_pool.providers.launch import plan_launch, worker_for
from resident_pool.providers.manifest import load_manifest

BINDS = [("/w", "/w", True), ("/state", "/state", False)]


def _container(tmp_path, engine, gpu=True):
    for name in ("scratch", "ref"):  # a bind to a folder this host lacks is refused before the engine runs
        (tmp_path / name).mkdir(exist_ok=True)
    body = (f'[env]\nkind = "container"\nengine = "{engine}"\nimage = "reg/boltz:2"\npython = "/opt/py/bin/python"\n'
            f'binds = ["{tmp_path}/scratch:/scratch", "{tmp_path}/ref:/ref:ro"]\n')
    if gpu:
        body += '[gpu]\npolicy = "required"\nvram_budget_gb = 10\n'
    return load_manifest(write_provider(tmp_path, engine, body))


def test_apptainer_argv_binds_and_env(tmp_path):
    manifest = _container(tmp_path, "apptainer")
    argv, env = wrap(manifest, ["/opt/py/bin/python", "w.py", "s"], {"A": "1", "GONE": None}, BINDS, name="n")
    assert argv == ["apptainer", "exec", "--containall", "--nv", "--bind", "/w:/w:ro", "--bind", "/state:/state",
                    "--bind", f"{tmp_path}/scratch:/scratch", "--bind", f"{tmp_path}/ref:/ref:ro", "reg/boltz:2",
                    "/opt/py/bin/python", "w.py", "s"]
    assert env == {"APPTAINERENV_A": "1"}


def test_apptainer_binds_named_in_the_pools_own_environment_are_removed_from_its_launcher(tmp_path):
    manifest = _container(tmp_path, "apptainer")
    environ = {"APPTAINER_BIND": "/home", "APPTAINER_BINDPATH": "/etc/ssh", "SINGULARITY_BIND": "/root",
               "SINGULARITY_BINDPATH": "/srv", "APPTAINER_CACHEDIR": "/cache", "PATH": "/usr/bin"}
    _, env = wrap(manifest, ["python"], {"A": "1"}, [], name="n", environ=environ)
    assert env == {"APPTAINER_BIND": None, "APPTAINER_BINDPATH": None, "SINGULARITY_BIND": None,
                   "SINGULARITY_BINDPATH": None, "APPTAINERENV_A": "1"}


@pytest.mark.parametrize(("engine", "user", "gpu_flags"), [
    ("docker", ["--user", f"{os.getuid()}:{os.getgid()}"], ["--gpus", "device=1"]),
    ("podman", ["--userns=keep-id"], ["--device", "nvidia.com/gpu=1"])])
def test_docker_and_podman_argv_binds_and_env(tmp_path, engine, user, gpu_flags):
    manifest = _container(tmp_path, engine)
    argv, env = wrap(manifest, ["/opt/py/bin/python", "w.py"],
                     {"B": "2", "A": "1", "GONE": None, "CUDA_VISIBLE_DEVICES": "1"}, BINDS, name="rp-x", device="1")
    assert argv == [engine, "run", "--rm", "--init", "--name", "rp-x", "--network", "none", "--cap-drop", "ALL",
                    "--security-opt", "no-new-privileges", *user,
                    "--volume", "/w:/w:ro", "--volume", "/state:/state",
                    "--volume", f"{tmp_path}/scratch:/scratch", "--volume", f"{tmp_path}/ref:/ref:ro",
                    "--env", "A", "--env", "B", *gpu_flags, "reg/boltz:2", "/opt/py/bin/python", "w.py"]
    assert env["A"] == "1" and env["B"] == "2" and "GONE" not in env


@pytest.mark.parametrize(("engine", "device", "gpu_flags"), [
    ("docker", None, ["--gpus", "device=all"]), ("docker", "0,1", ["--gpus", '"device=0,1"']),
    ("podman", "0,1", ["--device", "nvidia.com/gpu=0", "--device", "nvidia.com/gpu=1"])])
def test_gpu_flags_for_no_admitted_device_and_for_several(tmp_path, engine, device, gpu_flags):
    argv, _ = wrap(_container(tmp_path, engine), ["python"], {}, [], name="n", device=device)
    start = argv.index(gpu_flags[0])
    assert argv[start:start + len(gpu_flags)] == gpu_flags


def test_a_cpu_container_gets_no_gpu_flags(tmp_path):
    manifest = _container(tmp_path, "docker", gpu=False)
    argv, _ = wrap(manifest, ["python"], {}, [], name="n", device="0")
    assert "--gpus" not in argv


def test_venv_auto_is_the_pools_interpreter_and_a_missing_one_is_named(tmp_path):
    assert interpreter(load_manifest(write_provider(tmp_path, "auto", ""))) == sys.executable
    missing = load_manifest(write_provider(tmp_path, "missing", '[env]\npython = "/nowhere/bin/python"\n'))
    with pytest.raises(WorkerStartError, match="/nowhere/bin/python does not exist") as info:
        interpreter(missing)
    assert info.value.reason == "interpreter_missing"


def test_an_absent_engine_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(WorkerStartError, match="engine podman is not on PATH"):
        interpreter(_container(tmp_path, "podman"))


@pytest.mark.usefixtures("isolated_dirs")  # the plan reads where the pool's own folders are, to keep them out
def test_binds_are_the_run_folder_work_weights_manifest_and_three_files(tmp_path, monkeypatch):
    """Build a docker launch for real (a stand-in engine on PATH) and read its binds: nothing else is mounted."""
    engine = tmp_path / "bin" / "docker"
    engine.parent.mkdir()
    engine.write_text("#!/bin/sh\nexit 0\n")
    engine.chmod(engine.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{engine.parent}:{os.environ['PATH']}")
    weights = tmp_path / "weights"
    weights.mkdir()
    work = tmp_path / "work"
    body = (f'work_root = "{work}"\n[env]\nkind = "container"\nengine = "docker"\nimage = "img"\n'
            f'[weights]\nroot = "{weights}"\n')
    manifest = load_manifest(write_provider(tmp_path / "manifests", "bound", body))  # beside work, not holding it
    run_dir = tmp_path / "w" / "bound-0-1"
    run_dir.mkdir(parents=True)
    heartbeat = tmp_path / "beats" / "heartbeat"
    argv, env = plan_launch(manifest, str(run_dir / "worker.sock"), name="rp-bound",
                            heartbeat=str(heartbeat), **as_the_pool()).command()
    volumes = [argv[i + 1] for i, item in enumerate(argv) if item == "--volume"]
    package = Path(resident_pool.__file__).parent
    assert volumes == [f"{run_dir}:{run_dir}", f"{work}:{work}", f"{manifest.directory}:{manifest.directory}:ro",
                       f"{package / 'protocol.py'}:{package / 'protocol.py'}:ro",
                       f"{package / 'arrays.py'}:{package / 'arrays.py'}:ro",
                       f"{package / 'worker_base.py'}:{package / 'worker_base.py'}:ro",
                       f"{weights}:{weights}:ro", f"{heartbeat.parent}:{heartbeat.parent}"]
    assert argv[argv.index("--workdir") + 1] == str(work)  # it runs in its work root inside, too
    passed = {argv[i + 1] for i, item in enumerate(argv) if item == "--env"}
    assert {"RESIDENT_POOL_PROTOCOL", "RESIDENT_POOL_WORKER_BASE", "RESIDENT_POOL_HEARTBEAT",
            "TOOLUNIVERSE_REMOTE_PROTOCOL", "TOOLUNIVERSE_REMOTE_WORKER_BASE"} <= passed
    assert env["RESIDENT_POOL_HEARTBEAT"] == str(heartbeat)


@pytest.mark.parametrize(("body", "field"), [
    ('image = "--privileged"\n', "env.image"),
    ('image = "img"\npython = "-c"\n', "env.python"),
    ('image = "img"\nbinds = ["/a,b:/c"]\n', "env.binds"),
    ('image = "img"\nbinds = ["/a:/b:/c"]\n', "env.binds"),
    ('image = "img"\npassthrough = ["HOME=/tmp/evil"]\n', "env.passthrough"),
])
def test_option_like_images_and_unbindable_paths_are_refused_naming_the_field(tmp_path, body, field):
    with pytest.raises(ManifestError) as info:
        load_manifest(write_provider(tmp_path, "hostile", '[env]\nkind = "container"\nengine = "docker"\n' + body))
    assert info.value.details["field"] == field


@pytest.mark.usefixtures("isolated_dirs")
def test_a_work_root_with_a_colon_is_refused_before_the_engine_reads_it(tmp_path, monkeypatch):
    engine = tmp_path / "bin" / "podman"
    engine.parent.mkdir()
    engine.write_text("#!/bin/sh\nexit 0\n")
    engine.chmod(0o755)
    monkeypatch.setenv("PATH", f"{engine.parent}:{os.environ['PATH']}")
    body = f'work_root = "{tmp_path}/a:b"\n[env]\nkind = "container"\nengine = "podman"\nimage = "img"\n'
    manifest = load_manifest(write_provider(tmp_path / "manifests", "colon", body))
    with pytest.raises(ManifestError, match=r"work_root: the path .*a:b holds") as info:
        plan_launch(manifest, str(tmp_path / "worker.sock"), **as_the_pool()).command()
    assert info.value.details["field"] == "work_root"


def test_engine_controls_by_engine(tmp_path):
    assert engine_controls(_container(tmp_path, "docker"), "rp-1") == (["docker", "stop", "rp-1"],
                                                                         ["docker", "kill", "rp-1"])
    assert engine_controls(_container(tmp_path, "apptainer"), "rp-1") is None
    assert engine_controls(load_manifest(write_provider(tmp_path, "venv", "")), "rp-1") is None


def test_passthrough_keeps_only_what_is_allowed():
    removed = passthrough_env(["KEEP"], {"KEEP": "1", "SECRET": "x", "PATH": "/bin", "RESIDENT_POOL_X": "1"})
    assert removed == {"SECRET": None}
    assert passthrough_env(None, {"SECRET": "x"}) == {"SECRET": None}  # no list: the fixed base only (issue 13)
    assert passthrough_env("*", {"SECRET": "x"}) == {}


def test_the_pools_thread_limits_reach_a_venv_worker_without_a_passthrough():
    """A pool started under a CPU limit (OMP_NUM_THREADS=4 in a batch job) keeps its workers within it: torch would
    otherwise start a thread per core of the host."""
    limits = {"OMP_NUM_THREADS": "4", "MKL_NUM_THREADS": "4", "OPENBLAS_NUM_THREADS": "4", "SECRET": "x"}
    assert passthrough_env(None, limits) == {"SECRET": None}


def test_a_passthrough_list_keeps_orchestrator_secrets_out_of_the_real_worker(tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "hunter2")
    monkeypatch.setenv("ALLOWED_KNOB", "on")
    manifest = load_manifest(write_provider(tmp_path, "private", '[env]\npassthrough = ["ALLOWED_KNOB"]\n'))
    worker = worker_for(manifest, config=configured()[0])
    try:
        env = worker.predict({"action": "env"})["env"]
    finally:
        worker.close()
    assert "AWS_SECRET_ACCESS_KEY" not in env
    assert env["ALLOWED_KNOB"] == "on"
