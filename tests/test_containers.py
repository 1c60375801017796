"""Container workers started for real, through stand-in engines that execute the built command.

The stand-ins (tests/engines/standin.py, installed as ``docker``, ``podman`` and
``apptainer`` first on PATH) give the process only the variables the engine
would pass, show it only the mounted folders (a mount namespace and a chroot
where the test runs as root, else path checks), refuse a name in use, and let
``stop``/``kill NAME`` reach the container.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from engines import standin
from helpers import as_the_pool, configured, wait_until
from providers import make_kit_venv, write_provider

from resident_pool import KitUnavailable, ResidentPoolError, ResidentWorker, WorkerStartError
from resident_pool.host.procs import pid_alive
from resident_pool.providers.launch import plan_launch, worker_for
from resident_pool.providers.manifest import load_manifest

ROOT = Path(__file__).resolve().parents[1]
ENGINES = ["docker", "podman", "apptainer"]
# The interpreter inside the stand-in image: the host's system Python, standard library only.
IMAGE_PYTHON = "/usr/bin/python3"


def _image_env(engine: str, extra: str = "") -> str:
    return (f'[env]\nkind = "container"\nengine = "{engine}"\nimage = "standin/py:3"\n'
            f'python = "{IMAGE_PYTHON}"\n{extra}')


def echo_provider(tmp_path: Path, engine: str) -> Path:
    """The shipped echo provider, its manifest given a container environment."""
    folder = tmp_path / "manifests" / "echo"
    shutil.copytree(ROOT / "manifests" / "echo", folder)
    manifest = folder / "manifest.toml"
    manifest.write_text(manifest.read_text() + "\n" + _image_env(engine))
    return manifest


def inside_provider(tmp_path: Path, engine: str, body: str = "") -> Path:
    return write_provider(tmp_path / "manifests", f"inside-{engine}", body + _image_env(engine), worker="inside.py")


def container_pid(state: Path, name: str) -> int:
    return json.loads((state / "containers" / name).read_text())["pid"]


class OneDevice:
    """An admitter that places every worker on device 1, as admission does on a two-GPU host."""

    def admit(self, worker):
        return {"CUDA_VISIBLE_DEVICES": "1"}

    def release(self, worker):
        pass


ISOLATION = pytest.mark.parametrize("engines", [True, False], indirect=True, ids=["namespace", "path-checks"])


@ISOLATION
@pytest.mark.parametrize("engine", ENGINES)
def test_the_echo_provider_starts_answers_and_stops_through_each_engine(tmp_path, engines, engine):
    manifest = load_manifest(echo_provider(tmp_path, engine))
    worker = worker_for(manifest, config=configured()[0])
    try:
        reply = worker.predict({"ping": "hello"})
        assert reply["echo"] == {"ping": "hello"}
        inner = reply["pid"]
        assert pid_alive(inner)
        assert worker.stop() is not None
    finally:
        worker.close()
    wait_until(lambda: not pid_alive(inner), timeout=10, message="the container's process to end")
    wait_until(lambda: not list(engines.glob("containers/*")), timeout=10, message="the container to be removed")


@pytest.mark.parametrize("engine", ENGINES)
def test_only_named_variables_and_mounted_folders_reach_the_container(tmp_path, engines, engine, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "hunter2")
    monkeypatch.setenv("APPTAINERENV_LEFTOVER", "from the pool's own environment")
    weights = tmp_path / "weights"
    weights.mkdir()
    work = tmp_path / "work" / "inside"
    private = tmp_path / "private"
    private.mkdir()
    manifest = load_manifest(inside_provider(
        tmp_path, engine, f'work_root = "{work}"\n[weights]\nroot_env = "INSIDE_WEIGHTS"\nroot = "{weights}"\n'))
    worker = worker_for(manifest, config=configured()[0])
    try:
        env = worker.predict({"action": "env"})["env"]
        seen = worker.predict({"action": "exists", "paths": [str(private), str(weights), str(work),
                                                             str(ROOT / "resident_pool" / "pool.py"),
                                                             os.environ["RESIDENT_POOL_LOG_DIR"]]})
        writable = worker.predict({"action": "writable", "paths": [str(work), str(manifest.directory)]})
    finally:
        worker.close()
    assert os.path.isfile(env["RESIDENT_POOL_WORKER_BASE"]) and os.path.isfile(env["RESIDENT_POOL_PROTOCOL"])
    # The original design's names for the same two files reach inside too.
    assert env["TOOLUNIVERSE_REMOTE_WORKER_BASE"] == env["RESIDENT_POOL_WORKER_BASE"]
    assert env["TOOLUNIVERSE_REMOTE_PROTOCOL"] == env["RESIDENT_POOL_PROTOCOL"]
    assert env["INSIDE_WEIGHTS"] == str(weights)
    assert "AWS_SECRET_ACCESS_KEY" not in env and "LEFTOVER" not in env
    assert env["PATH"] == standin.IMAGE_PATH  # the image's, not the pool's
    if not standin.can_isolate():
        # The start itself passed the stand-in's path checks: every path in the command and the
        # variables lies in a mount. What the process could open at run time is not checked.
        print("no mount namespace here: the folders the worker can open are not checked, only its command")
        return
    assert seen == {str(private): False, str(weights): True, str(work): True,
                    str(ROOT / "resident_pool" / "pool.py"): False, os.environ["RESIDENT_POOL_LOG_DIR"]: False}
    assert writable == {str(work): True, str(manifest.directory): False}


@pytest.mark.parametrize("engine", ENGINES)
def test_the_admitted_device_reaches_the_container(tmp_path, engines, engine):
    manifest = load_manifest(inside_provider(tmp_path, engine, '[gpu]\npolicy = "required"\nvram_budget_gb = 10\n'))
    worker = worker_for(manifest, admitter=OneDevice(), config=configured()[0])
    try:
        env = worker.predict({"action": "env"})["env"]
    finally:
        worker.close()
    if engine == "apptainer":  # --nv shows every GPU; the admitted one is chosen inside
        assert env["CUDA_VISIBLE_DEVICES"] == "1"
    else:  # --gpus device=1 / CDI nvidia.com/gpu=1: the one GPU the container sees is its device 0
        assert env["NVIDIA_VISIBLE_DEVICES"] == "1"
        assert "CUDA_VISIBLE_DEVICES" not in env


def _named_worker(manifest, name, **kwargs):
    def build(worker):
        return plan_launch(manifest, worker.socket_path, name=name, device=worker.device, **as_the_pool()).command()

    return ResidentWorker(manifest.slug, build, start_timeout_s=30, manifest=manifest, **kwargs)


@pytest.mark.parametrize("engine", ["docker", "podman"])
def test_names_are_unique_per_start_and_a_name_in_use_is_refused(tmp_path, engines, engine):
    manifest = load_manifest(echo_provider(tmp_path, engine))
    worker = worker_for(manifest, config=configured()[0])
    try:
        first = worker.predict({})["pid"]
        worker.stop()
        second = worker.predict({})["pid"]
        assert first != second
    finally:
        worker.close()
    names = [json.loads(line)["name"] for line in (engines / "runs.jsonl").read_text().splitlines()]
    assert len(names) == len(set(names)) == 2

    holder = _named_worker(manifest, "resident-pool-echo-fixed", replica=0)
    clash = _named_worker(manifest, "resident-pool-echo-fixed", replica=1)
    try:
        holder.predict({})
        with pytest.raises(WorkerStartError, match="already in use"):
            clash.predict({})
    finally:
        holder.close()
        clash.close()


@pytest.mark.parametrize("engine", ["docker", "podman"])
def test_a_sigkill_escalation_reaches_the_container_through_the_engine(tmp_path, engines, engine):
    from resident_pool.providers.exec_env import engine_controls

    plain = load_manifest(inside_provider(tmp_path, engine))
    manifest = plain.model_copy(update={"worker_args": ["{socket}", "--ignore-term"]})
    name = "resident-pool-ignores-term"
    stop_argv, kill_argv = engine_controls(manifest, name)
    assert stop_argv == [engine, "stop", name] and kill_argv == [engine, "kill", name]
    worker = _named_worker(manifest, name)
    try:
        inner = worker.predict({})["pid"]
        assert container_pid(engines, name) == inner
        # What a SIGKILL of the engine client alone does: the container keeps running (and its GPU).
        os.killpg(worker.pid, signal.SIGKILL)
        wait_until(lambda: not pid_alive(worker.pid), timeout=10, message="the client to die")
        assert pid_alive(inner)
        # The escalation through the engine reaches the container itself.
        subprocess.run(kill_argv, check=True, capture_output=True, timeout=30)
        wait_until(lambda: not pid_alive(inner), timeout=10, message="the container to be killed")
    finally:
        worker.close()

    again = _named_worker(plain, name)  # the name is free again; `stop` asks first (SIGTERM), then kills
    try:
        inner = again.predict({})["pid"]
        done = subprocess.run(stop_argv, check=True, capture_output=True, text=True, timeout=60)
        assert done.stdout.strip() == name
        assert not pid_alive(inner)
    finally:
        again.close()


@pytest.mark.parametrize("engine", ["docker", "podman"])
def test_stopping_a_container_worker_that_ignores_sigterm_ends_the_container_not_just_its_client(
        tmp_path, engines, engine):
    manifest = load_manifest(inside_provider(tmp_path, engine))
    worker = worker_for(manifest.model_copy(update={"worker_args": ["{socket}", "--ignore-term"]}), config=configured()[0])
    busy = threading.Thread(target=lambda: _ignore_errors(worker.request, {"action": "sleep", "seconds": 120}))
    try:
        inner = worker.predict({})["pid"]
        assert inner != worker.pid  # the engine's client is not the container
        busy.start()  # busy: it cannot answer a polite shutdown, so the stop must escalate
        wait_until(lambda: worker.state.value == "busy", message="the request to be in flight")
        worker.stop(grace_s=1.0)
        wait_until(lambda: not pid_alive(inner), timeout=30, message="the container itself to end")
    finally:
        worker.close()
        busy.join(timeout=30)


def _ignore_errors(call, *args):
    try:
        call(*args)
    except ResidentPoolError:
        pass  # the request is cut off by the stop on purpose


def test_apptainer_needs_no_engine_controls_the_process_group_reaches_it(tmp_path, engines):
    from resident_pool.providers.exec_env import engine_controls

    manifest = load_manifest(inside_provider(tmp_path, "apptainer"))
    assert engine_controls(manifest, "any") is None
    manifest = manifest.model_copy(update={"worker_args": ["{socket}", "--ignore-term"]})
    worker = worker_for(manifest, config=configured()[0])
    try:
        inner = worker.predict({})["pid"]
        assert inner == worker.pid  # apptainer exec is the container process
        os.killpg(worker.pid, signal.SIGKILL)
        wait_until(lambda: not pid_alive(inner), timeout=10, message="the container to die with its group")
    finally:
        worker.close()


def test_without_a_namespace_the_stand_in_refuses_a_path_outside_the_mounts(tmp_path, monkeypatch):
    state = tmp_path / "engine"
    standin.install(tmp_path / "bin", state, isolate=False)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    outside = tmp_path / "outside.py"
    outside.write_text("print('ran')\n")
    refused = subprocess.run(["docker", "run", "--rm", "img", IMAGE_PYTHON, str(outside)],
                             capture_output=True, text=True, timeout=30, check=False)
    assert refused.returncode == 127 and "not visible inside the container" in refused.stderr
    mounted = subprocess.run(["docker", "run", "--rm", "--volume", f"{tmp_path}:{tmp_path}:ro", "img",
                              IMAGE_PYTHON, str(outside)], capture_output=True, text=True, timeout=30, check=False)
    assert mounted.returncode == 0 and mounted.stdout.strip() == "ran"


def kit_in_image(tmp_path, engine):
    """A toykit provider whose stand-in image holds the model's venv (with the kit's checkout) and its base
    interpreter, each mounted where it lives."""
    python = make_kit_venv(tmp_path / "image" / "venv", "toykit_opt")
    binds = ", ".join(f'"{folder}:{folder}:ro"' for folder in (python.parents[1], Path(sys.base_prefix)))
    body = (f'[env]\nkind = "container"\nengine = "{engine}"\nimage = "standin/toy:1"\npython = "{python}"\n'
            f'binds = [{binds}]\n[kit]\nname = "toykit"\nmode = "fast"\n')
    return load_manifest(write_provider(tmp_path / "manifests", "toyc", body, worker="toyworker.py")), python


@pytest.mark.parametrize("engine", ["docker", "apptainer"])
def test_the_probe_runs_before_the_run_folder_exists_and_the_worker_gets_its_heartbeat(tmp_path, engines, engine,
                                                                                        monkeypatch):
    """A process handle makes the run folder when it starts, after the command (and the probe) is built."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    manifest, python = kit_in_image(tmp_path, engine)
    run_dir = tmp_path / "w" / "toyc-0-1a2b3c"
    plan = plan_launch(manifest, str(run_dir / "worker.sock"), heartbeat=str(run_dir / "heartbeat"), **as_the_pool())
    assert not run_dir.exists()
    assert plan.row.model_opt == str(python.parents[1] / "toykit_opt-checkout")
    argv, env = plan.command()
    assert f"{run_dir}:{run_dir}" in argv
    if engine == "docker":
        assert "RESIDENT_POOL_HEARTBEAT" in argv[argv.index("--env"):] and env["RESIDENT_POOL_HEARTBEAT"]
    else:
        assert env["APPTAINERENV_RESIDENT_POOL_HEARTBEAT"] == str(run_dir / "heartbeat")


