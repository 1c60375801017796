"""How a provider's worker is executed: a Python interpreter here, or a container engine."""

from __future__ import annotations

import os
import secrets
import shutil
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import NamedTuple

from ..errors import ManifestError, WorkerStartError
from ..host.trust import check_trusted
from .manifest import ContainerEnv, Manifest, VenvEnv

__all__ = [
    "BASE_PREFIXES",
    "BASE_VARIABLES",
    "THREAD_VARIABLES",
    "Bind",
    "container_name",
    "engine_controls",
    "interpreter",
    "parse_bind",
    "passthrough_env",
    "wrap",
]

# The fixed base every worker gets from the pool's environment; anything else only when a
# manifest names it. What a worker sees must not depend on which client started the pool.
# The pool's thread limits reach its workers: a pool started under a CPU limit (a batch job's cores, a container's
# quota, a shared host) keeps its workers within it; torch and BLAS otherwise start a thread per core.
THREAD_VARIABLES = frozenset({"OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"})
BASE_VARIABLES = THREAD_VARIABLES | {"PATH", "HOME", "USER", "LOGNAME", "LANG", "TMPDIR", "TZ", "LD_LIBRARY_PATH"}
BASE_PREFIXES = ("LC_", "XDG_", "CUDA_", "NVIDIA_", "RESIDENT_POOL_")
# Engine variables a pool may have in its own environment; they would be injected into every container.
_ENGINE_PREFIXES = ("APPTAINERENV_", "SINGULARITYENV_")
# Extra host folders apptainer mounts into every container, read from its own environment.
_ENGINE_BINDS = ("APPTAINER_BIND", "APPTAINER_BINDPATH", "SINGULARITY_BIND", "SINGULARITY_BINDPATH")


class Bind(NamedTuple):
    """A host path mounted at ``inside``; ``field`` names where it came from, for errors."""

    host: str
    inside: str
    read_only: bool
    field: str = "env.binds"


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
        if spec.python != "auto":  # the pool's own needs no check: it is already running
            # The path as named and, through every link on it, the binary it reaches.
            check_trusted(Path(python), "the interpreter", manifest.slug, "env.python")
        return python
    if shutil.which(spec.engine) is None:
        raise WorkerStartError(
            f"{manifest.slug}: container engine {spec.engine} is not on PATH; install it or choose "
            f"another [env] engine in {manifest.path}",
            slug=manifest.slug, reason="interpreter_missing",
        )
    return spec.python


def passthrough_env(
    allowed: Sequence[str] | str | None, environ: Mapping[str, str], keep: Sequence[str] = ()
) -> dict[str, None]:
    """Names of ``environ`` to remove so a venv worker gets the fixed base, ``allowed`` and ``keep`` only.

    ``allowed == "*"`` keeps everything: an explicit opt-in in the manifest.
    """
    if allowed == "*":
        return {}
    kept = BASE_VARIABLES | set(allowed or ()) | set(keep)
    return {name: None for name in environ if name not in kept and not name.startswith(BASE_PREFIXES)}


def container_name(slug: str, replica: int | str) -> str:
    """A name for one start: a stopped container's name may linger in the engine a while."""
    return f"resident-pool-{slug}-{replica}-{secrets.token_hex(4)}"


def engine_controls(manifest: Manifest, name: str) -> tuple[list[str], list[str]] | None:
    """``(stop_argv, kill_argv)`` that reach the container ``name``; None where the process group does.

    A docker or podman container is not a child of the ``run`` client: a SIGKILL
    of the client leaves it running, holding its GPU. Apptainer's container is
    the process the pool started, so signalling its group is enough.
    """
    spec = manifest.env
    if not isinstance(spec, ContainerEnv) or spec.engine == "apptainer":
        return None
    return [spec.engine, "stop", name], [spec.engine, "kill", name]


def parse_bind(text: str) -> Bind:
    """``host[:container][:ro]`` from ``[env] binds``."""
    parts = text.split(":")
    read_only = parts[-1] == "ro"
    if parts[-1] in ("ro", "rw") and len(parts) > 1:
        parts = parts[:-1]
    host = str(Path(parts[0]).expanduser())
    return Bind(host, parts[1] if len(parts) > 1 else host, read_only, "env.binds")


