"""Flow runs forked from a warm zygote, worker side: the zygote, and Prefect's process starter that forks from it.

``FlowRunZygote`` owns which zygote forks the next flow run: one ``providers.zygote.Zygote`` (the pool's
fork server, run here for flow runs) that has imported Prefect, resident_pool and the installed modules the
deployments' flow files import (never the flow files, nor the modules beside them: each run imports those itself,
once, as on Prefect's process worker), rebuilt when it died or a module it loaded changed on disk; the one it
replaced forks the runs that come while it preloads, and is kept until the runs it forked have ended (only it can
report how they ended). ``ForkStarter`` is the process starter of one flow run, as Prefect's
flow-run executor drives it: forked, or, where no zygote can fork it, spawned as Prefect's process worker
spawns it, the reason said in the run's log. What the child does is ``forked.py``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import threading
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc

from ..errors import ManifestError
from ..exits import LOST_EXIT, describe_exit
from ..host.paths import Paths
from ..host.procs import ForkRefused
from ..host.trust import check_trusted
from ..providers.zygote import ForkedProcess, Zygote

if TYPE_CHECKING:
    from prefect.client.schemas.objects import FlowRun, State
    from prefect.runner._control_channel import ControlChannel
    from prefect.runner._process_manager import ProcessHandle

__all__ = ["FORK_SCRIPT", "PRELOAD", "PRELOAD_WAIT_S", "FlowRunZygote", "ForkStarter", "flow_files", "flow_sources",
           "run_environment"]

log = logging.getLogger("resident_pool.prefect.forking")

FORK_SCRIPT = str(Path(__file__).with_name("forked.py"))
# What a flow run imports before its flow's own code: Prefect, its engine and workspace supervisor, the modules
# a run loads as it goes (task engine, results, artifacts, events, the API log handler), and resident_pool's
# Prefect face. Measured: a fresh interpreter spends 1.3 s here on this project's 2-core machine.
PRELOAD = [
    "prefect", "prefect.engine", "prefect.flow_engine", "prefect.task_engine", "prefect.results",
    "prefect.artifacts", "prefect.events.clients", "prefect.logging.handlers", "prefect.client.orchestration",
    "prefect.deployments.steps", "prefect.runner._workspace_resolver", "prefect.runner._workspace_supervisor",
    "prefect.runner._workspace_runtime_bootstrap", "prefect._internal.control_listener", "resident_pool.prefect",
    "resident_pool.prefect.forked",
    # What Prefect imports lazily when a flow file's @flow and @task decorators build their parameter schemas
    # (prefect.utilities.callables): 20 ms of every run's own import of its flow file otherwise, measured.
    "pydantic.v1",
]
# How long a run waits for a zygote still preloading when none it replaced can fork it: about what a spawn costs
# here (two interpreters importing Prefect), so a cold start (the worker just started) still forks, and a slow
# import (a large library a flow file names) delays a run by no more than that before it is spawned.
PRELOAD_WAIT_S = 3.0
_SLUG = "flow-runs"  # its transcript: zygote-flow-runs-0.log in the pool's log folder
_WAIT_S = 0.02  # how often a starter looks whether its forked run has ended


def flow_files(deployments: Iterable[Any]) -> list[str]:
    """The flow files of deployments whose code is a folder on this host (a ``set_working_directory`` pull step),
    each one you own and nobody else may write; a file that fails that is left out, and said."""
    return sorted({path for path, _ in flow_sources(deployments)})


def flow_sources(deployments: Iterable[Any]) -> list[tuple[str, str]]:
    """``flow_files`` with each file's deployment folder (the run's working folder, whose modules are its own):
    (flow file, folder) pairs."""
    found = []
    for deployment in deployments:
        entrypoint = deployment.entrypoint or ""
        directory = next((step[name].get("directory") for step in deployment.pull_steps or [] for name in step
                          if name.endswith("set_working_directory") and isinstance(step[name], dict)), None)
        if not directory or ":" not in entrypoint:
            continue
        path = (Path(directory) / entrypoint.rsplit(":", 1)[0]).resolve()
        if path.suffix != ".py" or not path.is_file():
            continue
        try:
            check_trusted(path, "a flow file whose imports the flow-run zygote would preload")
        except ManifestError as exc:
            log.warning("not preloaded: %s", exc)
            continue
        found.append((str(path), str(Path(directory).resolve())))
    return sorted(set(found))


class FlowRunZygote:
    """Which zygote forks the next flow run (see the module's docstring)."""

    def __init__(self, *, paths: Paths, kill_grace_s: float, start_timeout_s: float = 300.0,
                 preload_wait_s: float = PRELOAD_WAIT_S) -> None:
        self.paths = paths
        self.kill_grace_s = kill_grace_s
        self.start_timeout_s = start_timeout_s
        self.preload_wait_s = preload_wait_s
        self._lock = threading.Lock()
        self._current: Zygote | None = None
        # The zygote it replaced, ready and up: it forks the runs that come while the current one preloads.
        self._standby: Zygote | None = None
        self._files: tuple[str, ...] = ()
        self._folders: tuple[str, ...] = ()
        self._retiring: list[Zygote] = []

    @property
    def pid(self) -> int | None:
        current = self._current
        return current.pid if current is not None else None

    def build(self, files: Iterable[str], folders: Iterable[str] = ()) -> bool:
        """A zygote for these flow files (and their deployments' folders), preloading now in the background,
        unless the current one has them (or failed to start with them: it is tried again when they change);
        whether one was started."""
        files, folders = tuple(sorted(set(files))), tuple(sorted(set(folders)))
        with self._lock:
            current = self._current
            if (current is not None and (files, folders) == (self._files, self._folders)
                    and (not current.down or current.failure)):
                return False
            self._files, self._folders = files, folders
            self._replace()
            return True

    def _replace(self) -> None:
        """Under the lock: a new current zygote, its preload started; the old one forks on while the new one
        preloads (if it is ready), then retires with its last run."""
        old = self._current
        if old is not None:
            if old.info and old.up() and not old.stopped:
                if self._standby is not None:
                    self._retiring.append(self._standby)
                self._standby = old
            else:
                self._retiring.append(old)
        env = dict(os.environ)
        spec = json.dumps({"files": list(self._files), "folders": list(self._folders)})
        zygote = self._current = Zygote(
            _SLUG, hashlib.sha256(spec.encode()).hexdigest(), sys.executable, env, FORK_SCRIPT, PRELOAD,
            # The load stage's argument names the weights root where a model is loaded; here, the flow files,
            # whose imports it preloads (never the files themselves: forked.preload_flows).
            load="preload_flows", weights=lambda: spec, start_timeout_s=self.start_timeout_s,
            paths=self.paths, kill_grace_s=self.kill_grace_s)
        threading.Thread(target=self._start, args=(zygote,), daemon=True, name="flow-run-zygote").start()
        self._retire_idle()

    def _start(self, zygote: Zygote) -> None:
        try:
            zygote.ensure_started()
        except ForkRefused as exc:  # each fork from it says so, and its runs are spawned
            if not zygote.stopped:  # replaced before it was ready: nothing went wrong
                log.warning("the flow-run zygote could not start: %s", exc)
        self.maintain()  # the one it replaced retires now

    def fork(self, argv: list[str], env: Mapping[str, str], out_fd: int, cwd: str) -> ForkedProcess:
        """A flow run forked from the current zygote, or from the one it replaced while it preloads (else after at
        most ``preload_wait_s``); ForkRefused says why not (and a zygote that died or went stale is replaced as it
        says so)."""
        zygote = self._current
        if zygote is None:
            raise ForkRefused("the worker has built no zygote yet")
        if not zygote.settle(0):  # preloading
            standby = self._standby
            why = self._refusal(standby) if standby is not None else "no earlier zygote is up"
            if why is None and standby is not None:
                return standby.fork(argv, env, out_fd, cwd)
            if not zygote.settle(self.preload_wait_s):
                raise ForkRefused(f"the zygote (pid {zygote.pid}) is still preloading after {self.preload_wait_s:g} s "
                                  f"and {why}; the next runs fork from it once it is ready")
        try:
            zygote.ensure_started()
        except ForkRefused as exc:
            if zygote.failure is None:  # it ran and is gone now: a new one will do
                self._rebuild(zygote)
                raise ForkRefused(f"{exc}; a new zygote is preloading") from None
            raise
        why = self._refusal(zygote)
        if why is not None:
            if zygote.stale() or (zygote.down and zygote.failure is None):
                self._rebuild(zygote)
                why += "; a new one is preloading"
            raise ForkRefused(why)
        try:
            return zygote.fork(argv, env, out_fd, cwd)
        except ForkRefused:
            if zygote.down and zygote.failure is None:
                self._rebuild(zygote)
            raise

    @staticmethod
    def _refusal(zygote: Zygote) -> str | None:
        """Why this ready zygote may not fork a run now, or None."""
        if not zygote.up() or zygote.stopped:
            return f"the zygote (pid {zygote.pid}) is not up"
        # A Python thread may hold a lock (the import lock, a logging handler's) that its fork copies held, with
        # no thread left to release it. Native pools (OpenBLAS, OpenMP) that numeric modules start at import
        # reset themselves in a fork, as the pool's provider zygotes rely on. Never better until the files change.
        threads = zygote.info.get("python_threads") or []
        if threads:
            return (f"the zygote (pid {zygote.pid}) runs Python thread(s) {', '.join(threads)} after its preload (a "
                    "module it loaded started them), and a fork would copy any lock they hold")
        stale = zygote.stale()
        if stale:
            return f"the zygote (pid {zygote.pid}) is stale: {stale}"
        return None

    def _rebuild(self, zygote: Zygote) -> None:
        with self._lock:
            if self._current is zygote:
                self._replace()

    def maintain(self) -> None:
        """Stop replaced zygotes whose forked runs have all ended (one that forks while its successor preloads
        once that one is ready or failed)."""
        with self._lock:
            self._retire_idle()

    def _retire_idle(self) -> None:
        standby, current = self._standby, self._current
        if standby is not None and (current is None or current.settle(0) or standby.down):
            self._standby = None
            self._retiring.append(standby)
        for zygote in list(self._retiring):
            if not zygote.live_children():
                self._retiring.remove(zygote)
                threading.Thread(target=zygote.stop, daemon=True, name="stop-flow-run-zygote").start()

    def stop(self) -> None:
        """Every zygote stopped (the worker's runs were stopped before: a zygote's exit orphans its forks)."""
        with self._lock:
            zygotes = [*self._retiring, *(z for z in (self._standby, self._current) if z is not None)]
            self._current, self._standby, self._retiring = None, None, []
        for zygote in zygotes:
            zygote.stop()


def run_environment(flow_run: FlowRun, job_env: Mapping[str, str | None], control: Mapping[str, str]
                    ) -> dict[str, str]:
    """A flow run's whole environment, as Prefect's engine starter builds it for its workspace supervisor: the
    worker's, its Prefect settings, the job's environment over them, then the run's own names."""
    from prefect.settings import get_current_settings
    from prefect.utilities.processutils import sanitize_subprocess_env

    env: dict[str, str | None] = {**os.environ, **get_current_settings().to_environment_variables(exclude_unset=True),
                                  **job_env}
    env.update({"PREFECT__FLOW_RUN_ID": str(flow_run.id), "PREFECT__ENABLE_CANCELLATION_AND_CRASHED_HOOKS": "false",
                **control, "PREFECT__DEPLOYMENT_NAME": job_env.get("PREFECT__DEPLOYMENT_NAME")})
    return sanitize_subprocess_env(env)


class _Captured:
    """A task status that keeps the handle it passes on (the spawn path's, whose exit code it then reads)."""

    def __init__(self, outer: anyio.abc.TaskStatus[Any], starter: ForkStarter) -> None:
        self._outer, self._starter = outer, starter

    def started(self, value: Any = None) -> None:
        self._starter.handle = value
        self._outer.started(value)


class ForkStarter:
    """Starts one flow run, and runs its crashed and cancellation hooks in the runtime it ran in."""

    def __init__(self, *, zygote: FlowRunZygote, workspace_root: Path, runtime_dir: Path,
                 job_env: Mapping[str, str | None], stream_output: bool, control_channel: ControlChannel | None,
                 logger: logging.LoggerAdapter) -> None:
        from prefect.runner._workspace_hook_runner import WorkspaceHookRunner

        self._zygote = zygote
        self._root = workspace_root
        self._manifest = runtime_dir / "workspace.json"
        self._job_env = dict(job_env)
        self._stream_output = stream_output
        self._control = control_channel
        self._logger = logger
        self._hooks: Any = WorkspaceHookRunner(manifest_path=self._manifest, stream_output=stream_output)
        self._spawn: Any = None
        self.handle: ProcessHandle | None = None
        self.forked: ForkedProcess | None = None

    # -- the ProcessStarter protocol ---------------------------------------------------------------
    async def start(self, flow_run: FlowRun,
                    task_status: anyio.abc.TaskStatus[ProcessHandle] = anyio.TASK_STATUS_IGNORED) -> None:
        from prefect.runner._process_manager import ProcessHandle, create_isolated_termination_scope

        control: dict[str, str] = {}
        if self._control is not None:
            try:
                port, token = self._control.register(flow_run.id)
                control = {"PREFECT__CONTROL_PORT": str(port), "PREFECT__CONTROL_TOKEN": token}
            except RuntimeError:
                pass  # no loopback listener: cancellation falls back to the kill alone, as Prefect's does
        env = run_environment(flow_run, self._job_env, control)
        argv = [sys.executable, FORK_SCRIPT, str(self._manifest), str(self._root)]
        try:
            with open(os.devnull, "wb") as devnull:
                out_fd = sys.stdout.fileno() if self._stream_output else devnull.fileno()
                process = await anyio.to_thread.run_sync(self._zygote.fork, argv, env, out_fd, str(self._root))
        except ForkRefused as exc:
            if control:
                self._control.unregister(flow_run.id)
            self._logger.warning("started by plain spawn, as Prefect's process worker starts it: %s", exc)
            await self._spawned(flow_run, task_status)
            return
        self.forked = process
        self._logger.info("forked from the warm zygote (pid %s) as pid %s", process.zygote_pid, process.pid)
        # Its own session (the zygote made it one): a cancel or kill reaches every process it started.
        self.handle = ProcessHandle(process, termination_scope=create_isolated_termination_scope(process.pid))
        task_status.started(self.handle)
        while process.poll() is None:
            await anyio.sleep(_WAIT_S)

    async def _spawned(self, flow_run: FlowRun, task_status: anyio.abc.TaskStatus[ProcessHandle]) -> None:
        from prefect.runner._workspace_starter import WorkspaceResolvingEngineCommandStarter

        self._spawn = WorkspaceResolvingEngineCommandStarter(
            workspace_root=self._root, command=None, stream_output=self._stream_output,
            control_channel=self._control, source_cwd=self._root, environment=self._job_env)
        self._hooks = self._spawn.hook_runner
        await self._spawn.start(flow_run, task_status=_Captured(task_status, self))

    def close(self) -> None:
        if self._spawn is not None:
            self._spawn.close()

    # -- the hook runner protocol ----------------------------------------------------------------------
    async def run_cancellation_hooks(self, flow_run: FlowRun, state: State) -> None:
        await self._hooks.run_cancellation_hooks(flow_run, state)

    async def run_crashed_hooks(self, flow_run: FlowRun, state: State) -> None:
        await self._hooks.run_crashed_hooks(flow_run, state)

    # -- what the Crashed state says ---------------------------------------------------------------------
    def exit_in_words(self) -> str | None:
        """How the run's process ended, in words, where a signal or a lost status ended it (Prefect's own message
        says a bare code)."""
        rc = self.handle.returncode if self.handle is not None else None
        if rc is None or (rc >= 0 and rc != LOST_EXIT):
            return None
        return f"flow run process {self.handle.pid}: {describe_exit(rc)}"


def exit_in_words_proposer(client: Any, starter: ForkStarter) -> Any:
    """Prefect's state proposer for one run, whose Crashed state begins with how the process ended, in words."""
    from prefect.runner._state_proposer import StateProposer

    class _ExitInWords(StateProposer):
        async def propose_crashed(self, flow_run: FlowRun, message: str) -> State | None:
            words = starter.exit_in_words()
            return await super().propose_crashed(flow_run, f"{words}. {message}" if words else message)

    return _ExitInWords(client=client)
