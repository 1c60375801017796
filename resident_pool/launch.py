"""From a manifest to a running worker: interpreter, pinned weights, kit, command."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

from . import paths
from .exec_env import Bind, interpreter, passthrough_env, wrap
from .kit import KitRow, jit_root, kit_command, probe_kit
from .manifest import Manifest, VenvEnv
from .settings import settings
from .supervisor import PROTOCOL_PATH, Admitter, BuildCommand, ResidentWorker
from .weights import HashCache, WeightsReport, verify_weights

__all__ = ["build_worker_command", "check_weights", "command_builder", "weights_root", "worker_for"]

_LOCATE = (
    "import importlib.util, sys; s = importlib.util.find_spec(sys.argv[1]); "
    "print(next(iter(s.submodule_search_locations)))"
)


def weights_root(manifest: Manifest, python: str | None = None) -> Path | None:
    """The weights directory: the root_env variable, else root, else inside the named package."""
    spec = manifest.weights
    if spec.root_env and os.environ.get(spec.root_env):
        return Path(os.environ[spec.root_env]).expanduser()
    if spec.root:
        root = Path(spec.root).expanduser()
        return root if root.is_absolute() else manifest.directory / root
    if spec.package:
        location = _package_dir(spec.package, python)
        return Path(location) / spec.subdir if location else None
    return None


def _package_dir(package: str, python: str | None) -> str | None:
    if python is None or python == sys.executable:
        found = importlib.util.find_spec(package)
        return next(iter(found.submodule_search_locations)) if found and found.submodule_search_locations else None
    done = subprocess.run([python, "-c", _LOCATE, package], capture_output=True, text=True, timeout=120, check=False)
    return done.stdout.strip() or None


def check_weights(manifest: Manifest, python: str | None = None, cache: HashCache | None = None) -> WeightsReport:
    python = python or (interpreter(manifest) if isinstance(manifest.env, VenvEnv) else None)
    return verify_weights(manifest.slug, weights_root(manifest, python), manifest.weights.files, cache)


def work_root(manifest: Manifest) -> Path:
    if manifest.work_root:
        root = Path(manifest.work_root).expanduser()
        root = root if root.is_absolute() else manifest.directory / root
    else:
        base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
        root = Path(base) / "resident-pool" / "work" / manifest.slug
    root.mkdir(parents=True, exist_ok=True)
    return root


def build_worker_command(
    manifest: Manifest,
    socket_path: str,
    *,
    name: str | None = None,
    device: str | None = None,
    cache: HashCache | None = None,
) -> tuple[list[str], dict[str, str | None]]:
    """The argv and environment changes that start ``manifest``'s worker on ``socket_path``."""
    python = interpreter(manifest)
    local_python = python if isinstance(manifest.env, VenvEnv) else None
    root = weights_root(manifest, local_python)
    report = verify_weights(manifest.slug, root, manifest.weights.files, cache)
    if not report.ok:
        raise report.error()
    work = work_root(manifest)

    env: dict[str, str | None] = {}
    env.update(passthrough_env(getattr(manifest.env, "passthrough", None), os.environ,
                               keep=[manifest.weights.root_env] if manifest.weights.root_env else []))
    if manifest.weights.root_env and root is not None:
        env[manifest.weights.root_env] = str(root)
    config = settings()
    env["RESIDENT_POOL_ORPHAN_GRACE_S"] = f"{config.orphan_grace_s or manifest.lifecycle.orphan_grace_s:g}"
    env["RESIDENT_POOL_HEARTBEAT_STALE_S"] = f"{config.heartbeat_stale_s:g}"

    binds: list[Bind] = [(str(manifest.directory), str(manifest.directory), True),
                         (str(Path(PROTOCOL_PATH).parent), str(Path(PROTOCOL_PATH).parent), True),
                         (str(Path(socket_path).parent), str(Path(socket_path).parent), False),
                         (str(work), str(work), False)]
    if root is not None:
        binds.append((str(root), str(root), True))
    if manifest.kit is not None:
        binds.append((str(jit_root(manifest)), str(jit_root(manifest)), False))
    container_name = name or f"resident-pool-{manifest.slug}-{os.getpid()}"

    def in_env(argv, argv_env):
        return wrap(manifest, argv, argv_env, binds, name=container_name + "-probe", device=device)

    row: KitRow | None = None
    if manifest.kit is not None:
        row = probe_kit(manifest, python, env, wrap=in_env if not isinstance(manifest.env, VenvEnv) else None)
    values = {
        "socket": socket_path, "slug": manifest.slug, "weights_root": str(root or ""),
        "python": python, "kit": row.model_opt if row else "", "work_root": str(work),
    }
    script_argv = [str(manifest.worker_path), *(arg.format(**values) for arg in manifest.worker_args)]
    if row is not None:
        argv, kit_env = kit_command(manifest, row, python, script_argv)
        env.update(kit_env)
    else:
        argv = [python, *script_argv]
    return wrap(manifest, argv, env, binds, name=container_name, device=device)


def command_builder(manifest: Manifest, cache: HashCache | None = None) -> BuildCommand:
    """A ``build_command`` for ResidentWorker; weights and kit are checked at every start."""

    def build(worker: ResidentWorker) -> tuple[list[str], dict[str, str | None]]:
        return build_worker_command(
            manifest, worker.socket_path, name=f"resident-pool-{manifest.slug}-{worker.replica}-{os.getpid()}",
            device=worker.device, cache=cache,
        )

    return build


def worker_for(
    manifest: Manifest, replica: int = 0, admitter: Admitter | None = None, cache: HashCache | None = None
) -> ResidentWorker:
    """A supervised worker for one replica of ``manifest``."""
    lifecycle = manifest.lifecycle
    return ResidentWorker(
        manifest.slug,
        command_builder(manifest, cache),
        start_timeout_s=lifecycle.start_timeout_s,
        request_timeout_s=lifecycle.request_timeout_s,
        idle_timeout_s=lifecycle.idle_timeout_s,
        vram_budget_gb=manifest.gpu.vram_budget_gb if manifest.gpu.policy != "none" else None,
        manifest=manifest,
        replica=replica,
        admitter=admitter,
        state_dir=paths.state_dir(),
    )

