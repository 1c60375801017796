"""Optimization kits: what the kit's environment holds, the probe's answer, and the start rules.

The launch plan builds on these; the kit launcher's public face (``resident_pool.kit``) sits above it.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import KitUnavailable
from ..exits import exit_hint
from ..host.procs import child_env
from . import jit_cache
from .manifest import Kit, Manifest

__all__ = ["KIT_PROBE_TIMEOUT_S", "PROBE_PATH", "KitRow", "apply_row", "jit_root", "jit_root_is_default", "kit_env",
           "run_probe", "stray_variables"]

PROBE_PATH = str(Path(__file__).parent.parent / "kit_probe.py")
# As the original design had it: a probe imports the kit's stack in a cold interpreter.
KIT_PROBE_TIMEOUT_S = 180.0
REFUSAL_EXIT = 3
# docker/podman: 125 the engine failed, 126 not executable, 127 not found; apptainer: 255.
ENGINE_FAILURES = frozenset({125, 126, 127, 255})


@dataclass(frozen=True)
class KitRow:
    """What the kit said about itself, as the probe printed it."""

    data: dict[str, Any]

    def __getattr__(self, name: str) -> Any:
        try:
            return self.data[name]
        except KeyError:
            raise AttributeError(name) from None

    @property
    def env(self) -> dict[str, str]:
        merged = dict(self.data.get("row") or {})
        for extra in (self.data.get("extra_rows") or {}).values():
            merged.update(extra)
        return merged


def stray_variables(package: str, environ: Mapping[str, str], declared: set[str]) -> dict[str, None]:
    """``<PACKAGE>_*`` names not declared: a kit that polices its namespace refuses them."""
    prefix = package.upper() + "_"
    return {name: None for name in environ if name.startswith(prefix) and name not in declared}


def jit_root(manifest: Manifest, environ: Mapping[str, str], cache_dir: Path) -> Path:
    """The JIT cache: ``[kit] jit_root``, else ``$MODEL_OPT_JIT_ROOT`` as is, else one per provider.

    A warm cache took one provider's first prediction from 42 s to 12 s, so it
    outlives the worker; the default sits in the pool's cache folder ``cache_dir`` (``Paths.cache``).
    """
    assert manifest.kit is not None
    if manifest.kit.jit_root:
        return Path(manifest.kit.jit_root).expanduser()
    if environ.get("MODEL_OPT_JIT_ROOT"):
        return Path(environ["MODEL_OPT_JIT_ROOT"])
    return jit_cache.default_root(cache_dir, manifest.slug)


def jit_root_is_default(manifest: Manifest, environ: Mapping[str, str]) -> bool:
    """Whether the JIT root is the pool's own (one folder per stack key inside), not one the user named."""
    return manifest.kit is not None and not manifest.kit.jit_root and not environ.get("MODEL_OPT_JIT_ROOT")


def _declared(kit: Kit) -> set[str]:
    return set(kit.env) | ({kit.mode_env} if kit.mode_env else set())


def kit_env(manifest: Manifest, environ: Mapping[str, str], jit: Path) -> dict[str, str | None]:
    """The kit's share of the environment the probe and the worker both run under.

    ``MODEL_OPT`` is set only when given (``[kit] model_opt``, else exported);
    otherwise the probe derives the kit tree. Undeclared ``<PACKAGE>_*`` names are
    removed: a kit that polices its namespace refuses to start beside them.
    ``MODEL_OPT_LEVERS_OFF`` is set only when a lever is off (removed otherwise):
    a kit reads it, even empty, as an ablation and reports a PARTIAL activation.
    """
    kit = manifest.kit
    assert kit is not None
    env: dict[str, str | None] = dict(stray_variables(kit.package_name, environ, _declared(kit)))
    if kit.model_opt:
        env["MODEL_OPT"] = str(Path(kit.model_opt).expanduser())
    elif environ.get("MODEL_OPT"):
        env["MODEL_OPT"] = environ["MODEL_OPT"]
    env.update(kit.env)
    env["MODEL_OPT_LEVERS_OFF"] = ",".join(kit.levers_off) if kit.levers_off else None
    env["MODEL_OPT_JIT_ROOT"] = str(jit)
    return env


