"""check and validate as a CI maintainer of many kit-accelerated models relies on them.

Each test is a finding of an outside review of issues 14 and 17, seen failing before its fix.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from helpers import as_the_pool, configured, wait_until
from providers import make_kit_venv, write_provider

from resident_pool.providers.manifest import load_manifest
from resident_pool.validation.golden import EXACT, Tolerance, compare

ROOT = Path(__file__).resolve().parents[1]


def run_check(*args, env=None, timeout=300):
    return subprocess.run([sys.executable, "-m", "resident_pool", "check", *args], cwd=ROOT, capture_output=True,
                          text=True, env={**os.environ, "COLUMNS": "400", **(env or {})}, timeout=timeout,
                          check=False)


# -- 17: tolerances and comparison ------------------------------------------------------------------------


def test_a_tolerance_of_infinity_is_refused(tmp_path):
    """`atol = inf` is valid TOML; with it every finite answer matches the golden file."""
    path = write_provider(tmp_path, "loose", '[smoke]\npayload = { x = 1 }\nexpected = "smoke/e.json"\natol = inf\n')
    try:
        manifest = load_manifest(path)
    except Exception:
        return
    tol = Tolerance(manifest.smoke.atol, manifest.smoke.rtol)
    assert compare({"value": 42.0}, {"value": -1e300}, tol) != [], "atol = inf admits any answer"


def test_an_ignore_pattern_that_matches_every_field_is_refused_in_any_spelling(tmp_path):
    """The manifest refuses ignore = ["*"] ("matches every field"); "?*" matches every field just the same."""
    path = write_provider(tmp_path, "blind", '[smoke]\npayload = { x = 1 }\nignore = ["?*"]\n')
    try:
        manifest = load_manifest(path)
    except Exception:
        return
    tol = Tolerance(ignore=tuple(manifest.smoke.ignore))
    assert compare({"embedding": [0.1, 0.2], "label": "cat"}, {"embedding": [9.0, 9.0], "label": "dog"}, tol), \
        "ignore = ['?*'] passed the validator and silently compares nothing"


def test_exact_integers_are_compared_exactly():
    """A 64-bit id/checksum/seed field differing by one passes an exact comparison (compared as float)."""
    assert compare({"checksum": 2**53 + 1}, {"checksum": 2**53}, EXACT), "2**53+1 == 2**53 under EXACT"


def test_a_huge_integer_is_a_mismatch_not_a_crash():
    """compare() must never raise (README: a failure names the field); float(10**400) raises OverflowError,
    which check's step runner does not catch, so the whole check (and its JUnit file) is lost."""
    try:
        found = compare({"n": 10**400}, {"n": 1}, Tolerance(1e-5, 1e-4))
    except OverflowError as exc:
        pytest.fail(f"compare raised {exc!r}")
    assert found


# -- 17: JUnit shape -------------------------------------------------------------------------------------


def test_junit_with_a_kit_line_holding_a_control_character_still_parses():
    """A kit that colours its ACTIVE line (or a worker whose traceback is coloured) puts ESC into
    kit.active / the failure text; the JUnit file must still be XML a consumer can read."""
    from resident_pool.validation.check import StepResult, junit_xml

    provenance = {"manifest.fingerprint": "0123456789abcdef",
                  "kit.active": "toykit_opt: ACTIVE (\x1b[1mfused\x1b[0m attention)"}
    results = [StepResult("toy", "smoke", True, "ok", provenance=provenance),
               StepResult("toy", "against-stock", False, "toy: worker died:\n  \x1b[31mTraceback\x1b[0m ...",
                          provenance=provenance)]
    text = junit_xml(results)
    try:
        ET.fromstring(text.encode())
    except ET.ParseError as exc:
        pytest.fail(f"the JUnit file is not well-formed XML: {exc}")


# -- 17: bless writes a file check can read ----------------------------------------------------------------


