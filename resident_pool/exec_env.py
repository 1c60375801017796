"""How a provider's worker is executed: a Python interpreter here, or a container."""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from .errors import WorkerStartError
from .manifest import ContainerEnv, Manifest, VenvEnv

__all__ = ["ESSENTIAL_VARIABLES", "Bind", "interpreter", "passthrough_env", "wrap"]

# What any interpreter needs to start, kept even under a passthrough allow-list.
ESSENTIAL_VARIABLES = frozenset({"PATH", "HOME", "USER", "LOGNAME", "LANG", "LC_ALL", "LC_CTYPE", "TMPDIR", "TZ"})

Bind = tuple[str, str, bool]  # host path, container path, read-only


def interpreter(manifest: Manifest) -> str:
    """The interpreter as the worker's command names it; checked where it can be."""
    spec = manifest.env
    if isinstance(spec, VenvEnv):
        python = sys.executable if spec.python == "auto" else spec.python
        if not (os.path.isfile(python) and os.access(python, os.X_OK)):
            raise WorkerStartError(
                f"{manifest.slug}: interpreter {python} does not exist or is not executable; "
                f"fix [env] python in {manifest.path} or create that environment",
                slug=manifest.slug, reason="interpreter_missing",
            )
        return python
    if shutil.which(spec.engine) is None:
        raise WorkerStartError(
            f"{manifest.slug}: container engine {spec.engine} is not on PATH; install it or choose "
            f"another [env] engine in {manifest.path}",
            slug=manifest.slug, reason="interpreter_missing",
        )
    return spec.python


def passthrough_env(
    allowed: Sequence[str] | None, environ: Mapping[str, str], keep: Sequence[str] = ()
) -> dict[str, None]:
    """Names of ``environ`` to remove so only ``allowed`` (and essentials) reach the worker."""
    if allowed is None:
        return {}
    kept = set(allowed) | ESSENTIAL_VARIABLES | set(keep)
    return {name: None for name in environ if name not in kept and not name.startswith("RESIDENT_POOL_")}


def wrap(
    manifest: Manifest,
    argv: list[str],
    env: Mapping[str, str | None],
    binds: Sequence[Bind],
    *,
    name: str,
    device: str | None = None,
) -> tuple[list[str], dict[str, str | None]]:
    """The command that runs ``argv`` in the provider's environment, and its environment.

    Containers bind every path at the same place inside, so the socket, the
    script and the weights keep their host paths and nothing needs rewriting.
    """
    spec = manifest.env
    if isinstance(spec, VenvEnv):
        return list(argv), dict(env)
    assert isinstance(spec, ContainerEnv)
    gpu = manifest.gpu.policy != "none"
    all_binds = [*binds, *(_parse_bind(text) for text in spec.binds)]
    if spec.engine == "apptainer":
        command = ["apptainer", "exec", "--cleanenv"]
        if gpu:
            command.append("--nv")
        for host, inside, read_only in all_binds:
            command += ["--bind", f"{host}:{inside}" + (":ro" if read_only else "")]
        command += [spec.image, *argv]
        # --cleanenv drops the host's environment; APPTAINERENV_ names are set
        # inside, so values never appear in the process list.
        outer = {f"APPTAINERENV_{key}": value for key, value in env.items() if value is not None}
        return command, outer
    command = [spec.engine, "run", "--rm", "--init", "--name", name, "--network", "none",
               "--user", f"{os.getuid()}:{os.getgid()}"]
    for host, inside, read_only in all_binds:
        command += ["--volume", f"{host}:{inside}" + (":ro" if read_only else "")]
    for key in sorted(key for key, value in env.items() if value is not None):
        command += ["--env", key]  # the value comes from the engine client's environment
    if gpu and device is not None:
        if spec.engine == "docker":
            command += ["--gpus", f"device={device}"]
        else:
            command += ["--device", f"nvidia.com/gpu={device}"]
    command += [spec.image, *argv]
    return command, dict(env)


def _parse_bind(text: str) -> Bind:
    parts = text.split(":")
    read_only = parts[-1] == "ro"
    if read_only:
        parts = parts[:-1]
    host = parts[0]
    inside = parts[1] if len(parts) > 1 else host
    return str(Path(host).expanduser()), inside, read_only
