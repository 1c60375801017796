"""From a manifest to a running worker: one launch plan, then wrapped for its engine in one step.

The plan resolves the manifest once (interpreter, weights root verified, work
and JIT roots, the environment with its removals, the binds); the kit's probe
and the worker are both built from it, so they see the same conditions.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

from ..errors import ManifestError
from ..host.paths import Paths
from ..host.trust import check_trusted
from ..settings import Settings
from . import jit_cache, kit_rules
from .exec_env import (
    THREAD_VARIABLES,
    Bind,
    container_name,
    engine_controls,
    interpreter,
    parse_bind,
    passthrough_env,
    wrap,
)
from .kit_rules import KitRow, apply_row, jit_root, jit_root_is_default, kit_env, run_probe
from .manifest import Manifest, VenvEnv
from .supervisor import Admitter, ResidentWorker
from .weights import HashCache, WeightsReport, verify_weights
from .worker_process import ARRAYS_PATH, PROTOCOL_PATH, WORKER_BASE_PATH, Launch, shared_files_env

__all__ = [
    "LaunchPlan",
    "check_weights",
    "command_builder",
    "plan_launch",
    "weights_root",
    "work_root",
    "worker_for",
    "worker_side_env",
]

_RUN_FOLDER = "the worker's run folder (RESIDENT_POOL_STATE_DIR)"
_HEARTBEAT = "RESIDENT_POOL_HEARTBEAT"

_LOCATE = (
    "import importlib.util, sys; s = importlib.util.find_spec(sys.argv[1]); "
    "print(next(iter(s.submodule_search_locations)))"
)


def worker_side_env(manifest: Manifest, config: Settings) -> dict[str, str]:
    """What the worker reads of its own environment (settings.WORKER_SIDE), passed on by name: a container gets
    nothing unnamed."""
    env = {"RESIDENT_POOL_ORPHAN_GRACE_S": f"{config.orphan_grace_s or manifest.lifecycle.orphan_grace_s:g}",
           "RESIDENT_POOL_HEARTBEAT_STALE_S": f"{config.heartbeat_stale_s:g}",
           # A worker's prints reach its transcript as they happen (a kit's ACTIVE line, a traceback), not when a
           # block buffer happens to fill.
           "PYTHONUNBUFFERED": "1",
           "RESIDENT_POOL_ATTACH_MIN_BYTES": str(config.attach_min_bytes),
           "RESIDENT_POOL_MAX_ATTACHMENT_BYTES": str(config.max_attachment_bytes)}
    if config.no_cublas_release:
        env["RESIDENT_POOL_NO_CUBLAS_RELEASE"] = "1"
    batching = manifest.batching
    if batching is not None:  # the limits a batching worker forms its model calls by, and the pool's ageing
        env["RESIDENT_POOL_MAX_BATCH_SIZE"] = str(batching.max_batch_size)
        env["RESIDENT_POOL_MAX_WAIT_MS"] = f"{batching.max_wait_ms:g}"
        if batching.max_batch_work is not None:
            env["RESIDENT_POOL_MAX_BATCH_WORK"] = str(batching.max_batch_work)
        env["RESIDENT_POOL_AGING_S"] = f"{config.aging_s:g}"
    return env


def weights_root(
    manifest: Manifest, python: str | None = None, environ: Mapping[str, str] | None = None
) -> Path | None:
    """The weights directory: the root_env variable, else root, else inside the named package."""
    environ = os.environ if environ is None else environ
    spec = manifest.weights
    if spec.root_env and environ.get(spec.root_env):
        return Path(environ[spec.root_env]).expanduser()
    if spec.root:
        root = Path(spec.root).expanduser()
        return root if root.is_absolute() else manifest.directory / root
    if spec.package:
        location = _package_dir(spec.package, python)
        return Path(location) / spec.subdir if location else None
    return None


def _root_field(manifest: Manifest, environ: Mapping[str, str]) -> str:
    spec = manifest.weights
    if spec.root_env and environ.get(spec.root_env):
        return f"weights.root_env (${spec.root_env})"
    return "weights.root" if spec.root else "weights.package"


def _root_hint(manifest: Manifest) -> str:
    """The next step when the weights root is missing: the variable to set, else the field to give."""
    spec = manifest.weights
    if spec.root_env:
        return f"set {spec.root_env} to the weights directory"
    if spec.package:
        return f"install {spec.package} in the provider's environment, or give [weights] root_env in {manifest.path}"
    return f"give [weights] root_env or root in {manifest.path}"


def _package_dir(package: str, python: str | None) -> str | None:
    if python is None or python == sys.executable:
        found = importlib.util.find_spec(package)
        return next(iter(found.submodule_search_locations)) if found and found.submodule_search_locations else None
    done = subprocess.run([python, "-c", _LOCATE, package], capture_output=True, text=True, timeout=120, check=False)
    return done.stdout.strip() or None


def check_weights(
    manifest: Manifest, python: str | None = None, *, cache: HashCache, environ: Mapping[str, str] | None = None,
) -> WeightsReport:
    python = python or (interpreter(manifest) if isinstance(manifest.env, VenvEnv) else None)
    return verify_weights(manifest.slug, weights_root(manifest, python, environ), manifest.weights.files, cache,
                          root_hint=_root_hint(manifest))


def work_root(manifest: Manifest, environ: Mapping[str, str] | None = None) -> Path:
    """The provider's own work folder, created: ``work_root``, else one per provider under the data dir."""
    environ = os.environ if environ is None else environ
    if manifest.work_root:
        root = Path(manifest.work_root).expanduser()
        root = root if root.is_absolute() else manifest.directory / root
    else:
        base = environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
        root = Path(base) / "resident-pool" / "work" / manifest.slug
    return _own_folder(root, "work_root", manifest)