@ISOLATION
@pytest.mark.parametrize("engine", ["docker", "apptainer"])
def test_a_kit_worker_in_a_container_is_probed_and_started_from_one_plan(tmp_path, engines, engine, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("MODEL_OPT", raising=False)
    monkeypatch.delenv("MODEL_OPT_JIT_ROOT", raising=False)
    monkeypatch.setenv("TOYKIT_OPT_LEFTOVER", "a stray in the pool's environment")
    manifest, python = kit_in_image(tmp_path, engine)
    worker = worker_for(manifest, config=configured()[0])
    try:
        assert worker.predict({"x": 4}) == {"value": 8}
        pong = worker.ping()
    finally:
        worker.close()
    assert pong["patched"] == "toykit_opt:fast"
    env = pong["env"]
    assert env["MODEL_OPT"] == str(python.parents[1] / "toykit_opt-checkout")
    assert env["MODEL_OPT_JIT_ROOT"] == str(tmp_path / "cache" / "resident-pool" / "jit" / "toyc" / "toykit-1.0-cpu-py311")
    runs = [json.loads(line)["argv"] for line in (engines / "runs.jsonl").read_text().splitlines()]
    probe, start = runs  # the probe ran inside the container too, with the worker's variables and binds
    def valued(argv, *flags):
        return {argv[i + 1] for i, arg in enumerate(argv[:-1]) if arg in flags}

    probe_file = next(arg for arg in probe if arg.endswith("kit_probe.py"))
    run_dir = os.path.dirname(worker.socket_path)  # the probe serves no socket
    assert valued(probe, "--volume", "--bind") == (valued(start, "--volume", "--bind") - {f"{run_dir}:{run_dir}"}
                                                   | {f"{probe_file}:{probe_file}:ro"})
    assert valued(probe, "--env") <= valued(start, "--env")  # the worker adds the row and the mode variable


def test_a_probe_the_engine_cannot_run_says_so_rather_than_asking_for_the_kit(tmp_path, engines, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    manifest, _ = kit_in_image(tmp_path, "docker")
    manifest = manifest.model_copy(update={"env": manifest.env.model_copy(update={"python": "/opt/absent/python"})})
    with pytest.raises(KitUnavailable, match=r"docker could not run the probe of kit toykit_opt in its container "
                                             r"\(exit 126\); check \[env\] image, python and binds") as info:
        plan_launch(manifest, str(tmp_path / "worker.sock"), **as_the_pool()).command()
    assert "is it installed" not in str(info.value)