def test_bless_refuses_an_answer_check_could_not_read_back(tmp_path):
    """Over the 64 MiB check reads, or holding NaN (not JSON, and a NaN golden would match NaN forever):
    bless says so and writes nothing, rather than a file the next check refuses."""
    from resident_pool.errors import GoldenMismatch
    from resident_pool.validation import expected

    path = write_provider(tmp_path, "big", '[smoke]\npayload = { x = 1 }\nexpected = "smoke/e.json"\n')
    manifest = load_manifest(path)
    with pytest.raises(GoldenMismatch, match=r"over the .* byte limit check reads"):
        expected.bless(manifest, manifest.smoke.payload, {"embedding": [0.123456789 + i * 1e-9 for i in range(4_200_000)]}, {}, force=False)
    with pytest.raises(GoldenMismatch, match="NaN or an infinity"):
        expected.bless(manifest, manifest.smoke.payload, {"score": math.nan}, {}, force=False)
    assert not (tmp_path / "big" / "smoke" / "e.json").exists()


# -- 17: the scheduled validate deployment -----------------------------------------------------------------


def test_the_scheduled_validate_deployment_compares_answers(monkeypatch):
    """The nightly `validate` deployment is the CI job that 'catches a wrong answer'; registered with no
    parameters, it runs validate(smoke=False, against_stock=False): no smoke, no golden, no stock."""
    sys.path.insert(0, str(ROOT / "flows"))
    try:
        import deploy as deploy_module
    finally:
        sys.path.pop(0)
    captured = []
    monkeypatch.setattr(deploy_module, "ensure_work_pool", lambda name: None)
    monkeypatch.setattr(deploy_module, "deploy", lambda *deployments, **kw: captured.extend(deployments) or [])
    deploy_module.deploy_all("rp", str(ROOT / "manifests"))
    (validate,) = [d for d in captured if d.name == "validate"]
    assert validate.schedules, "validate is scheduled"
    params = validate.parameters or {}
    assert params.get("smoke") is True, f"nightly validate runs with parameters {params}: smoke off"


# -- 17: provenance of the answer that was checked ---------------------------------------------------------

VERSION_WORKER = """
import importlib.util, os, sys
spec = importlib.util.spec_from_file_location("worker_base", os.environ["RESIDENT_POOL_WORKER_BASE"])
worker_base = importlib.util.module_from_spec(spec); spec.loader.exec_module(worker_base)
import toymodel
kit = sys.modules.get("toykit_opt")
seen = {"kit_version": getattr(kit, "__version__", None), "model_opt": os.environ.get("MODEL_OPT"),
        "started_pid": os.getpid()}
def on_predict(payload):
    return {"value": toymodel.predict(payload["x"]), "seen": {k: v for k, v in seen.items() if k != "started_pid"}}
worker_base.serve(slug="warm", socket_path=sys.argv[1], on_predict=on_predict)
"""


def _version_provider(root, python, extra=""):
    path = write_provider(root, "warm", f'[env]\npython = "{python}"\n[smoke]\npayload = {{ x = 21 }}\n'
                                        f'expected = "smoke/expected.json"\n[kit]\nname = "toykit"\nmode = "fast"\n'
                                        + extra, worker="toyworker.py")
    (path.parent / "worker.py").write_text(VERSION_WORKER)
    return path


def test_a_kit_upgraded_under_a_warm_worker_is_what_check_reports_and_blesses(tmp_path, isolated_dirs):
    """The nightly CI case ("installed kits drift"): the kit in the model's venv is upgraded while the pool
    holds a warm worker. check --smoke / --bless answer through that warm worker (still the old kit) while
    the kit step and the provenance name the new kit: the recorded answer and its provenance disagree."""
    python = make_kit_venv(tmp_path / "venv", "toykit_opt")
    manifests = tmp_path / "manifests"
    _version_provider(manifests, python)
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache")}
    first = run_check("--bless", "warm", "--json", "--manifests", str(manifests), env=env)
    assert first.returncode == 0, first.stdout + first.stderr
    init = tmp_path / "venv" / "toykit_opt-checkout" / "src" / "toykit_opt" / "__init__.py"
    init.write_text('__version__ = "2.0"\n')  # pip install -U toykit_opt
    again = run_check("--bless", "warm", "--force", "--json", "--manifests", str(manifests), env=env)
    assert again.returncode == 0, again.stdout + again.stderr
    recorded = json.loads((manifests / "warm" / "smoke" / "expected.json").read_text())
    answered_by = recorded["result"]["seen"]["kit_version"]
    claimed = recorded["blessed"]["provenance"]["kit.version"]
    assert answered_by == claimed, (f"the blessed answer came from kit {answered_by} (the warm worker), its "
                                    f"provenance says kit {claimed}")