def run_probe(
    manifest: Manifest | None,
    python: str,
    argv: list[str],
    env: Mapping[str, str | None],
    *,
    package: str | None = None,
    environ: Mapping[str, str] | None = None,
    on_timeout: Callable[[], None] | None = None,
) -> KitRow:
    """Run the probe command (already wrapped for the engine) and read its ``KITROW`` line.

    ``manifest`` None: a probe of ``package`` asked for directly (``ask_kit`` with an interpreter).
    """
    if manifest is not None:
        assert manifest.kit is not None
        package = manifest.kit.package_name
    assert package is not None
    who = manifest.slug if manifest is not None else python
    slug = manifest.slug if manifest is not None else None
    try:
        done = subprocess.run(
            argv, env=child_env(env, environ), stdin=subprocess.DEVNULL, capture_output=True,
            text=True, timeout=KIT_PROBE_TIMEOUT_S, check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        if on_timeout is not None and isinstance(exc, subprocess.TimeoutExpired):
            on_timeout()
        raise KitUnavailable(f"{who}: the probe of kit {package} could not run: {exc}", slug=slug) from exc
    for line in done.stdout.splitlines():
        if line.startswith("KITROW "):
            return KitRow(json.loads(line[len("KITROW "):]))
    tail = (done.stdout + done.stderr).strip().splitlines()[-10:]
    refusal = next((line.strip() for line in reversed(tail) if "REFUSED" in line), None)
    engine = getattr(manifest.env, "engine", None) if manifest is not None else None
    if engine and done.returncode in ENGINE_FAILURES:
        message = (f"{who}: {engine} could not run the probe of kit {package} in its container "
                   f"(exit {done.returncode}); check [env] image, python and binds in {manifest.path}")
    elif done.returncode == REFUSAL_EXIT or refusal:
        # The kit is there and policing its conditions: asking whether it is installed would mislead.
        said = refusal or (tail[-1].strip() if tail else "no output")
        message = (f"{who}: kit {package} refused to start in the probe (exit "
                   f"{done.returncode}: {exit_hint(done.returncode)}): {said}")
    else:
        message = (f"{who}: kit {package} gave no KITROW line (probe exited "
                   f"{done.returncode}); is it installed in {python}?")
    raise KitUnavailable(
        message + "; last lines:\n    " + "\n    ".join(tail),
        slug=slug, exit_code=done.returncode, transcript_tail=tail,
    )


def _unavailable(manifest: Manifest, problem: str) -> KitUnavailable:
    assert manifest.kit is not None
    return KitUnavailable(f"{manifest.slug}: kit {manifest.kit.package_name}: {problem}", slug=manifest.slug)


def apply_row(
    manifest: Manifest, row: KitRow, python: str, script_argv: list[str], env: Mapping[str, str | None]
) -> tuple[list[str], dict[str, str | None]]:
    """The start rules, then the worker's argv and ``env`` (the probe's) with the row applied."""
    kit = manifest.kit
    assert kit is not None
    if row.data.get("model_opt") is None:
        raise _unavailable(manifest, row.data.get("model_opt_error") or "the probe found no kit tree; "
                           "export MODEL_OPT or set [kit] model_opt to the kit's tree")
    noted = "; the probe noted: " + "; ".join(row.errors) if row.data.get("errors") else ""
    if not row.env and kit.env_row != "none":
        raise _unavailable(
            manifest, f"exported an empty environment row for mode {kit.mode!r}{noted}; fix the kit, or declare "
            f'env_row = "none" with env_row_reason in {manifest.path}',
        )
    worker_launch = row.activation == "worker_launch"
    if row.mode_env is None and not worker_launch:
        raise _unavailable(
            manifest, 'has no mode variable (ENV or ENV_MODE), so it cannot engage by autoload; this provider '
            f'belongs in mode = "subprocess" (with mode_reason){noted}',
        )
    if worker_launch and row.launch_opts is None:
        raise _unavailable(manifest, row.data.get("launch_opts_error") or "gave no launch_opts")
    merged: dict[str, str | None] = {**env, **row.env, "MODEL_OPT": row.model_opt}
    if row.jit_cache_key:
        merged["MODEL_OPT_STACK_KEY"] = row.jit_cache_key
    # What the manifest declares wins over the kit's row.
    for name in (*kit.env, "MODEL_OPT_LEVERS_OFF", "MODEL_OPT_JIT_ROOT"):
        merged[name] = env[name]
    if row.mode_env:
        # worker_launch arms the kit's own hook; the mode variable would arm it a second time.
        merged[row.mode_env] = None if worker_launch else kit.mode
    if worker_launch:
        argv = [python, "-m", f"{kit.package_name}.worker_launch", *row.launch_opts, "--", *script_argv]
    else:
        argv = [python, *script_argv]
    return argv, merged
