"""The kit launcher: ask an optimization kit how it wants to run, and build a worker's command under it.

The original design's launcher API over this project's launch plan: ``kit_package(manifest)``,
``ask_kit(python, package, mode, levers_off)`` and ``build_command(worker)`` for a standalone
``ResidentWorker``. The probe's answer and the start rules live in ``kit_rules``; the plan
that applies them to one start in ``launch``.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from typing import Any

from ..errors import KitUnavailable, ManifestError
from ..host.paths import Paths
from ..settings import Settings
from .kit_rules import (
    KIT_PROBE_TIMEOUT_S,
    PROBE_PATH,
    KitRow,
    apply_row,
    jit_root,
    jit_root_is_default,
    kit_env,
    run_probe,
    stray_variables,
)
from .launch import LaunchPlan, command_builder
from .manifest import Kit, Manifest
from .worker_process import Launch

__all__ = ["KIT_PROBE_TIMEOUT_S", "PROBE_PATH", "KitRow", "KitUnavailable", "apply_row", "ask_kit", "build_command",
           "jit_root", "jit_root_is_default", "kit_env", "kit_package", "run_probe", "stray_variables"]


def kit_package(manifest: Manifest) -> str:
    """The kit's package: ``[kit] package``, else ``<name or subdir>_opt``, else ``<slug>_opt``."""
    return manifest.kit.package_name if manifest.kit is not None else f"{manifest.slug}_opt"


def ask_kit(
    python_or_env: str | os.PathLike[str] | Manifest, package: str, mode: str, levers_off: Sequence[str] = (), *,
    config: Settings | None = None,
) -> dict[str, Any]:
    """The kit's launch options and environment row, as its probe reads them in the kit's own interpreter.

    ``python_or_env``: an interpreter on this host, or a provider's manifest (the probe then runs
    where and as its worker would: its environment, its container). ``levers_off`` is
    ``MODEL_OPT_LEVERS_OFF`` in the probe's environment, and undeclared ``<PACKAGE>_*`` names are
    removed from it: the kit sees what the worker will. The answer is the ``KITROW`` with the
    original design's keys beside this project's (``env``, ``opts``, ``stack_key``,
    ``row_source``/``row_error``); no ``KITROW`` line raises ``KitUnavailable`` quoting the probe. A manifest's
    probe is planned as its worker's start is, under ``config`` (the pool's settings: ``settings()``).
    """
    if isinstance(python_or_env, Manifest):
        if config is None:
            raise TypeError("ask_kit(manifest, ...) plans the probe as the pool would start the worker: pass "
                            "config=resident_pool.settings.settings()")
        kit = (python_or_env.kit or Kit(package=package)).model_copy(
            update={"package": package, "mode": mode, "levers_off": list(levers_off)})
        manifest = python_or_env.model_copy(update={"kit": kit})
        with tempfile.TemporaryDirectory(prefix="rp-ask-") as run_dir:
            row = LaunchPlan.resolve(manifest, os.path.join(run_dir, "worker.sock"), config=config,
                                     paths=Paths.of(config)).probe()
    else:
        python = os.fspath(python_or_env)
        env: dict[str, str | None] = dict(stray_variables(package, os.environ, set()))
        env["MODEL_OPT_LEVERS_OFF"] = ",".join(str(lever) for lever in levers_off) if levers_off else None
        row = run_probe(None, python, [python, PROBE_PATH, package, mode], env, package=package)
    return _with_original_keys(row)


def _with_original_keys(row: KitRow) -> dict[str, Any]:
    answer = {**row.data, "env": row.env, "opts": list(row.launch_opts or [])}
    if row.jit_cache_key:
        answer["stack_key"] = row.jit_cache_key
    if row.resolve_shape:
        answer["row_source"] = row.resolve_shape
    elif row.data.get("errors"):
        answer["row_error"] = "; ".join(row.errors)
    return answer


def build_command(worker: Any) -> Launch:
    """``(argv, extra_env)`` for ``worker``, from ``worker.manifest``: a ``build_command`` for ``ResidentWorker``.

    Weights are verified and the kit probed at every start, as under the pool, with the worker's own settings and
    folders (``worker.config``, ``worker.paths``). The answer is a ``Launch``; it unpacks as the original's pair
    (``argv, env = build_command(w)``).
    """
    manifest = getattr(worker, "manifest", None)
    if not isinstance(manifest, Manifest):
        slug = getattr(worker, "slug", "?")
        raise ManifestError(f"{slug}: build_command builds a worker's command from its manifest, and this worker "
                            "has none; pass manifest=load_manifest(path) to ResidentWorker", slug=slug)
    return command_builder(manifest, worker.config, worker.paths)(worker)