def test_the_smoke_provenance_says_what_the_worker_that_answered_ran_under(tmp_path, isolated_dirs):
    """check's kit step probes in the CLI's environment; the smoke runs in the host pool, under the pool's
    environment (a client's environment never reaches a worker). When they differ (an exported MODEL_OPT),
    the smoke's provenance must be the worker's, not the CLI's."""
    from resident_pool.client import Pool

    python = make_kit_venv(tmp_path / "venv", "toykit_opt")
    manifests = tmp_path / "manifests"
    _version_provider(manifests, python)
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache")}
    os.environ.pop("MODEL_OPT", None)
    with Pool(manifests=manifests) as pool:  # the host pool is already up (a service, a flow run's client)
        pool.status()
    other_tree = tmp_path / "ci-kit-tree"
    other_tree.mkdir()
    done = run_check("--smoke", "warm", "--json", "--manifests", str(manifests),
                     env={**env, "MODEL_OPT": str(other_tree)})
    rows = {row["step"]: row for row in json.loads(done.stdout)}
    kit_detail = rows["kit"]["detail"]
    smoke = rows["smoke"]
    # no expected file yet: the smoke passes; read what the worker saw from its transcript-free answer by blessing
    assert str(other_tree) in kit_detail, kit_detail
    run_check("--bless", "warm", "--json", "--manifests", str(manifests), env={**env, "MODEL_OPT": str(other_tree)})
    recorded = json.loads((manifests / "warm" / "smoke" / "expected.json").read_text())
    seen = recorded["result"]["seen"]["model_opt"]
    assert seen != str(other_tree)  # the pool's environment, not this command's
    assert recorded["blessed"]["provenance"]["kit.model_opt"] == seen
    assert smoke["provenance"]["kit.model_opt"] == seen



# -- 17: the stock run is a variant that leaves nothing behind ---------------------------------------------

STOCK_BREAKS = """
import importlib.util, os, sys
spec = importlib.util.spec_from_file_location("worker_base", os.environ["RESIDENT_POOL_WORKER_BASE"])
worker_base = importlib.util.module_from_spec(spec); spec.loader.exec_module(worker_base)
import toymodel
def on_predict(payload):
    if os.environ.get("DRIFTKIT_OPT_MODE") == "off":
        raise RuntimeError("the stock path of this model is broken")
    return {"value": toymodel.predict(payload["x"])}
worker_base.serve(slug="gpu", socket_path=sys.argv[1], on_predict=on_predict)
"""


def test_a_failed_stock_run_does_not_leave_its_worker_holding_gpu_budget(tmp_path, isolated_dirs):
    python = make_kit_venv(tmp_path / "venv", "driftkit_opt")
    manifests = tmp_path / "manifests"
    path = write_provider(manifests, "gpu", f'[env]\npython = "{python}"\n[gpu]\npolicy = "required"\n'
                                            'vram_budget_gb = 3\n[smoke]\npayload = { x = 21 }\n'
                                            '[kit]\nname = "driftkit"\nmode = "fast"\n', worker="toyworker.py")
    (path.parent / "worker.py").write_text(STOCK_BREAKS)
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache"), "RESIDENT_POOL_GPU_CAPACITY_GB": "4",
           "RESIDENT_POOL_GPU_HEADROOM_GB": "0"}
    done = run_check("--against-stock", "gpu", "--json", "--manifests", str(manifests), env=env)
    rows = {row["step"]: row for row in json.loads(done.stdout)}
    assert not rows["against-stock"]["ok"] and "stock path of this model is broken" in rows["against-stock"]["detail"]
    ledger = json.loads((Path(isolated_dirs["state"]) / "ledger.json").read_text())
    held = [(e["slug"], e["budget_gb"]) for e in ledger]
    assert not [h for h in held if h[0].endswith("~stock")], f"after check exited the ledger holds {held}"


TORCH_WORKER = """
import importlib.metadata, importlib.util, os, sys
spec = importlib.util.spec_from_file_location("worker_base", os.environ["RESIDENT_POOL_WORKER_BASE"])
worker_base = importlib.util.module_from_spec(spec); spec.loader.exec_module(worker_base)
def version():
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None
worker_base.serve(slug="tv", socket_path=sys.argv[1], on_predict=lambda payload: {"torch": version()})
"""


