"""Optimization kits: probe the kit in the provider's interpreter, then build its worker command."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import KitUnavailable
from .manifest import Kit, Manifest
from .procs import child_env

__all__ = ["PROBE_PATH", "KitRow", "jit_root", "kit_command", "probe_kit", "stray_variables"]

PROBE_PATH = str(Path(__file__).with_name("kit_probe.py"))
PROBE_TIMEOUT_S = 300.0

Wrap = Callable[[list[str], Mapping[str, str | None]], tuple[list[str], Mapping[str, str | None]]]


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


def jit_root(manifest: Manifest) -> Path:
    """A persistent JIT cache per provider: a warm one took a provider's first prediction from 42 s to 12 s."""
    assert manifest.kit is not None
    if manifest.kit.jit_root:
        return Path(manifest.kit.jit_root).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "resident-pool" / "jit" / manifest.slug


def _declared(kit: Kit) -> set[str]:
    return set(kit.env) | ({kit.mode_env} if kit.mode_env else set())


def probe_kit(manifest: Manifest, python: str, env: Mapping[str, str | None], wrap: Wrap | None = None) -> KitRow:
    """Run the KITROW probe in the provider's interpreter, under the worker's conditions."""
    kit = manifest.kit
    assert kit is not None
    probe_env = {
        **env,
        "MODEL_OPT_LEVERS_OFF": ",".join(kit.levers_off),
        **stray_variables(kit.package_name, child_env(env), _declared(kit)),
    }
    argv = [python, PROBE_PATH, kit.package_name, kit.mode]
    if wrap is not None:
        argv, probe_env = wrap(argv, probe_env)
    try:
        done = subprocess.run(
            argv, env=child_env(probe_env), stdin=subprocess.DEVNULL, capture_output=True,
            text=True, timeout=PROBE_TIMEOUT_S, check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise KitUnavailable(
            f"{manifest.slug}: the probe of kit {kit.package_name} could not run: {exc}",
            slug=manifest.slug,
        ) from exc
    for line in done.stdout.splitlines():
        if line.startswith("KITROW "):
            return KitRow(json.loads(line[len("KITROW "):]))
    tail = (done.stdout + done.stderr).strip().splitlines()[-10:]
    raise KitUnavailable(
        f"{manifest.slug}: kit {kit.package_name} gave no KITROW line (probe exited {done.returncode}); "
        f"is it installed in {python}? last lines:\n    " + "\n    ".join(tail),
        slug=manifest.slug, exit_code=done.returncode, transcript_tail=tail,
    )


def kit_command(
    manifest: Manifest, row: KitRow, python: str, script_argv: list[str], environ: Mapping[str, str] | None = None
) -> tuple[list[str], dict[str, str | None]]:
    """The worker's argv and the environment the kit needs, from its probed row."""
    kit = manifest.kit
    assert kit is not None
    env: dict[str, str | None] = {}
    if not row.env and kit.env_row != "none":
        raise KitUnavailable(
            f"{manifest.slug}: kit {kit.package_name} exported an empty environment row for mode "
            f"{kit.mode!r}; fix the kit, or declare env_row = \"none\" with env_row_reason in {manifest.path}",
            slug=manifest.slug,
        )
    if row.mode_env is None and row.activation == "autoload":
        raise KitUnavailable(
            f"{manifest.slug}: kit {kit.package_name} has no mode variable (ENV or ENV_MODE), so it cannot "
            f'engage by autoload; this provider belongs in mode = "subprocess" (with mode_reason)',
            slug=manifest.slug,
        )
    declared = _declared(kit) | ({row.mode_env} if row.mode_env else set())
    env.update(stray_variables(kit.package_name, os.environ if environ is None else environ, declared))
    env.update(row.env)
    env["MODEL_OPT"] = row.model_opt
    if row.mode_env:
        env[row.mode_env] = kit.mode
    if row.jit_cache_key:
        env["MODEL_OPT_STACK_KEY"] = row.jit_cache_key
    env.update(kit.env)
    env["MODEL_OPT_LEVERS_OFF"] = ",".join(kit.levers_off)
    root = jit_root(manifest)
    root.mkdir(parents=True, exist_ok=True)
    env["MODEL_OPT_JIT_ROOT"] = str(root)
    if row.activation == "worker_launch":
        argv = [python, "-m", f"{kit.package_name}.worker_launch", *row.launch_opts, "--", *script_argv]
    else:
        argv = [python, *script_argv]
    return argv, env
