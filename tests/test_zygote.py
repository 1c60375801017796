"""The zygote (a preloading fork server): refusal once CUDA is touched, the load stage, its life beside its workers."""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

import pytest
from fakecuda import build
from helpers import WORKERS, wait_until
from providers import write_provider

from resident_pool import ManifestError, Pool
from resident_pool.host.procs import pid_alive
from resident_pool.providers.manifest import load_manifest
from resident_pool.providers.worker_process import Launch
from resident_pool.providers.zygote import fork_refusal

# The fakes read these in the zygote and the worker, which see only what their manifest names.
FAKE_CUDA_ENV = '[env]\npassthrough = ["FAKE_TORCH_CUDA_FLAG", "FAKE_LIBCUDA"]\n'


def _transcripts(prefix: str) -> list[str]:
    logs = Path(os.environ["RESIDENT_POOL_LOG_DIR"])
    return [path.read_text(errors="replace") for path in sorted(logs.glob(f"{prefix}-*.log"))]


def _worker(pool, slug):
    return next(w for w in pool.status()["workers"] if w["slug"] == slug)


def _kill_worker(pool, slug) -> int:
    """SIGKILL the provider's worker and wait for the pool to see it gone; its pid."""
    pid = _worker(pool, slug)["pid"]
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: not [w for w in pool.status()["workers"] if w["slug"] == slug], timeout=10,
               message="the pool to see its worker gone")
    return pid


@pytest.mark.parametrize("toucher", ["torch", "driver"])
def test_a_module_that_initializes_cuda_is_refused_by_name_and_the_workers_are_spawned(
        pool_dir, tmp_path, monkeypatch, toucher, reliability_row):
    folder = write_provider(pool_dir, "careless", FAKE_CUDA_ENV).parent
    if toucher == "torch":  # torch's own word: torch.cuda.is_initialized()
        shutil.copy(WORKERS / "fake_torch.py", folder / "torch.py")
        flag = tmp_path / "cuda-initialized"
        flag.touch()
        monkeypatch.setenv("FAKE_TORCH_CUDA_FLAG", str(flag))
        module = "torch"
    else:  # the driver's: cuInit ran, whoever ran it
        monkeypatch.setenv("FAKE_LIBCUDA", str(build(tmp_path / "driver")))
        shutil.copy(WORKERS / "touchcuda.py", folder / "touchcuda.py")
        module = "touchcuda"
    (folder / "manifest.toml").write_text((folder / "manifest.toml").read_text()
                                          + f'[lifecycle]\npreload = ["json", "{module}"]\n')
    with Pool() as pool:
        first = pool.predict("careless", {"action": "echo"})["pid"]
        start = pool.status()["providers"]["careless"]["start"]
        assert start["way"] == "spawn"
        assert f"importing '{module}' initialized CUDA" in start["why"]
        assert _worker(pool, "careless")["started_by"] == "spawn"
        assert pool.status()["zygotes"] == []
        _kill_worker(pool, "careless")
        assert pool.predict("careless", {"action": "echo"})["pid"] != first  # spawned again, not retried
    (zygote,) = _transcripts("zygote-careless")
    assert f"refusing to fork: importing '{module}' initialized CUDA" in zygote
    assert all(f"not forked from a zygote: the zygote could not preload: importing '{module}'" in text
               for text in _transcripts("careless"))
    reliability_row(f"a preloaded module initializes CUDA ({toucher})",
                    "the zygote refuses, naming the module; workers spawned; status says why")


def test_cuda_touched_after_the_preload_refuses_the_next_fork(pool_dir, tmp_path, monkeypatch):
    folder = write_provider(pool_dir, "late", FAKE_CUDA_ENV + '[lifecycle]\npreload = ["torch"]\n').parent
    shutil.copy(WORKERS / "fake_torch.py", folder / "torch.py")
    flag = tmp_path / "cuda-initialized"
    monkeypatch.setenv("FAKE_TORCH_CUDA_FLAG", str(flag))
    with Pool() as pool:
        pool.predict("late", {"action": "echo"})
        zygote = pool.status()["providers"]["late"]["start"]["zygote"]["pid"]
        assert _worker(pool, "late")["started_by"] == f"zygote {zygote}"
        flag.touch()  # as if a thread of a preloaded module had initialized CUDA since
        _kill_worker(pool, "late")
        pool.predict("late", {"action": "echo"})
        assert _worker(pool, "late")["started_by"] == "spawn"
        wait_until(lambda: not pid_alive(zygote), timeout=10, message="the refusing zygote to be stopped")
        assert "after its preload" in pool.status()["providers"]["late"]["start"]["why"]
    assert any("not forked from a zygote: CUDA was initialized in the zygote after its preload" in text
               for text in _transcripts("late"))