def _refuse_unsafe(manifest: Manifest, binds: Iterable[Bind]) -> None:
    for bind in binds:
        for path in (bind.host, bind.inside):
            if "," in path or ":" in path:
                raise ManifestError(
                    f"{manifest.path}: {bind.field}: the path {path} holds ',' or ':', which a container "
                    "engine's bind syntax cannot carry; use a path without them",
                    slug=manifest.slug, details={"field": bind.field},
                )


def _gpu_flags(engine: str, device: str | None) -> list[str]:
    devices = [d.strip() for d in (device or "all").split(",") if d.strip()]
    if engine == "docker":
        # docker reads a bare comma as the start of another option: a list goes in quotes.
        return ["--gpus", f"device={devices[0]}" if len(devices) == 1 else '"device=' + ",".join(devices) + '"']
    flags = []
    for one in devices:
        flags += ["--device", f"nvidia.com/gpu={one}"]  # CDI names the devices podman may pass
    return flags


def wrap(
    manifest: Manifest,
    argv: Sequence[str],
    env: Mapping[str, str | None],
    binds: Sequence[Bind | tuple[str, str, bool]],
    *,
    name: str,
    device: str | None = None,
    environ: Mapping[str, str] | None = None,
    workdir: str | None = None,
) -> tuple[list[str], dict[str, str | None]]:
    """The command that runs ``argv`` in the provider's environment, and what its launcher's environment needs.

    A container sees only what is passed by name (docker/podman ``--env NAME``,
    apptainer ``APPTAINERENV_NAME``, so values never appear in the process list)
    and only the ``binds``, each at the same path inside, so nothing is rewritten. ``workdir`` (a
    mounted folder: the work root) is where it runs inside, not wherever the image or engine would put it.
    """
    spec = manifest.env
    if isinstance(spec, VenvEnv):
        return list(argv), dict(env)
    environ = os.environ if environ is None else environ
    all_binds = [Bind(*bind) for bind in binds] + [parse_bind(text) for text in spec.binds]
    _refuse_unsafe(manifest, all_binds)
    for text in spec.binds:  # a start would fail on it in the engine, late and less clearly
        host = parse_bind(text).host
        if not os.path.exists(host):
            raise ManifestError(f"{manifest.path}: env.binds: {host} does not exist on this host; create it or "
                                "fix the bind", slug=manifest.slug, details={"field": "env.binds"})
    inside = {key: value for key, value in env.items() if value is not None}
    # Placed on the CPU (a "recommended" provider on a host without a free GPU: device ""): ask the
    # engine for no GPU, or `docker run --gpus` fails outright on a host that has none.
    gpu = manifest.gpu.policy != "none" and device != ""
    if spec.engine == "apptainer":
        # --containall: besides a clean environment and no shared $HOME or /tmp, its own PID and IPC
        # namespaces; in the host's, /proc/<the pool's pid>/root is the host's whole filesystem.
        command = ["apptainer", "exec", "--containall"]
        if gpu:
            command.append("--nv")  # every GPU; CUDA_VISIBLE_DEVICES inside picks the admitted one
        if workdir:
            command += ["--pwd", workdir]
        for bind in all_binds:
            command += ["--bind", f"{bind.host}:{bind.inside}" + (":ro" if bind.read_only else "")]
        command += [spec.image, *argv]
        outer: dict[str, str | None] = {name: None for name in environ
                                        if name.startswith(_ENGINE_PREFIXES) or name in _ENGINE_BINDS}
        outer.update({f"APPTAINERENV_{key}": value for key, value in inside.items()})
        return command, outer
    # No capabilities and no gaining any through a setuid binary in the image: the worker needs none.
    command = [spec.engine, "run", "--rm", "--init", "--name", name, "--network", "none", "--cap-drop", "ALL",
               "--security-opt", "no-new-privileges"]
    # podman (rootless) maps the user's uid into the container, so files in the binds stay the user's.
    command += ["--user", f"{os.getuid()}:{os.getgid()}"] if spec.engine == "docker" else ["--userns=keep-id"]
    for bind in all_binds:
        command += ["--volume", f"{bind.host}:{bind.inside}" + (":ro" if bind.read_only else "")]
    for key in sorted(inside):
        if key != "CUDA_VISIBLE_DEVICES":  # the GPU flags choose it; inside, it is the container's device 0
            command += ["--env", key]  # the value comes from the engine client's environment
    if gpu:
        command += _gpu_flags(spec.engine, device)
    if workdir:
        command += ["--workdir", workdir]
    command += [spec.image, *argv]
    return command, inside