def test_environment_provenance_is_read_under_the_workers_environment(tmp_path, monkeypatch):
    """env.torch must be the torch the worker imports. The environment probe runs with the pool's whole
    environment (PYTHONPATH included); the worker gets the fixed base plus passthrough, no PYTHONPATH."""
    from resident_pool.providers.launch import worker_for
    from resident_pool.validation.provenance import environment

    python = make_kit_venv(tmp_path / "venv")
    fake = tmp_path / "site"
    (fake / "torch").mkdir(parents=True)
    (fake / "torch" / "__init__.py").write_text("")
    (fake / "torch" / "version.py").write_text("__version__ = '9.9.9+cu999'\ncuda = '99.9'\nhip = None\n")
    (fake / "torch-9.9.9.dist-info").mkdir()
    (fake / "torch-9.9.9.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 9.9.9\n")
    path = write_provider(tmp_path / "m", "tv", f'[env]\npython = "{python}"\n')
    (path.parent / "worker.py").write_text(TORCH_WORKER)
    manifest = load_manifest(path)
    monkeypatch.setenv("PYTHONPATH", str(fake))  # e.g. a CI job or a module system exports one
    reported = environment(manifest, str(python))
    worker = worker_for(manifest, config=configured()[0])
    try:
        seen = worker.predict({})["torch"]
    finally:
        worker.close()
    assert reported["env.torch"] == (seen or "not installed"), (
        f"provenance says torch {reported['env.torch']} ({reported['env.cuda_runtime']}); the worker has {seen}")


# -- 14: containers ----------------------------------------------------------------------------------------

IMAGE_PYTHON = "/usr/bin/python3"


def _inside(tmp_path, engine, extra=""):
    body = (f'[env]\nkind = "container"\nengine = "{engine}"\nimage = "standin/py:3"\npython = "{IMAGE_PYTHON}"\n'
            + extra)
    return write_provider(tmp_path / "manifests", f"in{engine}", body, worker="inside.py")


def _live_containers(state):
    from resident_pool.host.procs import pid_alive

    found = {}
    for entry in (state / "containers").glob("*") if (state / "containers").exists() else []:
        held = json.loads(entry.read_text() or "{}")
        if held.get("pid") and pid_alive(held["pid"]):
            found[entry.name] = held["pid"]
    return found


@pytest.mark.parametrize("engine", ["docker", "podman"])
def test_a_recommended_gpu_provider_run_on_the_cpu_asks_the_engine_for_no_gpu(tmp_path, engines, engine,
                                                                              isolated_dirs, monkeypatch):
    """policy = "recommended" on a host with no GPU runs on the CPU (admission gives CUDA_VISIBLE_DEVICES="").
    The container must then not ask for GPUs: on a CPU host `docker run --gpus ...` fails outright."""
    from resident_pool.client import Pool

    monkeypatch.delenv("RESIDENT_POOL_GPU_CAPACITY_GB", raising=False)
    monkeypatch.delenv("RESIDENT_POOL_FAKE_NVML", raising=False)
    path = _inside(tmp_path, engine, '[gpu]\npolicy = "recommended"\nvram_budget_gb = 2\n')
    with Pool(manifests=path.parents[1]) as pool:
        seen = pool.predict(path.parent.name, {"action": "env"})["env"]
        pool.stop(path.parent.name, now=True)
    argv = [json.loads(line)["argv"] for line in (engines / "runs.jsonl").read_text().splitlines()][-1]
    gpu_flags = [a for i, a in enumerate(argv) if a in ("--gpus", "--device") or (i and argv[i - 1] in ("--gpus",
                                                                                                       "--device"))]
    assert not gpu_flags, f"the CPU placement became {gpu_flags}; inside NVIDIA_VISIBLE_DEVICES=" \
                          f"{seen.get('NVIDIA_VISIBLE_DEVICES')}"


def test_the_environment_probe_in_a_container_is_ended_through_the_engine_when_it_times_out(tmp_path, engines,
                                                                                           monkeypatch):
    """A timed-out `docker run` client dies alone; its container keeps running (the kit probe handles this with
    `docker kill NAME`, the provenance probe does not)."""
    from resident_pool.validation import provenance

    hang = tmp_path / "img"
    hang.mkdir()
    script = hang / "python"
    script.write_text("#!/bin/sh\nexec sleep 120\n")
    script.chmod(0o755)
    path = write_provider(tmp_path / "manifests", "hangs", f'[env]\nkind = "container"\nengine = "docker"\n'
                                                          f'image = "standin/py:3"\npython = "{script}"\n'
                                                          f'binds = ["{hang}:{hang}:ro"]\n', worker="inside.py")
    monkeypatch.setattr(provenance, "PROBE_TIMEOUT_S", 3.0)
    row = provenance.environment(load_manifest(path), str(script))
    assert "env.error" in row
    left = wait_until(lambda: True) and _live_containers(engines)
    for pid in left.values():
        os.kill(pid, 9)
    assert not left, f"the environment probe's container was left running: {left}"


