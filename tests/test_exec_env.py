"""Container and venv commands. No container engine runs here: argv and binds are checked exactly."""

from __future__ import annotations

import os
import stat
import sys

import pytest
from providers import write_provider

from resident_pool import WorkerStartError
from resident_pool.exec_env import interpreter, passthrough_env, wrap
from resident_pool.launch import worker_for
from resident_pool.manifest import load_manifest

BINDS = [("/w", "/w", True), ("/state", "/state", False)]


def _container(tmp_path, engine, gpu=True):
    body = (f'[env]\nkind = "container"\nengine = "{engine}"\nimage = "reg/boltz:2"\npython = "/opt/py/bin/python"\n'
            'binds = ["/scratch:/scratch", "/ref:/ref:ro"]\n')
    if gpu:
        body += '[gpu]\npolicy = "required"\nvram_budget_gb = 10\n'
    return load_manifest(write_provider(tmp_path, engine, body))


def test_apptainer_argv_binds_and_env(tmp_path):
    manifest = _container(tmp_path, "apptainer")
    argv, env = wrap(manifest, ["/opt/py/bin/python", "w.py", "s"], {"A": "1", "GONE": None}, BINDS, name="n")
    assert argv == ["apptainer", "exec", "--cleanenv", "--nv", "--bind", "/w:/w:ro", "--bind", "/state:/state",
                    "--bind", "/scratch:/scratch", "--bind", "/ref:/ref:ro", "reg/boltz:2",
                    "/opt/py/bin/python", "w.py", "s"]
    assert env == {"APPTAINERENV_A": "1"}


@pytest.mark.parametrize(("engine", "gpu_flags"), [("docker", ["--gpus", "device=1"]),
                                                   ("podman", ["--device", "nvidia.com/gpu=1"])])
def test_docker_and_podman_argv_binds_and_env(tmp_path, engine, gpu_flags):
    manifest = _container(tmp_path, engine)
    argv, env = wrap(manifest, ["/opt/py/bin/python", "w.py"], {"B": "2", "A": "1", "GONE": None}, BINDS,
                     name="rp-x", device="1")
    assert argv == [engine, "run", "--rm", "--init", "--name", "rp-x", "--network", "none",
                    "--user", f"{os.getuid()}:{os.getgid()}",
                    "--volume", "/w:/w:ro", "--volume", "/state:/state",
                    "--volume", "/scratch:/scratch", "--volume", "/ref:/ref:ro",
                    "--env", "A", "--env", "B", *gpu_flags, "reg/boltz:2", "/opt/py/bin/python", "w.py"]
    assert env["A"] == "1" and env["B"] == "2"


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


def test_binds_cover_weights_state_work_and_manifest(tmp_path, monkeypatch):
    """Build a docker launch for real (a stand-in engine on PATH) and read its binds."""
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
    manifest = load_manifest(write_provider(tmp_path, "bound", body))
    worker = worker_for(manifest)
    argv, _ = worker.build_command(worker)
    volumes = [argv[i + 1] for i, item in enumerate(argv) if item == "--volume"]
    assert f"{weights}:{weights}:ro" in volumes
    assert f"{work}:{work}" in volumes
    state = os.path.dirname(worker.socket_path)
    assert f"{state}:{state}" in volumes
    assert f"{manifest.directory}:{manifest.directory}:ro" in volumes


def test_passthrough_keeps_only_what_is_allowed():
    removed = passthrough_env(["KEEP"], {"KEEP": "1", "SECRET": "x", "PATH": "/bin", "RESIDENT_POOL_X": "1"})
    assert removed == {"SECRET": None}
    assert passthrough_env(None, {"SECRET": "x"}) == {}


def test_a_passthrough_list_keeps_orchestrator_secrets_out_of_the_real_worker(tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "hunter2")
    monkeypatch.setenv("ALLOWED_KNOB", "on")
    manifest = load_manifest(write_provider(tmp_path, "private", '[env]\npassthrough = ["ALLOWED_KNOB"]\n'))
    worker = worker_for(manifest)
    try:
        env = worker.request({"action": "env"})["env"]
    finally:
        worker.close()
    assert "AWS_SECRET_ACCESS_KEY" not in env
    assert env["ALLOWED_KNOB"] == "on"
