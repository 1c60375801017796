"""What produced a check's answer: the model's environment, the GPU and the host, as name -> text."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
from collections import Counter
from pathlib import Path

from ..host.procs import child_env
from ..providers.exec_env import Bind, container_name, engine_controls, passthrough_env, wrap
from ..providers.kit_rules import stray_variables
from ..providers.manifest import Manifest, VenvEnv

__all__ = ["ENV_PROBE_PATH", "KEY_PACKAGES", "columns", "environment", "gpu", "host", "own_version"]

ENV_PROBE_PATH = str(Path(__file__).parent.parent / "env_probe.py")
PROBE_TIMEOUT_S = 120.0
# Distributions whose versions decide a model's numerics; those not installed are left out.
KEY_PACKAGES = ("torch", "numpy", "triton", "jax", "jaxlib", "transformers", "sentence-transformers",
                "nvidia-cuda-runtime-cu12", "nvidia-cudnn-cu12", "nvidia-cublas-cu12")


def host() -> str:
    return os.uname().nodename


def own_version() -> str:
    try:
        return importlib.metadata.version("resident-pool")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed as a distribution)"


def environment(manifest: Manifest, python: str) -> dict[str, str]:
    """Interpreter and key package versions, asked in the provider's own interpreter."""
    packages = [*KEY_PACKAGES, *([manifest.weights.package] if manifest.weights.package else [])]
    # The worker's environment, not this command's: the fixed base and the manifest's passthrough
    # (a PYTHONPATH here must not make the probe see packages the worker never sees).
    env: dict[str, str | None] = {}
    if isinstance(manifest.env, VenvEnv):
        env.update(passthrough_env(manifest.env.passthrough, os.environ))
    if manifest.kit is not None:  # a kit that polices its namespace would refuse the probe beside a stray name
        env.update(stray_variables(manifest.kit.package_name, os.environ, set(manifest.kit.env)))
    name = container_name(manifest.slug, "env")
    argv, env = wrap(manifest, [python, ENV_PROBE_PATH, *packages], env,
                     [Bind(ENV_PROBE_PATH, ENV_PROBE_PATH, True, "resident_pool's env_probe.py")], name=name)
    try:
        done = subprocess.run(argv, env=child_env(env), stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=PROBE_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired as exc:
        controls = engine_controls(manifest, name)
        if controls:  # the engine's client died alone; its container would run on
            subprocess.run(controls[1], capture_output=True, timeout=60, check=False)
        return {"env.error": f"the environment probe did not finish in {python}: {exc}"}
    except OSError as exc:
        return {"env.error": f"the environment probe could not run in {python}: {exc}"}
    row = next((json.loads(line[len("ENVROW "):]) for line in done.stdout.splitlines() if line.startswith("ENVROW ")),
               None)
    if row is None:
        tail = " | ".join((done.stdout + done.stderr).strip().splitlines()[-3:])
        return {"env.error": f"the environment probe in {python} exited {done.returncode} without a report: {tail}"}
    installed = {name: version for name, version in row["packages"].items() if version}
    torch = row.get("torch") or {}
    if torch.get("cuda"):
        cuda = f"CUDA {torch['cuda']} (torch build)"
    elif torch.get("hip"):
        cuda = f"none: ROCm/HIP {torch['hip']} (torch build)"
    elif torch:
        cuda = "none: a CPU build of torch"
    elif installed.get("nvidia-cuda-runtime-cu12"):
        cuda = f"CUDA {installed['nvidia-cuda-runtime-cu12']} (nvidia-cuda-runtime-cu12)"
    else:
        cuda = "unknown: torch is not installed"
    return {
        "env.python": f"{row['implementation']} {row['python']}",
        "env.executable": row["executable"],
        "env.platform": row["platform"],
        "env.torch": torch.get("version") or installed.get("torch") or "not installed",
        "env.cuda_runtime": cuda,
        "env.packages": ", ".join(f"{name} {version}" for name, version in installed.items() if name != "torch")
        or "none of the key packages",
    }


def _names(fake: Path | None) -> tuple[list[str], str]:
    """Each GPU's name by index, and the driver: from NVML, or the fake readings tests and drills use (``fake``:
    RESIDENT_POOL_FAKE_NVML)."""
    if not fake:
        return _nvml()
    try:
        data = json.loads(Path(fake).read_text())
        return ([str(d.get("name", f"fake GPU ({d['total_gb']} GB)")) for d in data["devices"]],
                str(data.get("driver", "fake")))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"fake NVML readings {fake} unreadable ({exc})") from None


def gpu_name(index: int, fake_nvml: Path | None) -> str | None:
    """The name of GPU ``index`` (as admission numbers them), or None where it cannot be read."""
    try:
        names, _ = _names(fake_nvml)
    except ValueError:
        return None
    return names[index] if 0 <= index < len(names) else None


def gpu(fake_nvml: Path | None) -> dict[str, str]:
    """The host's GPUs and driver, from NVML (or the fake readings ``fake_nvml``); ``cpu`` where there is none."""
    try:
        names, driver = _names(fake_nvml)
    except ValueError as exc:
        return {"gpu": f"unknown: {exc}", "gpu.driver": "unknown"}
    if not names:
        return {"gpu": "cpu", "gpu.driver": driver or "none: NVML is not readable here"}
    counts = Counter(names)
    return {"gpu": ", ".join(f"{name} x{count}" for name, count in counts.items()), "gpu.driver": driver}


def _nvml() -> tuple[list[str], str]:
    try:
        import pynvml
    except ImportError:
        return [], ""
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return [], ""
    try:
        driver = pynvml.nvmlSystemGetDriverVersion()
        names = [pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(i))
                 for i in range(pynvml.nvmlDeviceGetCount())]
    except pynvml.NVMLError as exc:
        return [], f"unknown: NVML answered {exc}"
    finally:
        pynvml.nvmlShutdown()
    return [n.decode() if isinstance(n, bytes) else str(n) for n in names], (
        driver.decode() if isinstance(driver, bytes) else str(driver))


def columns(values: dict[str, str]) -> dict[str, str]:
    """Provenance in a few short columns for tables: manifest, weights, kit, environment, gpu, host."""
    if "kit.package" in values:
        activation = f" ({values['kit.activation']})" if "kit.activation" in values else ""
        kit = (f"{values['kit.package']} {values.get('kit.version', '?')} mode {values['kit.mode']}{activation}, "
               f"jit key {values.get('kit.jit_cache_key', '?')}; said: {values.get('kit.active', 'nothing yet')}")
        if "stock.kit.mode" in values:
            kit += f"; stock: {values['stock.kit.mode']}, said: {values.get('stock.kit.active', 'nothing')}"
    else:
        kit = values.get("kit", "unknown")
    environment = "unknown"
    if "env.error" in values:
        environment = values["env.error"]
    elif "env.python" in values:
        environment = (f"{values['env.python']}, torch {values.get('env.torch', '?')} "
                       f"({values.get('env.cuda_runtime', '?')})")
        if values.get("env.packages"):
            environment += f"; {values['env.packages']}"
    gpu = "unknown"
    if "gpu" in values:
        gpu = f"{values['gpu']} (driver {values.get('gpu.driver', '?')})"
        if "gpu.device" in values:
            gpu += f"; answered on {values['gpu.device']}"
    return {
        "manifest": values.get("manifest.fingerprint", "unknown"),
        "weights": values.get("weights.pins", "unknown"),
        "kit": kit,
        "environment": environment,
        "gpu": gpu,
        "expected": values.get("smoke.expected", ""),
        "host": values.get("host", "unknown"),
    }