def test_a_dead_pool_leaves_no_container_holding_the_gpu(tmp_path, engines, isolated_dirs, monkeypatch):
    """The orphan watchdog inside a container: the pool is SIGKILLed; the heartbeat goes stale; the container
    (not only its engine client) must exit."""
    import signal

    from resident_pool.client import Pool
    from resident_pool.host.procs import pid_alive

    monkeypatch.setenv("RESIDENT_POOL_HEARTBEAT_STALE_S", "2")
    monkeypatch.setenv("RESIDENT_POOL_GPU_CAPACITY_GB", "4")
    path = _inside(tmp_path, "docker", '[gpu]\npolicy = "required"\nvram_budget_gb = 2\n'
                                       '[lifecycle]\norphan_grace_s = 1\n')
    with Pool(manifests=path.parents[1]) as pool:
        inner = pool.predict(path.parent.name, {"action": "env"})["pid"]
        pool_pid = pool.status()["pool"]["pid"]
    os.kill(pool_pid, signal.SIGKILL)
    wait_until(lambda: not pid_alive(pool_pid), timeout=10, message="the pool to die")
    try:
        wait_until(lambda: not pid_alive(inner), timeout=30, message="the orphaned container to exit")
    finally:
        for pid in _live_containers(engines).values():
            os.kill(pid, 9)
    wait_until(lambda: not _live_containers(engines), timeout=10, message="no container")


# -- 14: check means "it can start" ------------------------------------------------------------------------


def test_check_fails_a_provider_whose_budget_no_device_holds(tmp_path, isolated_dirs):
    """README: "`resident-pool check` applies the same rules, so a provider it passes can start". Every start of a
    10 GB provider on a 1 GB host is refused with AdmissionRefused; plain check is the CI's cheap gate."""
    write_provider(tmp_path / "m", "big", '[gpu]\npolicy = "required"\nvram_budget_gb = 10\n')
    done = run_check("big", "--json", "--manifests", str(tmp_path / "m"),
                     env={"RESIDENT_POOL_GPU_CAPACITY_GB": "1", "RESIDENT_POOL_GPU_HEADROOM_GB": "0"})
    assert done.returncode == 1, "check passed a provider whose every start is refused:\n" + done.stdout[-800:]


def test_check_fails_a_container_provider_whose_bind_does_not_exist(tmp_path, engines, isolated_dirs):
    path = _inside(tmp_path, "docker", 'binds = ["/nonexistent/models:/models:ro"]\n')
    done = run_check(path.parent.name, "--json", "--manifests", str(path.parents[1]))
    smoke = run_check(path.parent.name, "--smoke", "--json", "--manifests", str(path.parents[1]))
    assert smoke.returncode == 1  # every start fails: bind source path does not exist
    assert done.returncode == 1, "check passed a provider whose every start fails:\n" + done.stdout[-600:]


# -- 17: the kit's own ACTIVE / NOT ACTIVE line --------------------------------------------------------------


def test_a_coloured_not_active_line_is_read_as_the_kits_verdict(tmp_path):
    from resident_pool.validation.check import kit_says

    transcript = tmp_path / "t.log"
    transcript.write_text("\x1b[33mdriftkit_opt: NOT ACTIVE (no CUDA device)\x1b[0m\n")
    assert kit_says(transcript, "driftkit_opt")[0] == "NOT ACTIVE"


