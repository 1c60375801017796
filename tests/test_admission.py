"""Admission with injected devices and a real ledger file: placement, headroom, free memory, order."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from dataclasses import dataclass

import pytest
from helpers import wait_until

from resident_pool.admission import Admission, Device, Ledger, declared
from resident_pool.errors import AdmissionRefused, AdmissionTimeout


@dataclass
class FakeWorker:
    slug: str
    vram_budget_gb: float
    replica: int = 0
    manifest: object = None
    pid: int | None = None


def admission(tmp_path, devices, headroom_gb=0.0, **kwargs):
    return Admission(Ledger(tmp_path / "ledger.json"), devices=lambda: (devices, "test"), headroom_gb=headroom_gb,
                     **kwargs)


def test_a_two_device_host_places_each_worker_on_the_device_with_most_room(tmp_path):
    gate = admission(tmp_path, declared("0:80,1:80"))
    first = gate.admit(FakeWorker("a", 50), timeout_s=1)["CUDA_VISIBLE_DEVICES"]
    second = gate.admit(FakeWorker("b", 50), timeout_s=1)["CUDA_VISIBLE_DEVICES"]
    assert {first, second} == {"0", "1"}
    assert gate.admit(FakeWorker("c", 30), timeout_s=1)  # 30 still fits beside either
    with pytest.raises(AdmissionTimeout, match=r"d: waited .* for 40 GB"):
        gate.admit(FakeWorker("d", 40), timeout_s=0.3)
    assert sorted(e["slug"] for e in gate.ledger.entries()) == ["a", "b", "c"]


def test_headroom_is_kept_free_and_a_budget_over_every_device_is_refused_at_once(tmp_path):
    gate = admission(tmp_path, [Device(0, 10.0)], headroom_gb=1.0)
    with pytest.raises(AdmissionRefused, match=r"needs 9\.5 GB but the largest device holds 9 GB"):
        gate.admit(FakeWorker("big", 9.5), timeout_s=60)
    gate.admit(FakeWorker("a", 9), timeout_s=1)
    with pytest.raises(AdmissionTimeout):
        gate.admit(FakeWorker("b", 0.5), timeout_s=0.3)


def test_measured_free_memory_caps_what_the_ledger_would_allow(tmp_path):
    gate = admission(tmp_path, [Device(0, total_gb=10.0, free_gb=3.0)])  # 7 GB held outside the pool
    with pytest.raises(AdmissionTimeout, match="free now: GPU 0: 3 GB"):
        gate.admit(FakeWorker("a", 4), timeout_s=0.3)
    assert gate.admit(FakeWorker("b", 2), timeout_s=1)["CUDA_VISIBLE_DEVICES"] == "0"


def test_a_budget_booked_but_not_loaded_comes_off_nvmls_free_memory_once_not_twice(tmp_path):
    """Review r25: min(total - booked, NVML free) counted a budget booked but not yet visible in NVML as free too, so
    with 3 GB held outside the ledger 6 + 3 GB were placed on a 10 GB card. One rule (devices.rooms) for the
    per-user ledger and the host service: free memory less what is booked but not loaded yet."""
    reading = {"free": 7.0, "used": None}
    gate = Admission(Ledger(tmp_path / "ledger.json"), headroom_gb=0.0, devices=lambda: (
        [Device(0, total_gb=10.0, free_gb=reading["free"], used_gb=reading["used"])], "test"))
    a = FakeWorker("a", 6, pid=999_999)
    assert gate.place(a, 6).device == 0
    placement = gate.place(FakeWorker("b", 3), 3)
    assert placement.device is None and placement.rooms == {0: 1.0}  # 7 free, 6 of them about to go
    reading["free"] = 1.0  # a loads: NVML sees it now
    assert gate.place(FakeWorker("b", 3), 3).rooms == {0: -5.0}  # not counted twice ... until a is said loaded
    gate.loaded(a)
    assert gate.place(FakeWorker("c", 1), 1).device == 0  # 1 free now, none pending


def test_a_per_process_reading_says_how_much_of_a_booked_budget_nvml_shows_already(tmp_path):
    import os

    reading = {"free": 7.0, "used": {}}
    gate = Admission(Ledger(tmp_path / "ledger.json"), headroom_gb=0.0, devices=lambda: (
        [Device(0, total_gb=10.0, free_gb=reading["free"], used_gb=reading["used"])], "test"))
    assert gate.place(FakeWorker("a", 6), 6).device == 0  # booked under this process's pid while it starts
    reading.update(free=3.0, used={os.getpid(): 4.0})  # 4 of its 6 GB loaded so far: 2 still to come
    assert gate.place(FakeWorker("b", 2), 2).rooms == {0: 1.0}  # min(10 - 6, 3 - 2)
    reading.update(free=1.0, used={os.getpid(): 7.5})  # past its budget: nothing pending, NVML's word stands
    assert gate.place(FakeWorker("c", 1), 1).device == 0


def test_waiters_are_admitted_first_come_first_served(tmp_path):
    gate = admission(tmp_path, [Device(0, 10.0)])
    holder = FakeWorker("a6", 6)
    gate.admit(holder, timeout_s=1)
    order = []

    def ask(worker):
        gate.admit(worker, timeout_s=30)
        order.append(worker.slug)

    second = threading.Thread(target=ask, args=(FakeWorker("b6", 6),))
    second.start()
    wait_until(lambda: [w["slug"] for w in gate.waiting()] == ["b6"], message="b6 waiting")
    third = threading.Thread(target=ask, args=(FakeWorker("c3", 3),))  # would fit now, but b6 came first
    third.start()
    wait_until(lambda: [w["slug"] for w in gate.waiting()] == ["b6", "c3"], message="c3 queued behind b6")
    assert order == []
    gate.release(holder)
    second.join(10)
    third.join(10)
    assert order == ["b6", "c3"]


def test_an_entry_whose_pid_is_dead_is_reclaimed_on_read(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / "ledger.json").write_text(json.dumps([
        {"slug": "ghost", "replica": 0, "device": 0, "budget_gb": 8, "pid": dead.pid, "owner": dead.pid,
         "since": 0}]))
    gate = admission(tmp_path, [Device(0, 10.0)])
    assert gate.admit(FakeWorker("a6", 6), timeout_s=1)
    assert [e["slug"] for e in gate.ledger.entries()] == ["a6"]


def test_one_placement_try_books_where_it_fits_or_books_nothing_and_says_the_room_it_found(tmp_path):
    gate = admission(tmp_path, [Device(0, 10.0), Device(1, total_gb=10.0, free_gb=5.0)], headroom_gb=0.5)
    placed = gate.place(FakeWorker("a6", 6), 6)
    assert (placed.device, placed.rooms) == (0, {0: 9.5, 1: 4.5})  # most room first: NVML caps device 1
    missed = gate.place(FakeWorker("b6", 6), 6)
    assert missed.device is None and missed.rooms == {0: 3.5, 1: 4.5} and "at most 4.5 GB free" in missed.why
    assert gate.place(FakeWorker("c3", 3), 3, device=1).device == 1  # pinned (a restore): only there
    assert sorted(e["slug"] for e in gate.ledger.entries()) == ["a6", "c3"]
