"""Hibernation instead of eviction, through a fake libcuda that records the checkpoint calls and their order."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from fakecuda import build, calls
from helpers import wait_until
from providers import write_provider

from resident_pool import Pool
from resident_pool.host.procs import pid_alive
from resident_pool.providers.hibernate import CheckpointError, CudaCheckpoint, Hibernator


@pytest.fixture
def fake_cuda(tmp_path, monkeypatch):
    """The pool loads the fake driver; its calls go to a log, and the steps named in a file fail."""
    log, fail = tmp_path / "libcuda-calls.log", tmp_path / "libcuda-fail"
    monkeypatch.setenv("FAKE_LIBCUDA_LOG", str(log))
    monkeypatch.setenv("FAKE_LIBCUDA_FAIL", str(fail))

    def use(checkpoint: bool = True) -> Path:
        library = build(tmp_path / ("driver" if checkpoint else "driver-without-checkpoint"), checkpoint)
        monkeypatch.setenv("RESIDENT_POOL_LIBCUDA", str(library))
        return library

    use.log, use.fail = log, fail
    return use


class FakeProcess:
    slug = "demo"
    device = "0"

    def __init__(self, pid):
        self.pid = pid
        self.notes = []

    def note(self, message):
        self.notes.append(message)


def test_hibernate_and_restore_call_the_api_in_order_with_a_lock_timeout(fake_cuda):
    hibernator = Hibernator(CudaCheckpoint(str(fake_cuda())))
    process = FakeProcess(4242)
    hibernation = hibernator.hibernate(process)
    hibernator.restore(process)
    assert calls(fake_cuda.log) == ["init 0", "lock 4242 10000", "checkpoint 4242", "restore 4242", "unlock 4242"]
    assert hibernation.device == "0" and "hibernated" in process.notes[0] and "restored" in process.notes[1]


def test_a_failed_checkpoint_unlocks_the_process_and_names_the_call_and_the_drivers_error(fake_cuda):
    hibernator = Hibernator(CudaCheckpoint(str(fake_cuda())))
    fake_cuda.fail.write_text("checkpoint")
    with pytest.raises(CheckpointError, match=r"cuCheckpointProcessCheckpoint\(77\) failed: CUDA_ERROR_NOT_SUPPORTED"):
        hibernator.hibernate(FakeProcess(77))
    assert calls(fake_cuda.log)[1:] == ["lock 77 10000", "checkpoint 77", "unlock 77"]


def test_a_driver_without_the_checkpoint_api_is_named_as_such(fake_cuda):
    api = CudaCheckpoint(str(fake_cuda(checkpoint=False)))
    assert "cuCheckpointProcessLock" in api.unavailable() and "570" in api.unavailable()
    assert "cannot be loaded" in CudaCheckpoint("/nonexistent/libcuda.so.1").unavailable()


def _providers(pool_dir, monkeypatch, tmp_path, evict_a="hibernate"):
    """Two 6 GB providers on a declared 10 GB device: one must make room for the other.
    ping_interval_s = 0.5 so liveness pings are seen within the test."""
    monkeypatch.setenv("RESIDENT_POOL_GPU_CAPACITY_GB", "10")
    pings = tmp_path / "pings"
    pings.mkdir()
    monkeypatch.setenv("TESTWORKER_PING_DIR", str(pings))
    for slug, evict in (("a6", evict_a), ("b6", "stop")):
        write_provider(pool_dir, slug, '[env]\npassthrough = ["TESTWORKER_PING_DIR"]\n'
                                       f'[gpu]\npolicy = "required"\nvram_budget_gb = 6\n'
                                       f'[lifecycle]\nevict = "{evict}"\nping_interval_s = 0.5\n')
    return pings


def _pings(pings: Path, pid: int) -> int:
    path = pings / f"{pid}.pings"
    return len(path.read_text().splitlines()) if path.exists() else 0


def _worker(pool, slug):
    return next(w for w in pool.status()["workers"] if w["slug"] == slug)


def _transcript_has(slug: str, text: str) -> bool:
    logs = Path(os.environ["RESIDENT_POOL_LOG_DIR"])
    return any(text in path.read_text(errors="replace") for path in logs.glob(f"{slug}-*.log"))


def test_an_evicted_worker_hibernates_is_never_pinged_and_its_next_lease_waits_for_its_restore(
        pool_dir, monkeypatch, tmp_path, fake_cuda, reliability_row):
    fake_cuda()
    pings = _providers(pool_dir, monkeypatch, tmp_path)
    with Pool() as pool:
        a = pool.predict("a6", {"action": "echo"})["pid"]
        b = pool.predict("b6", {"action": "echo"})["pid"]  # a6 must make room: its kept lease back, it hibernates
        hibernated = _worker(pool, "a6")
        assert hibernated["state"] == "hibernated" and hibernated["pid"] == a and pid_alive(a)
        assert hibernated["hibernation"]["device"] == "0"
        assert [e["slug"] for e in pool.status()["ledger"]] == ["b6"]  # its budget was given back
        assert calls(fake_cuda.log) == ["init 0", f"lock {a} 10000", f"checkpoint {a}"]
        # Liveness: b6 is pinged twice more while a6, whose CUDA is locked, is not pinged at all.
        a_pings, b_pings = _pings(pings, a), _pings(pings, b)
        wait_until(lambda: _pings(pings, b) >= b_pings + 2, timeout=15, message="two liveness pings of b6")
        assert _pings(pings, a) == a_pings
        answer = pool.predict("a6", {"action": "echo"})  # b6 is stopped for room, a6 restored, then served
        assert answer["pid"] == a
        assert calls(fake_cuda.log)[3:] == [f"restore {a}", f"unlock {a}"]
        assert not pid_alive(b)
        restored = _worker(pool, "a6")  # held by this Pool's kept lease between calls
        assert restored["state"] == "leased" and restored["lease"]["kept"] and restored["hibernation"] is None
        assert pool.status()["providers"]["a6"]["eviction"]["last"] == "a6[0] restored from hibernation"
        assert pool.status()["providers"]["a6"]["starts"] == 1  # a restore is not a start
    assert _transcript_has("a6", "hibernated: device memory checkpointed") and _transcript_has("a6", "restored")
    reliability_row("evicted worker hibernated (fake libcuda)",
                    "same pid restored on its next lease; never pinged while hibernated; budget given back")


def test_a_failed_restore_stops_the_worker_and_the_lease_gets_a_fresh_one(pool_dir, monkeypatch, tmp_path, fake_cuda,
                                                                          reliability_row):
    fake_cuda()
    _providers(pool_dir, monkeypatch, tmp_path)
    with Pool() as pool:
        a = pool.predict("a6", {"action": "echo"})["pid"]
        pool.predict("b6", {"action": "echo"})
        assert _worker(pool, "a6")["state"] == "hibernated"
        fake_cuda.fail.write_text("restore")
        fresh = pool.predict("a6", {"action": "echo"})["pid"]
        assert fresh != a and not pid_alive(a)
        provider = pool.status()["providers"]["a6"]
        assert "restore from hibernation failed" in provider["last_error"]
        assert "CUDA_ERROR_NOT_SUPPORTED" in provider["eviction"]["last"]
    assert calls(fake_cuda.log)[-1] == f"restore {a}"  # never unlocked: it was stopped
    assert _transcript_has("a6", "its restore from hibernation failed")
    reliability_row("restore from hibernation fails", "worker stopped, said in transcript and status; lease served fresh")


def test_without_the_checkpoint_api_an_evicted_worker_is_stopped_and_status_says_why(
        pool_dir, monkeypatch, tmp_path, fake_cuda, reliability_row):
    fake_cuda(checkpoint=False)
    _providers(pool_dir, monkeypatch, tmp_path)
    with Pool() as pool:
        a = pool.predict("a6", {"action": "echo"})["pid"]
        pool.predict("b6", {"action": "echo"})
        wait_until(lambda: not pid_alive(a), timeout=10, message="a6 to be stopped")
        eviction = pool.status()["providers"]["a6"]["eviction"]
        assert eviction["evict"] == "hibernate" and "570" in eviction["unavailable"]
        assert "could not hibernate" in eviction["last"] and "stopped instead" in eviction["last"]
    assert _transcript_has("a6", "could not hibernate") and _transcript_has("a6", "driver branch 570")
    reliability_row("hibernate without the checkpoint API", "evicted worker stopped; transcript and status say why")


def test_a_provider_that_stops_on_eviction_never_touches_the_driver(pool_dir, monkeypatch, tmp_path, fake_cuda):
    fake_cuda()
    _providers(pool_dir, monkeypatch, tmp_path, evict_a="stop")
    with Pool() as pool:
        a = pool.predict("a6", {"action": "echo"})["pid"]
        pool.predict("b6", {"action": "echo"})
        wait_until(lambda: not pid_alive(a), timeout=10, message="a6 to be stopped")
        assert pool.status()["providers"]["a6"]["eviction"] == {"evict": "stop"}
    assert calls(fake_cuda.log) == []