def test_a_kit_that_says_not_active_on_stdout_fails_against_stock(tmp_path, isolated_dirs, monkeypatch):
    """The same driftkit as the project's, printing its verdict with print() (stdout) instead of stderr.
    stdout into the transcript file is block-buffered and the declared worker stays warm, so the line is not
    in the transcript when check reads it: a kit that engaged nothing passes."""
    import providers

    kits = tmp_path / "kits"
    shutil.copytree(providers.KITS, kits)
    autoload = kits / "driftkit_opt" / "_autoload.py"
    text = autoload.read_text()
    text = text.replace('sys.stderr.write(f"driftkit_opt: ACTIVE (fused predict, mode {MODE})\\n")',
                        'print(f"driftkit_opt: ACTIVE (fused predict, mode {MODE})")')
    text = text.replace('sys.stderr.write(f"driftkit_opt: NOT ACTIVE (mode {MODE} engages no lever)\\n")',
                        'print(f"driftkit_opt: NOT ACTIVE (mode {MODE} engages no lever)")')
    assert "print(" in text
    autoload.write_text(text)
    monkeypatch.setattr(providers, "KITS", kits)
    python = providers.make_kit_venv(tmp_path / "venv", "driftkit_opt")
    manifests = tmp_path / "manifests"
    write_provider(manifests, "idle", f'[env]\npython = "{python}"\n[smoke]\npayload = {{ x = 21 }}\n'
                                      '[kit]\nname = "driftkit"\nmode = "idle"\n', worker="toyworker.py")
    done = run_check("--against-stock", "idle", "--json", "--manifests", str(manifests),
                     env={"XDG_CACHE_HOME": str(tmp_path / "cache")})
    row = {r["step"]: r for r in json.loads(done.stdout)}["against-stock"]
    assert not row["ok"], f"a kit that printed NOT ACTIVE passed against-stock: {row['detail']}"


# -- 17: bless of an answer that varies between runs ----------------------------------------------------------

VARYING = """
import importlib.util, os, sys, time
spec = importlib.util.spec_from_file_location("worker_base", os.environ["RESIDENT_POOL_WORKER_BASE"])
worker_base = importlib.util.module_from_spec(spec); spec.loader.exec_module(worker_base)
worker_base.serve(slug="vary", socket_path=sys.argv[1],
                  on_predict=lambda p: {"value": 42.0, "worker_token": int.from_bytes(os.urandom(4), "big"),
                                        "took_ms": time.time() % 1000})
"""


def test_bless_names_the_fields_that_vary_between_fresh_workers(tmp_path, isolated_dirs):
    """--bless of a provider whose answer carries run-varying fields (not named pid/elapsed*) must notice:
    it answers on two fresh workers and refuses, naming what to ignore, instead of recording them."""
    path = write_provider(tmp_path / "m", "vary", '[smoke]\npayload = { x = 1 }\nexpected = "smoke/e.json"\n')
    (path.parent / "worker.py").write_text(VARYING)
    blessed = run_check("--bless", "vary", "--json", "--manifests", str(tmp_path / "m"))
    row = {r["step"]: r for r in json.loads(blessed.stdout)}["bless"]
    assert blessed.returncode == 1 and not row["ok"], row
    # A random token, not the pid: two pids spawned one after the other differ by less than the tolerance.
    assert "worker_token" in row["detail"] and "[smoke] ignore" in row["detail"]
    assert not (path.parent / "smoke" / "e.json").exists()
    path.write_text(path.read_text() + 'ignore = ["worker_token", "took_ms"]\n')
    assert run_check("--bless", "vary", "--json", "--manifests", str(tmp_path / "m")).returncode == 0
    after = run_check("--smoke", "vary", "--json", "--manifests", str(tmp_path / "m"))
    assert {r["step"]: r for r in json.loads(after.stdout)}["smoke"]["ok"]


def test_a_shared_jit_root_from_the_environment_is_used_as_is(tmp_path, monkeypatch):
    """Issue 14: MODEL_OPT_JIT_ROOT from the pool's environment "used as is (as the seed does)"; README: "(as is,
    shared)". A team's shared kernel cache is group-writable."""
    from resident_pool.providers.launch import LaunchPlan

    python = make_kit_venv(tmp_path / "venv", "toykit_opt")
    shared = tmp_path / "team-jit"
    shared.mkdir()
    shared.chmod(0o2775)
    monkeypatch.setenv("MODEL_OPT_JIT_ROOT", str(shared))
    monkeypatch.delenv("MODEL_OPT", raising=False)
    path = write_provider(tmp_path / "m", "toy", f'[env]\npython = "{python}"\n[kit]\nname = "toykit"\nmode = "fast"\n',
                          worker="toyworker.py")
    try:
        plan = LaunchPlan.resolve(load_manifest(path), str(tmp_path / "w.sock"), **as_the_pool())
    except Exception as exc:
        pytest.fail(f"{type(exc).__name__}: {exc}")
    assert plan.jit_root == shared