@pytest.mark.parametrize("way", ["spawn", "zygote"])
def test_the_load_stage_runs_in_the_zygote_and_every_fork_finds_its_result(pool_dir, way):
    lifecycle = '[lifecycle]\npreload = []\nload = "load"\n' if way == "zygote" else ""
    folder = write_provider(pool_dir, "stager", f'worker_args = ["{{socket}}", "{{weights_root}}"]\n'
                            f'[weights]\nroot = "."\n{lifecycle}', worker="stager.py").parent
    with Pool() as pool:
        answer = pool.predict("stager", {})
        state = pool.status()
        if way == "zygote":
            zygote = state["providers"]["stager"]["start"]["zygote"]
            assert answer["staged"] and answer["model"]["loaded_by"] == zygote["pid"] != answer["pid"]
            assert zygote["load_s"] is not None
        else:
            assert not answer["staged"] and answer["model"]["loaded_by"] == answer["pid"]
        assert answer["model"]["weights_root"] == str(folder)


def test_an_evicted_worker_leaves_its_zygote_warm_and_the_next_start_forks_from_it(pool_dir, monkeypatch):
    monkeypatch.setenv("RESIDENT_POOL_GPU_CAPACITY_GB", "10")
    gpu = '[gpu]\npolicy = "required"\nvram_budget_gb = 6\n'
    write_provider(pool_dir, "a6", gpu + '[lifecycle]\npreload = ["json"]\n')
    write_provider(pool_dir, "b6", gpu)
    with Pool() as pool:
        first = pool.predict("a6", {"action": "echo"})["pid"]
        zygote = pool.status()["providers"]["a6"]["start"]["zygote"]["pid"]
        pool.predict("b6", {"action": "echo"})  # a6 is evicted to make room
        assert not pid_alive(first) and pid_alive(zygote)
        second = pool.predict("a6", {"action": "echo"})["pid"]
        assert second != first and _worker(pool, "a6")["started_by"] == f"zygote {zygote}"
        assert pool.status()["providers"]["a6"]["start"]["zygote"]["forks"] == 2


def test_a_killed_zygote_leaves_its_worker_serving_and_the_next_start_has_a_new_one(pool_dir, reliability_row):
    write_provider(pool_dir, "orphaned", '[lifecycle]\npreload = ["json"]\n')
    with Pool() as pool:
        worker = pool.predict("orphaned", {"action": "echo"})["pid"]
        zygote = pool.status()["providers"]["orphaned"]["start"]["zygote"]["pid"]
        os.kill(zygote, signal.SIGKILL)
        wait_until(lambda: pool.status()["zygotes"] == [], timeout=10, message="the pool to see its zygote gone")
        assert pool.predict("orphaned", {"action": "echo"})["pid"] == worker  # the warm worker serves on
        pool.stop("orphaned")
        assert not pid_alive(worker)
        pool.predict("orphaned", {"action": "echo"})
        assert pool.status()["providers"]["orphaned"]["start"]["zygote"]["pid"] not in (None, zygote)
    old = next(text for text in _transcripts("orphaned") if f"forked pid {worker} " in text)
    assert "exit status lost" in old
    reliability_row("zygote SIGKILL under a warm worker",
                    "the worker served on; its exit noted as lost; the next start had a new zygote")


def test_an_install_beside_the_script_makes_the_next_start_use_a_new_zygote(pool_dir):
    folder = write_provider(pool_dir, "updated", '[lifecycle]\npreload = ["json"]\n').parent
    with Pool() as pool:
        pool.predict("updated", {"action": "echo"})
        old = pool.status()["providers"]["updated"]["start"]["zygote"]["pid"]
        (folder / "newmodule.py").write_text("VALUE = 1\n")  # its folder is on the zygote's import path
        _kill_worker(pool, "updated")
        pool.predict("updated", {"action": "echo"})
        new = pool.status()["providers"]["updated"]["start"]["zygote"]["pid"]
        assert new != old
        wait_until(lambda: not pid_alive(old), timeout=10, message="the stale zygote to retire")
    retired = next(text for text in _transcripts("zygote-updated") if f"zygote pid {old} " in text)
    assert "changed since it preloaded" in retired


