"""The GPU acceptance script's CPU-checkable parts: the no-GPU path, the leak arithmetic, the table."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import gpu_check  # noqa: E402 - a script folder, not a package

MIB = 2**20


def test_without_a_gpu_it_says_so_in_one_line_and_exits_0():
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py")], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1 and "no usable NVIDIA GPU" in lines[0] and "nothing was checked" in lines[0]


def test_bytes_per_request_is_the_slope_of_recorded_readings():
    baseline = 1_000_000_000
    growing = [baseline + n * 32 * MIB for n in range(40)]
    assert gpu_check.bytes_per_request(growing) == 32 * MIB
    noisy_flat = [baseline + (4096 if n % 2 else 0) for n in range(40)]
    assert abs(gpu_check.bytes_per_request(noisy_flat)) < 1024
    assert gpu_check.bytes_per_request([baseline]) == 0.0


def test_leak_verdict_needs_both_the_control_and_the_fix():
    flat = [10 * MIB] * 39
    leaking = [10 * MIB + n * 32 * MIB for n in range(39)]
    assert gpu_check.leak_verdict(leaking, flat).ok
    assert gpu_check.leak_verdict(leaking, flat).figures["release off: MiB/request"] == 32.0
    assert not gpu_check.leak_verdict(flat, flat).ok  # no leak with the release off: the control failed
    assert not gpu_check.leak_verdict(leaking, leaking).ok  # the release did not hold memory flat


def test_the_table_gives_each_verdict_and_a_count():
    text = gpu_check.render([gpu_check.Check("a", True, {"ms": 3}), gpu_check.Check("b", False, {}, "why")])
    lines = text.splitlines()
    assert lines[1].split()[:2] == ["a", "pass"] and "ms 3" in lines[1]
    assert "FAIL" in lines[2] and "(why)" in lines[2]
    assert lines[-1] == "1 passed, 1 failed"


def test_the_hibernate_row_needs_the_same_process_its_memory_back_and_a_faster_answer():
    gib = 2**30
    good = gpu_check.hibernate_verdict(cold_s=8.0, restore_s=1.2, same_pid=True, kept_bytes=2 * gib, held_bytes=2 * gib)
    assert good.ok and good.figures["restore/cold"] == 0.15
    assert not gpu_check.hibernate_verdict(8.0, 1.2, same_pid=False, kept_bytes=2 * gib, held_bytes=2 * gib).ok
    assert not gpu_check.hibernate_verdict(8.0, 1.2, same_pid=True, kept_bytes=0, held_bytes=2 * gib).ok
    assert not gpu_check.hibernate_verdict(8.0, 9.0, same_pid=True, kept_bytes=2 * gib, held_bytes=2 * gib).ok


def test_a_check_that_could_not_run_here_is_a_skip_not_a_pass():
    text = gpu_check.render([gpu_check.Check("a", True), gpu_check.Check("hibernate", False, {}, "not checked: "
                                                                          "driver 550", skipped=True)])
    assert text.splitlines()[2].split()[1] == "skip" and text.splitlines()[-1] == "1 passed, 0 failed, 1 skipped"


def test_the_measured_memory_row_needs_agreement_with_nvidia_smi_room_under_budget_and_the_flag():
    assert gpu_check.measured_verdict(1.52, 1.50, 3.0, True).ok
    assert not gpu_check.measured_verdict(1.52, 1.30, 3.0, True).ok  # 225 MiB off nvidia-smi
    assert not gpu_check.measured_verdict(3.5, 3.5, 3.0, True).ok  # over the budget before it should be
    assert not gpu_check.measured_verdict(1.5, 1.5, 3.0, False).ok  # never flagged once over
    missing = gpu_check.measured_verdict(None, 1.5, 3.0, True)
    assert not missing.ok and missing.figures["pool GiB"] is None