SLOW_STOCK = """
import importlib.util, os, sys, time
spec = importlib.util.spec_from_file_location("worker_base", os.environ["RESIDENT_POOL_WORKER_BASE"])
worker_base = importlib.util.module_from_spec(spec); spec.loader.exec_module(worker_base)
import toymodel
def on_predict(payload):
    if os.environ.get("DRIFTKIT_OPT_MODE") == "off":
        time.sleep(3)
    return {"value": toymodel.predict(payload["x"])}
worker_base.serve(slug="shared", socket_path=sys.argv[1], on_predict=on_predict)
"""


def test_two_against_stock_checks_of_one_provider_do_not_stop_each_others_stock_run(tmp_path, isolated_dirs):
    """The nightly validate flow and a CI run on push (or two flow tasks) check the same provider: each stops
    `slug~stock` with now=True when its own stock answer is in, whoever else is using that variant."""
    python = make_kit_venv(tmp_path / "venv", "driftkit_opt")
    manifests = tmp_path / "manifests"
    path = write_provider(
        manifests, "shared", f'[env]\npython = "{python}"\n[smoke]\npayload = {{ x = 21 }}\natol = 1\n'
                             '[kit]\nname = "driftkit"\nmode = "fast"\n', worker="toyworker.py")
    (path.parent / "worker.py").write_text(SLOW_STOCK)
    env = {**os.environ, "COLUMNS": "400", "XDG_CACHE_HOME": str(tmp_path / "cache")}
    # the pool is up first, as on a host that serves flows
    from resident_pool.client import Pool
    with Pool(manifests=manifests) as pool:
        pool.status()
    both = [subprocess.Popen([sys.executable, "-m", "resident_pool", "check", "--against-stock", "shared", "--json",
                              "--manifests", str(manifests)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [proc.communicate(timeout=240)[0] for proc in both]
    rows = [{r["step"]: r for r in json.loads(out)}["against-stock"] for out in outs]
    assert all(row["ok"] for row in rows), [row["detail"][:160] + " ... " + row["detail"][-700:] for row in rows]


MODE_WORKER = """
import importlib.util, os, sys
spec = importlib.util.spec_from_file_location("worker_base", os.environ["RESIDENT_POOL_WORKER_BASE"])
worker_base = importlib.util.module_from_spec(spec); spec.loader.exec_module(worker_base)
worker_base.serve(slug="vm", socket_path=sys.argv[1],
                  on_predict=lambda p: {"mode": os.environ.get("DRIFTKIT_OPT_MODE")})
"""


def test_a_variant_is_built_as_asked_not_as_first_asked(tmp_path, isolated_dirs):
    """The pool keys a variant by its name alone (`slug~stock`): a later request for the stock variant
    built another way (the kit upgraded and no longer lists `off`, so stock is now "without the kit") gets the
    variant as it was first built."""
    from resident_pool.client import Pool

    python = make_kit_venv(tmp_path / "venv", "driftkit_opt")
    manifests = tmp_path / "manifests"
    path = write_provider(manifests, "vm", f'[env]\npython = "{python}"\n[kit]\nname = "driftkit"\nmode = "fast"\n',
                          worker="toyworker.py")
    (path.parent / "worker.py").write_text(MODE_WORKER)
    with Pool(manifests=manifests) as pool:
        with pool.session("vm", variant={"name": "stock", "kit_mode": "off", "without_kit": False}) as session:
            first = session.predict({})
        pool.stop("vm~stock", now=True)
        with pool.session("vm", variant={"name": "stock", "kit_mode": None, "without_kit": True}) as session:
            second = session.predict({})
        pool.stop("vm~stock", now=True)
    assert first == {"mode": "off"}
    assert second == {"mode": None}, f"asked for the worker without its kit, got {second}"


def test_a_kit_whose_off_mode_exports_nothing_can_be_compared_against_stock(tmp_path, isolated_dirs, monkeypatch):
    """`off` is the mode that pulls no lever; a kit's resolve("off") naturally exports no variables. The
    empty-row start rule is for the production mode; applied to the stock run it makes against-stock fail for
    every such kit (unless the manifest declares env_row = "none", which then also excuses the real mode)."""
    import providers

    kits = tmp_path / "kits"
    shutil.copytree(providers.KITS, kits)
    modes = kits / "driftkit_opt" / "modes.py"
    modes.write_text(modes.read_text().replace(
        'return {"env": {"DRIFTKIT_FUSED": "1" if mode == "fast" else "0"}}',
        'return {"env": {} if mode == "off" else {"DRIFTKIT_FUSED": "1" if mode == "fast" else "0"}}'))
    monkeypatch.setattr(providers, "KITS", kits)
    python = providers.make_kit_venv(tmp_path / "venv", "driftkit_opt")
    manifests = tmp_path / "manifests"
    write_provider(manifests, "offempty", f'[env]\npython = "{python}"\n[smoke]\npayload = {{ x = 21 }}\natol = 1\n'
                                          '[kit]\nname = "driftkit"\nmode = "fast"\n', worker="toyworker.py")
    done = run_check("--against-stock", "offempty", "--json", "--manifests", str(manifests),
                     env={"XDG_CACHE_HOME": str(tmp_path / "cache")})
    row = {r["step"]: r for r in json.loads(done.stdout)}["against-stock"]
    assert row["ok"], row["detail"][:400]


def test_the_gpu_provenance_names_the_gpu_that_answered(tmp_path, isolated_dirs):
    """On a host with an A100 and a T4, a 40 GB provider can only run on the A100; the provenance of its check
    must say A100, not list every GPU on the host."""
    nvml = tmp_path / "nvml.json"
    nvml.write_text(json.dumps({"driver": "550.54", "devices": [
        {"name": "NVIDIA T4", "total_gb": 16, "free_gb": 16}, {"name": "NVIDIA A100", "total_gb": 80, "free_gb": 80}]}))
    manifests = tmp_path / "m"
    shutil.copytree(ROOT / "manifests" / "echo", manifests / "echo")
    toml = manifests / "echo" / "manifest.toml"
    text = toml.read_text()
    assert "[gpu]" not in text
    toml.write_text(text + '\n[gpu]\npolicy = "required"\nvram_budget_gb = 40\n')
    done = run_check("--smoke", "echo", "--json", "--manifests", str(manifests),
                     env={"RESIDENT_POOL_FAKE_NVML": str(nvml), "RESIDENT_POOL_GPU_HEADROOM_GB": "0"})
    rows = {r["step"]: r for r in json.loads(done.stdout)}
    assert rows["smoke"]["ok"], rows["smoke"]["detail"]
    assert rows["smoke"]["provenance"]["gpu"] == "NVIDIA A100", rows["smoke"]["provenance"]["gpu"]


def test_the_shipped_ci_workflow_smoke_tests_against_the_hosts_ledger():
    """A smoke run must be admitted against the host pool's ledger: the workflow must not give check a state
    directory (and with it a ledger) of its own."""
    import yaml

    workflow = yaml.safe_load((ROOT / "infra" / "ci" / "kit-validation.yml").read_text())
    steps = workflow["jobs"]["validate"]["steps"]
    (check,) = [s for s in steps if "check --smoke" in s.get("run", "")]
    assert "RESIDENT_POOL_STATE_DIR" not in (check.get("env") or {})
    assert "RESIDENT_POOL_STATE_DIR" not in (workflow.get("env") or {})


def test_the_validation_table_carries_the_provenance_check_records():
    """Issue 17: provenance "in the validation flow's table artifact"; the table's columns drop the kit's own
    ACTIVE line, its activation, the key package versions and the expected file's hash."""
    from resident_pool.validation.provenance import columns

    values = {"manifest.fingerprint": "f", "weights.pins": "9 of 9", "kit.package": "driftkit_opt", "kit.version": "0.3",
              "kit.mode": "fast", "kit.jit_cache_key": "k", "kit.activation": "autoload",
              "kit.active": "driftkit_opt: NOT ACTIVE (no CUDA device)", "env.python": "CPython 3.11.7",
              "env.torch": "2.3.0", "env.cuda_runtime": "CUDA 12.1 (torch build)",
              "env.packages": "numpy 2.0, triton 2.3", "gpu": "NVIDIA A100 x1", "gpu.driver": "550",
              "host": "gpu1", "smoke.expected": "/m/x/smoke/expected.json (sha256 0123)"}
    table = " ".join(columns(values).values())
    missing = [name for name in ("kit.active", "kit.activation", "env.packages", "smoke.expected")
               if values[name].split(" (")[0] not in table]
    assert not missing, f"the validation table leaves out {missing}"