def _own_folder(path: Path, what: str, manifest: Manifest) -> Path:
    """A folder a worker writes and reads back: made 0700 when new, refused when another user could write it."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.mkdir(mode=0o700, exist_ok=True)
    except OSError as exc:
        raise ManifestError(f"{manifest.path}: {what} {path} cannot be created: {exc.strerror}",
                            slug=manifest.slug, details={"field": what}) from None
    check_trusted(path, what, manifest.slug, what)
    return path


def _refuse_pool_folders(manifest: Manifest, binds: list[Bind], paths: Paths) -> None:
    """Refuse a container mount (the plan's or the manifest's ``binds``) that shows the pool's own folders inside.

    The state directory holds the pool socket (a client of it starts any manifest on the host) and the
    ledger; the logs hold every provider's transcripts; the results every campaign's; the hash cache
    vouches for the weights. The manifests folder is code the pool runs: only read-only may hold it.
    A bind inside the cache folder is fine (the default JIT cache lives there).
    """
    if isinstance(manifest.env, VenvEnv):
        return
    folders = [("state directory", paths.state_dir(), True, False), ("log directory", paths.log_dir(), True, False),
               ("results directory", paths.results, True, False),
               ("cache directory", paths.cache, False, False),
               ("manifests folder", manifest.directory.parent, True, True)]
    folders = [(what, Path(os.path.realpath(folder)), inside_too, writes_only)
               for what, folder, inside_too, writes_only in folders]
    # The run folder (in the state directory) is the pool's own, made for this start alone.
    chosen = [bind for bind in binds if bind.field not in (_RUN_FOLDER, _HEARTBEAT)]
    for bind in chosen + [parse_bind(text) for text in manifest.env.binds]:
        host = Path(os.path.realpath(bind.host))
        for what, folder, inside_too, writes_only in folders:
            if writes_only and bind.read_only:
                continue
            if folder.is_relative_to(host) or (inside_too and host.is_relative_to(folder)):
                raise ManifestError(
                    f"{manifest.path}: {bind.field}: {bind.host} would show the container the pool's {what} "
                    f"{folder}, and a process inside could use it against the host; mount a folder that neither "
                    "holds nor lies inside the pool's own folders", slug=manifest.slug,
                    details={"field": bind.field, "folder": str(folder)})


@dataclass(frozen=True)
class LaunchPlan:
    """Everything one start of one worker needs, resolved once from its manifest and the pool's settings."""

    manifest: Manifest
    python: str
    socket_path: str
    weights_root: Path | None
    work_root: Path
    jit_root: Path | None
    env: dict[str, str | None]
    binds: tuple[Bind, ...]
    name: str
    device: str | None = None
    row: KitRow | None = None
    argv: tuple[str, ...] = ()
    environ: Mapping[str, str] = field(default_factory=lambda: os.environ, repr=False, compare=False)

    @classmethod
    def resolve(
        cls,
        manifest: Manifest,
        socket_path: str,
        *,
        config: Settings,
        paths: Paths,
        name: str | None = None,
        device: str | None = None,
        heartbeat: str | None = None,
        cache: HashCache | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> LaunchPlan:
        """Check the interpreter and the weights, and gather the environment and binds (no kit probe yet).

        ``config``: what the worker is told of its pool (orphan grace, heartbeat, attachment sizes); ``paths``: the
        pool's folders (a container must not see them; the default JIT cache and hash cache live in them).
        """
        environ = os.environ if environ is None else environ
        python = interpreter(manifest)
        venv = isinstance(manifest.env, VenvEnv)
        root = weights_root(manifest, python if venv else None, environ)
        report = verify_weights(manifest.slug, root, manifest.weights.files, cache or HashCache.of(paths),
                                root_hint=_root_hint(manifest))
        if not report.ok:
            raise report.error()
        work = work_root(manifest, environ)
        root_env = manifest.weights.root_env

        env: dict[str, str | None] = {}
        if venv:
            env.update(passthrough_env(manifest.env.passthrough, environ, keep=[root_env] if root_env else []))
        else:
            named = environ if manifest.env.passthrough == "*" else manifest.env.passthrough or ()
            # The pool's thread limits reach a container's worker as they reach a venv worker's (docs/security.md):
            # torch in a container otherwise starts a thread per core of the host, whatever the pool's CPU limit.
            env.update({n: environ[n] for n in (*named, *sorted(THREAD_VARIABLES)) if n in environ})
        env.update(shared_files_env())
        env.update(worker_side_env(manifest, config))
        if heartbeat:
            env["RESIDENT_POOL_HEARTBEAT"] = heartbeat
        if device is not None:
            env["CUDA_VISIBLE_DEVICES"] = device
        if root_env and root is not None:
            env[root_env] = str(root)
        jit = None
        if manifest.kit is not None:
            jit = _own_folder(jit_root(manifest, environ, paths.cache), "the JIT cache", manifest)  # kernels are code
            env.update(kit_env(manifest, environ, jit))

        run_dir = str(Path(socket_path).parent)
        binds = [Bind(run_dir, run_dir, False, _RUN_FOLDER),
                 Bind(str(work), str(work), False, "work_root"),
                 Bind(str(manifest.directory), str(manifest.directory), True, "the manifest's folder"),
                 Bind(PROTOCOL_PATH, PROTOCOL_PATH, True, "resident_pool's protocol.py"),
                 Bind(ARRAYS_PATH, ARRAYS_PATH, True, "resident_pool's arrays.py"),
                 Bind(WORKER_BASE_PATH, WORKER_BASE_PATH, True, "resident_pool's worker_base.py")]
        if not manifest.worker_path.is_relative_to(manifest.directory):
            binds.append(Bind(str(manifest.worker_path), str(manifest.worker_path), True, "worker"))
        if root is not None:
            binds.append(Bind(str(root), str(root), True, _root_field(manifest, environ)))
        if jit is not None:
            binds.append(Bind(str(jit), str(jit), False, "kit.jit_root (or $MODEL_OPT_JIT_ROOT)"))
        if heartbeat and str(Path(heartbeat).parent) != run_dir:
            binds.append(Bind(str(Path(heartbeat).parent), str(Path(heartbeat).parent), False, _HEARTBEAT))
        _refuse_pool_folders(manifest, binds, paths)

        plan = cls(manifest=manifest, python=python, socket_path=socket_path, weights_root=root, work_root=work,
                   jit_root=jit, env=env, binds=tuple(binds), name=name or container_name(manifest.slug, 0),
                   device=device, environ=environ)
        if manifest.kit is None:
            plan = replace(plan, argv=(python, *plan._script_argv("")))
        return plan

    def _script_argv(self, kit_tree: str) -> list[str]:
        values = {
            "socket": self.socket_path, "slug": self.manifest.slug, "weights_root": str(self.weights_root or ""),
            "python": self.python, "kit": kit_tree, "work_root": str(self.work_root),
        }
        return [str(self.manifest.worker_path), *(arg.format(**values) for arg in self.manifest.worker_args)]

    def probe_command(self) -> tuple[list[str], dict[str, str | None]]:
        """The kit probe, in the worker's interpreter, environment, binds and device.

        Less the run folder and the heartbeat: the probe serves no socket, and the
        run folder is made when the worker starts, after its command is built.
        """
        kit = self.manifest.kit
        assert kit is not None
        argv = [self.python, kit_rules.PROBE_PATH, kit.package_name, kit.mode]
        binds = [*(b for b in self.binds if b.field not in (_RUN_FOLDER, _HEARTBEAT)),
                 Bind(kit_rules.PROBE_PATH, kit_rules.PROBE_PATH, True, "resident_pool's kit_probe.py")]
        env = {name: value for name, value in self.env.items() if name != "RESIDENT_POOL_HEARTBEAT"}
        return wrap(self.manifest, argv, env, binds, name=f"{self.name}-probe", device=self.device,
                    environ=self.environ, workdir=str(self.work_root))

    def probe(self) -> KitRow:
        """Ask the kit, in its own interpreter, how it wants to run."""
        argv, env = self.probe_command()
        controls = engine_controls(self.manifest, f"{self.name}-probe")

        def kill_probe() -> None:
            # A timed-out `docker run` client dies alone; its container would keep running.
            subprocess.run(controls[1], capture_output=True, timeout=60, check=False)

        return run_probe(self.manifest, self.python, argv, env, environ=self.environ,
                         on_timeout=kill_probe if controls else None)

    def with_kit(self, row: KitRow) -> LaunchPlan:
        """The plan with the kit's row applied under the start rules (KitUnavailable names the rule broken)."""
        argv, env = apply_row(self.manifest, row, self.python, self._script_argv(row.model_opt or ""), self.env)
        if self.jit_root is not None and row.jit_cache_key and jit_root_is_default(self.manifest, self.environ):
            # Kept per provider and stack key: a kit upgrade starts a fresh cache beside the old one.
            env["MODEL_OPT_JIT_ROOT"] = str(jit_cache.stack_folder(self.jit_root, row.jit_cache_key))
        return replace(self, row=row, argv=tuple(argv), env=env)

    def command(self) -> tuple[list[str], dict[str, str | None]]:
        """The worker's argv and environment changes, wrapped for its engine."""
        assert self.argv, "a kit provider's plan needs with_kit() before its command"
        return wrap(self.manifest, self.argv, self.env, self.binds, name=self.name, device=self.device,
                    environ=self.environ, workdir=str(self.work_root))

    def kit_facts(self) -> dict[str, Any] | None:
        """What the kit this start runs under said of itself: recorded with the worker (provenance)."""
        if self.row is None or self.manifest.kit is None:
            return None
        return {"package": self.row.package, "version": self.row.version, "mode": self.manifest.kit.mode,
                "activation": self.row.activation, "model_opt": self.row.model_opt,
                "jit_cache_key": self.row.jit_cache_key}

    def controls(self) -> tuple[list[str], list[str]] | None:
        """How to stop and kill this start's container through its engine (None: signal the process group)."""
        return engine_controls(self.manifest, self.name)


def plan_launch(
    manifest: Manifest,
    socket_path: str,
    *,
    config: Settings,
    paths: Paths,
    name: str | None = None,
    device: str | None = None,
    heartbeat: str | None = None,
    cache: HashCache | None = None,
    environ: Mapping[str, str] | None = None,
) -> LaunchPlan:
    """The complete plan for one start: resolved, and for a kit provider probed and checked."""
    plan = LaunchPlan.resolve(manifest, socket_path, config=config, paths=paths, name=name, device=device,
                              heartbeat=heartbeat, cache=cache, environ=environ)
    return plan.with_kit(plan.probe()) if manifest.kit is not None else plan


class Slot(Protocol):
    """What building a worker's command reads of what runs it (a ResidentWorker, or the pool's WorkerProcess)."""

    socket_path: Any  # str or os.PathLike
    replica: int
    device: str | None


def command_builder(manifest: Manifest, config: Settings, paths: Paths,
                    cache: HashCache | None = None) -> Callable[[Slot], Launch]:
    """A ``build_command`` for ResidentWorker (and the pool's starts); weights and kit are checked at every start."""

    def build(worker: Slot) -> Launch:
        heartbeat = getattr(worker, "heartbeat_path", None)  # a process handle that keeps one says where
        plan = plan_launch(manifest, worker.socket_path, config=config, paths=paths,
                           name=container_name(manifest.slug, worker.replica), device=worker.device, cache=cache,
                           heartbeat=str(heartbeat) if heartbeat else None)
        argv, env = plan.command()
        stop, kill = plan.controls() or (None, None)
        return Launch(argv, env, stop=stop, kill=kill, kit=plan.kit_facts(), cwd=str(plan.work_root))

    return build


def worker_for(
    manifest: Manifest, replica: int = 0, admitter: Admitter | None = None, cache: HashCache | None = None, *,
    config: Settings,
) -> ResidentWorker:
    """A supervised worker for one replica of ``manifest``, under ``config`` (its folders, its kill grace)."""
    lifecycle = manifest.lifecycle
    paths = Paths.of(config)
    return ResidentWorker(
        manifest.slug,
        command_builder(manifest, config, paths, cache),
        start_timeout_s=lifecycle.start_timeout_s,
        request_timeout_s=lifecycle.request_timeout_s,
        idle_timeout_s=lifecycle.idle_timeout_s,
        vram_budget_gb=manifest.gpu.vram_budget_gb if manifest.gpu.policy != "none" else None,
        manifest=manifest,
        replica=replica,
        admitter=admitter,
        config=config,
        paths=paths,
    )