def test_a_module_the_zygote_loaded_edited_on_disk_makes_the_next_start_use_a_new_zygote(pool_dir):
    """The zygote judged itself stale only by its import path's folders: a preloaded module edited in place left
    every fork running the old code."""
    folder = write_provider(pool_dir, "edited", '[lifecycle]\npreload = ["helper"]\n').parent
    helper = folder / "helper.py"
    helper.write_text("VALUE = 1\n")
    with Pool() as pool:
        pool.predict("edited", {"action": "echo"})
        old = pool.status()["providers"]["edited"]["start"]["zygote"]["pid"]
        stamp = helper.stat().st_mtime_ns
        helper.write_text("VALUE = 2\n")
        os.utime(folder, ns=(folder.stat().st_atime_ns, folder.stat().st_mtime_ns))  # the folder itself unchanged
        os.utime(helper, ns=(stamp + 1_000_000_000, stamp + 1_000_000_000))
        _kill_worker(pool, "edited")
        pool.predict("edited", {"action": "echo"})
        new = pool.status()["providers"]["edited"]["start"]["zygote"]["pid"]
        assert new != old
        wait_until(lambda: not pid_alive(old), timeout=10, message="the stale zygote to retire")
    retired = next(text for text in _transcripts("zygote-edited") if f"zygote pid {old} " in text)
    assert f"{helper}, which it loaded, changed on disk since" in retired


def _launch(argv, stop=None):
    return Launch(argv, {}, stop=stop, kill=stop)


def test_which_providers_fork_and_why_the_others_spawn(pool_dir):
    plain = load_manifest(write_provider(pool_dir, "plain", ""))
    forked = load_manifest(write_provider(pool_dir, "forked", "[lifecycle]\npreload = []\n"))
    script = str(forked.worker_path)
    assert fork_refusal(plain, _launch(["python", str(plain.worker_path)])) == "no [lifecycle] preload"
    assert fork_refusal(forked, _launch(["python", script, "sock"])) is None
    assert "worker_launch" in fork_refusal(forked, _launch(["python", "-m", "kit_opt.worker_launch", "--", script]))
    assert "interpreter flags" in fork_refusal(forked, _launch(["python", "-X", "dev", script]))
    assert "container" in fork_refusal(forked, _launch(["docker", "run", "img"], stop=["docker", "stop", "x"]))


@pytest.mark.parametrize(("body", "named"), [
    ('load = "load"\n', "preload"),
    ('preload = ["torch", "not a module"]\n', "not a module name"),
    ('preload = []\nload = "a.b"\n', "not a function name"),
])
def test_bad_zygote_settings_are_manifest_errors_naming_the_field(pool_dir, body, named):
    with pytest.raises(ManifestError, match="lifecycle") as info:
        load_manifest(write_provider(pool_dir, "bad", "[lifecycle]\n" + body))
    assert named in str(info.value)


def test_a_preload_that_fails_to_import_is_said_and_the_workers_are_spawned(pool_dir):
    write_provider(pool_dir, "typo", '[lifecycle]\npreload = ["json", "no_such_module_here"]\n')
    with Pool() as pool:
        assert pool.predict("typo", {"action": "echo", "value": 1})["echo"] == 1
        start = pool.status()["providers"]["typo"]["start"]
    assert start["way"] == "spawn"
    assert "importing 'no_such_module_here' failed: ModuleNotFoundError" in start["why"]
    assert "zygote-typo-" in start["why"]  # the zygote's transcript, for its traceback


def test_the_status_command_says_how_each_provider_starts(pool_dir):
    import subprocess
    import sys

    write_provider(pool_dir, "forked", '[lifecycle]\npreload = ["json"]\n')
    write_provider(pool_dir, "typo", '[lifecycle]\npreload = ["no_such_module_here"]\n')
    write_provider(pool_dir, "plain", "")
    with Pool() as pool:
        for slug in ("forked", "typo", "plain"):
            pool.predict(slug, {"action": "echo"})
        zygote = pool.status()["providers"]["forked"]["start"]["zygote"]["pid"]
        text = subprocess.run([sys.executable, "-m", "resident_pool", "status"], capture_output=True, text=True,
                              timeout=120, check=True).stdout
    assert f"forked: workers forked from zygote pid {zygote} (preload" in text
    assert "typo: workers spawned: its zygote failed: the zygote could not preload: importing" in text
    assert "plain:" not in text  # no preload asked for: nothing to say
