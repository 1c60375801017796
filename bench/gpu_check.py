"""GPU acceptance check: the GPU paths CI can only fake, run for real on an NVIDIA GPU.

    make gpu-check        (or: python bench/gpu_check.py)

Needs an NVIDIA GPU, a CUDA build of torch and this project installed. Where no
GPU is present it says so in one line and exits 0 without claiming any check.
Prints one table of verdicts and figures; exits 1 when any check fails.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GPU_WORKER = ROOT / "bench" / "gpu" / "worker.py"
MIB = 2**20


@dataclass
class Check:
    name: str
    ok: bool
    figures: dict[str, object] = field(default_factory=dict)
    detail: str = ""
    skipped: bool = False  # not run here (its detail says why); neither a pass nor a failure


def gpu_present() -> tuple[bool, str]:
    """Whether an NVIDIA GPU is usable here, and why not."""
    try:
        import pynvml
    except ImportError:
        return False, "nvidia-ml-py is not installed"
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return False, f"NVML is not readable ({exc})"
    try:
        count = pynvml.nvmlDeviceGetCount()
    finally:
        pynvml.nvmlShutdown()
    if count == 0:
        return False, "NVML sees no device"
    try:
        import torch
    except ImportError:
        return False, "torch is not installed"
    if not torch.cuda.is_available():
        return False, f"torch {torch.__version__} has no CUDA (install a CUDA build: see bench/gpu/README.md)"
    return True, f"{count} device(s)"


def bytes_per_request(samples: list[int]) -> float:
    """Least-squares slope of memory against request number: the growth each request leaves."""
    n = len(samples)
    if n < 2:
        return 0.0
    mean_x, mean_y = (n - 1) / 2, statistics.fmean(samples)
    covariance = sum((x - mean_x) * (y - mean_y) for x, y in enumerate(samples))
    variance = sum((x - mean_x) ** 2 for x in range(n))
    return covariance / variance


def leak_verdict(leaking: list[int], released: list[int], workspace_mib: float = 32.0) -> Check:
    """The positive control must leak about one workspace per request; the release must keep memory flat."""
    grow, flat = bytes_per_request(leaking), bytes_per_request(released)
    ok = grow >= 0.5 * workspace_mib * MIB and abs(flat) < 1 * MIB
    return Check("cuBLAS workspace leak and its release", ok,
                 {"release off: MiB/request": round(grow / MIB, 2), "release on: MiB/request": round(flat / MIB, 3)},
                 "control leaks, release holds flat" if ok else "expected growth with release off and none with it on")


def measured_verdict(measured_gib: float | None, smi_gib: float | None, budget_gib: float, flagged_over: bool,
                     gap_mib: float = 64.0) -> Check:
    """The pool's NVML reading of a worker must match nvidia-smi's, sit under its budget, and flag it once over."""
    matches = measured_gib is not None and smi_gib is not None and abs(measured_gib - smi_gib) * 1024 <= gap_mib
    under = measured_gib is not None and measured_gib <= budget_gib
    ok = matches and under and flagged_over
    return Check("measured GPU memory vs budget (NVML per process)", ok,
                 {"pool GiB": None if measured_gib is None else round(measured_gib, 2),
                  "nvidia-smi GiB": None if smi_gib is None else round(smi_gib, 2), "budget GiB": budget_gib,
                  "flagged once over": flagged_over},
                 "" if ok else "expected the pool's reading within 64 MiB of nvidia-smi's, under the budget, "
                               "then the over-budget flag")


def render(checks: list[Check]) -> str:
    lines = [f"{'check':<44} {'verdict':<8} figures"]
    for check in checks:
        figures = ", ".join(f"{k} {v}" for k, v in check.figures.items())
        verdict = "skip" if check.skipped else ("pass" if check.ok else "FAIL")
        lines.append(f"{check.name:<44} {verdict:<8} {figures}" + (f"  ({check.detail})" if check.detail else ""))
    skipped = sum(c.skipped for c in checks)
    failed = sum(not c.ok and not c.skipped for c in checks)
    lines.append(f"{len(checks) - failed - skipped} passed, {failed} failed"
                 + (f", {skipped} skipped" if skipped else ""))
    return "\n".join(lines)


def hibernate_verdict(cold_s: float, restore_s: float, same_pid: bool, kept_bytes: int, held_bytes: int) -> Check:
    """A restore must answer from the same process, with its memory back, sooner than a cold start."""
    ok = same_pid and kept_bytes >= held_bytes and restore_s < cold_s
    return Check("hibernate: restore vs cold start", ok,
                 {"cold start s": round(cold_s, 2), "hibernate-to-first-answer s": round(restore_s, 2),
                  "restore/cold": round(restore_s / cold_s, 3) if cold_s else None},
                 "same process, memory back, sooner" if ok else
                 f"same pid {same_pid}, held {held_bytes} B, back {kept_bytes} B")


# -- the checks (GPU only) ------------------------------------------------------------
class Harness:
    def __init__(self) -> None:
        self.tmp = Path(tempfile.mkdtemp(prefix="rp-gpu-"))
        os.environ.update({"RESIDENT_POOL_STATE_DIR": str(self.tmp / "state"),
                           "RESIDENT_POOL_LOG_DIR": str(self.tmp / "logs"),
                           "RESIDENT_POOL_ORPHAN_GRACE_S": "3", "RESIDENT_POOL_HEARTBEAT_STALE_S": "2",
                           "RESIDENT_POOL_GPU_HEADROOM_GB": "0.5"})
        self.manifests = self.tmp / "manifests"
        os.environ["RESIDENT_POOL_MANIFESTS"] = str(self.manifests)
        shutil.copytree(ROOT / "manifests" / "minilm", self.manifests / "minilm")

    def provider(self, slug: str, budget_gb: float, extra_env: str = "") -> None:
        folder = self.manifests / slug
        folder.mkdir(parents=True, exist_ok=True)
        shutil.copy(GPU_WORKER, folder / "worker.py")
        (folder / "manifest.toml").write_text(
            f'slug = "{slug}"\nworker = "worker.py"\n[gpu]\npolicy = "required"\nvram_budget_gb = {budget_gb}\n'
            f"[lifecycle]\nidle_timeout_s = 0\nstart_timeout_s = 300\nadmission_timeout_s = 600\n{extra_env}")

    def restart_pool(self) -> None:
        from resident_pool.client import shutdown_pool

        shutdown_pool()


def _poll(condition: Callable[[], object], timeout: float) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.1)
    return None


def _nvml_used(index: int = 0) -> int:
    import pynvml

    pynvml.nvmlInit()
    try:
        return pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(index)).used
    finally:
        pynvml.nvmlShutdown()


def check_nvml_matches_smi() -> Check:
    from resident_pool.admission import read_devices
    from resident_pool.settings import settings

    devices, source = read_devices(settings())
    smi = subprocess.run(["nvidia-smi", "--query-gpu=index,memory.total,memory.free", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=True).stdout
    rows = [[float(x) for x in line.split(",")] for line in smi.strip().splitlines()]
    gaps = [abs(d.total_gb * 1024 - row[1]) for d, row in zip(devices, rows, strict=False)]
    ok = len(devices) == len(rows) and max(gaps, default=0) <= 64  # MiB
    return Check("NVML capacity matches nvidia-smi", ok,
                 {"devices": len(devices), "source": source, "max total gap MiB": round(max(gaps, default=0), 1)})


def check_waits_for_outside_memory(h: Harness) -> Check:
    import torch

    from resident_pool import Pool

    free_gb = torch.cuda.mem_get_info()[1] / 2**30
    budget = 4.0
    blocker = torch.empty(int((torch.cuda.mem_get_info()[0] / 2**30 - budget / 2) * 2**30), dtype=torch.uint8,
                          device="cuda")
    h.provider("gpu-wait", budget)
    answered: dict[str, object] = {}

    def request():
        with Pool() as pool:
            answered["result"] = pool.predict("gpu-wait", {"action": "where"})

    thread = threading.Thread(target=request)
    thread.start()
    with Pool() as pool:
        waited = _poll(lambda: [w for w in pool.waiting() if w.get("slug") == "gpu-wait"], 120)
    still_waiting = thread.is_alive()
    released = time.monotonic()
    del blocker
    torch.cuda.empty_cache()
    thread.join(timeout=300)
    admit_s = time.monotonic() - released
    ok = bool(waited) and still_waiting and "result" in answered
    return Check("waits for memory held outside the pool", ok,
                 {"device GiB": round(free_gb, 1), "budget GiB": budget, "admitted after release s": round(admit_s, 2)})


def check_placement(h: Harness) -> Check:
    from resident_pool import Pool

    with Pool() as pool:
        where = pool.predict("gpu-wait", {"action": "where"})
        row = next(w for w in pool.status()["workers"] if w["slug"] == "gpu-wait")
    ok = where["visible"] == row["device"] and where["total"] > 0
    return Check("placement: CUDA_VISIBLE_DEVICES is the admitted device", ok,
                 {"admitted": row["device"], "worker sees": where["visible"], "name": where["name"],
                  "worker free GiB": round(where["free"] / 2**30, 1)})


def check_cublas_leak(h: Harness, requests: int = 40) -> Check:
    from resident_pool import Pool

    series = {}
    for name, env in (("off", 'RESIDENT_POOL_NO_CUBLAS_RELEASE = "1"\n'), ("on", "")):
        slug = f"gpu-leak-{name}"
        h.provider(slug, 2.0)
        if env:  # the worker reads the switch from its environment
            os.environ["RESIDENT_POOL_NO_CUBLAS_RELEASE"] = "1"
        else:
            os.environ.pop("RESIDENT_POOL_NO_CUBLAS_RELEASE", None)
        h.restart_pool()
        with Pool() as pool, pool.session(slug) as session:
            series[name] = [session.predict({"action": "graph"})["allocated_before"] for _ in range(requests)]
            pool.stop(slug)
    os.environ.pop("RESIDENT_POOL_NO_CUBLAS_RELEASE", None)
    h.restart_pool()
    return leak_verdict(series["off"][1:], series["on"][1:])


def check_memory_freed_on_kill(h: Harness) -> Check:
    from resident_pool import Pool
    from resident_pool.errors import WorkerRequestError

    h.provider("gpu-hold", 6.0)
    baseline = _nvml_used()
    with Pool() as pool:
        pool.predict("gpu-hold", {"action": "hold", "gib": 4})
        pid = next(w["pid"] for w in pool.status()["workers"] if w["slug"] == "gpu-hold")
        held = _nvml_used()
        with pool.session("gpu-hold") as session:
            threading.Timer(1.0, os.kill, (pid, signal.SIGKILL)).start()
            try:
                session.predict({"action": "sleep", "seconds": 30})
            except WorkerRequestError:
                pass
        killed = time.monotonic()
        back = _poll(lambda: _nvml_used() <= baseline + 256 * MIB, 30)
        freed_s = time.monotonic() - killed
        pool.predict("gpu-hold", {"action": "hold", "gib": 4})
        pool_pid = pool.status()["pool"]["pid"]
    os.kill(pool_pid, signal.SIGKILL)
    orphaned = time.monotonic()
    orphan_back = _poll(lambda: _nvml_used() <= baseline + 256 * MIB, 60)
    ok = held - baseline >= 3.5 * 2**30 and bool(back) and bool(orphan_back)
    return Check("killed worker and killed pool give the GPU back", ok,
                 {"held GiB": round((held - baseline) / 2**30, 2), "freed after SIGKILL s": round(freed_s, 2),
                  "freed after pool SIGKILL s": round(time.monotonic() - orphaned, 2), "orphan grace s": 3})


def _smi_used_gib(pid: int) -> float | None:
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=True).stdout
    rows = [[int(x) for x in line.split(",")] for line in out.strip().splitlines() if line.strip()]
    used = [mib for p, mib in rows if p == pid]
    return sum(used) / 1024 if used else None


def check_measured_memory(h: Harness) -> Check:
    """What `status` and the metrics say a worker holds, against nvidia-smi and the declared budget."""
    from resident_pool import Pool

    budget = 3.0
    h.provider("gpu-measure", budget)
    with Pool() as pool:
        pid = pool.predict("gpu-measure", {"action": "hold", "gib": 1})["pid"]

        def row():
            return next((w for w in pool.status()["workers"] if w["slug"] == "gpu-measure"), {})

        _poll(lambda: (row().get("gpu_used_gb") or 0) >= 1, 30)  # the pool samples every 2 s
        measured, smi = row().get("gpu_used_gb"), _smi_used_gib(pid)
        pool.predict("gpu-measure", {"action": "hold", "gib": 3})  # now over its 3 GB budget
        flagged = bool(_poll(lambda: row().get("over_budget"), 30))
        pool.stop("gpu-measure")
    return measured_verdict(measured, smi, budget, flagged)


def check_minilm_on_gpu(h: Harness) -> Check:
    from resident_pool import Pool
    from resident_pool.providers.launch import worker_for
    from resident_pool.providers.manifest import load_manifest
    from resident_pool.settings import settings

    path = h.manifests / "minilm" / "manifest.toml"
    path.write_text(path.read_text().replace('policy = "none"', 'policy = "recommended"\nvram_budget_gb = 1'))
    payload = {"inputs": ["MKTAYIAKQRQISFVKSHFSRQISFVKSHFSRQ"] * 8}
    with Pool() as pool:
        pool.predict("minilm", payload)
        device = pool.predict("minilm", payload)["device"]
        held = []
        for _ in range(20):
            started = time.perf_counter()
            pool.predict("minilm", payload)
            held.append(time.perf_counter() - started)
    fresh = []
    for _ in range(2):
        worker = worker_for(load_manifest(path), replica=7, config=settings())
        started = time.perf_counter()
        try:
            worker.predict(payload)
        finally:
            worker.close()
        fresh.append(time.perf_counter() - started)
    ratio = statistics.median(fresh) / statistics.median(held)
    return Check("minilm on the GPU: held vs fresh", device == "cuda",
                 {"device": device, "held ms": round(statistics.median(held) * 1e3, 2),
                  "fresh s": round(statistics.median(fresh), 2), "fresh/held": round(ratio, 1)})


def check_hibernate(h: Harness, hold_gib: float = 2.0) -> Check:
    """Hibernate-to-first-answer against a cold start of the GPU test provider, on one device."""
    from resident_pool import Pool
    from resident_pool.admission import read_devices
    from resident_pool.providers.hibernate import CudaCheckpoint
    from resident_pool.settings import settings

    why = CudaCheckpoint(settings().libcuda).unavailable()
    if why:
        return Check("hibernate: restore vs cold start", False, {}, f"not checked: {why}", skipped=True)
    devices, _ = read_devices(settings())
    budget = round(devices[0].total_gb * 0.6, 1)  # two cannot fit: the rival makes the provider hibernate
    h.provider("gpu-hib", budget, 'evict = "hibernate"\n')
    h.provider("gpu-rival", budget)
    with Pool() as pool:
        started = time.perf_counter()
        pid = pool.predict("gpu-hib", {"action": "where"})["pid"]
        cold_s = time.perf_counter() - started
        held = pool.predict("gpu-hib", {"action": "hold", "gib": hold_gib})["allocated"]
        pool.predict("gpu-rival", {"action": "where"})
        state = next(w for w in pool.status()["workers"] if w["slug"] == "gpu-hib")
        started = time.perf_counter()
        answer = pool.predict("gpu-hib", {"action": "hold", "gib": 0})
        restore_s = time.perf_counter() - started
        pool.stop("gpu-hib")
        pool.stop("gpu-rival")
    check = hibernate_verdict(cold_s, restore_s, answer["pid"] == pid and state["state"] == "hibernated",
                              answer["allocated"], held)
    check.figures["checkpoint s"] = (state.get("hibernation") or {}).get("checkpoint_s")
    check.figures["held GiB"] = hold_gib
    return check


def main() -> int:
    present, why = gpu_present()
    if not present:
        print(f"gpu-check: no usable NVIDIA GPU here ({why}); nothing was checked")
        return 0
    h = Harness()
    checks: list[Check] = []
    steps = [check_nvml_matches_smi, lambda: check_waits_for_outside_memory(h), lambda: check_placement(h),
             lambda: check_cublas_leak(h), lambda: check_memory_freed_on_kill(h), lambda: check_measured_memory(h),
             lambda: check_minilm_on_gpu(h), lambda: check_hibernate(h)]
    try:
        for step in steps:
            try:
                checks.append(step())
            except Exception as exc:
                checks.append(Check(getattr(step, "__name__", "check"), False, {}, f"{type(exc).__name__}: {exc}"))
            print(render(checks[-1:]).splitlines()[1], flush=True)
    finally:
        h.restart_pool()
    print(render(checks))
    (ROOT / "bench" / "results").mkdir(parents=True, exist_ok=True)
    (ROOT / "bench" / "results" / "gpu-check.json").write_text(json.dumps([c.__dict__ for c in checks], indent=2))
    return 0 if all(c.ok or c.skipped for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
