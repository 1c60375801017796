"""The project's Prefect worker type, ``resident-process``: flow runs forked from a warm zygote.

Prefect's process worker asks for scheduled runs every ``PREFECT_WORKER_QUERY_SECONDS`` (10 s) and starts each
in a fresh interpreter (two: its workspace supervisor, then the engine), which imports Prefect and the flow
before the flow's first task runs: about 11 s from the UI's Submit to an answer the model gave in 0.04 s. This
worker is Prefect's process worker (a ``BaseWorker`` registered through the ``prefect.collections`` entry point,
as prefect-docker registers its own) with three changes:

- each flow run is forked from a zygote that has imported Prefect, resident_pool and the installed modules the
  pool's deployments' flow files import (``forking.py``; the flow files themselves run in each fork, once),
  exactly as isolated as a spawned one: its own pid, session, environment, folder, settings, log handlers and
  seeds (not the string-hash seed: docs/prefect-ui.md); a zygote that died or went stale is rebuilt, and the runs
  meanwhile are forked by the one it replaced, or spawned as Prefect's process worker spawns them, said in their
  log;
- it wakes on Prefect's ``prefect.flow-run.Scheduled`` events for its pool (polling every
  ``RESIDENT_POOL_FLOW_RUN_POLL_S`` while the events stream is down) instead of waiting for the next poll;
- its pool's job template is locked: a flow run may choose its name, labels and whether output streams, never
  the command, environment or folder it runs with (``locked_job_template``).

It rests on Prefect internals (the flow-run executor, workspace supervisor, control channel): outside
``SUPPORTED_PREFECT`` it says so at start and runs every flow run as Prefect's process worker does.
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc
import prefect
from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version
from prefect.workers.process import ProcessJobConfiguration, ProcessWorker, ProcessWorkerResult

from ..host.paths import Paths
from ..settings import settings
from .forking import FlowRunZygote, ForkStarter, exit_in_words_proposer, flow_sources

if TYPE_CHECKING:
    from prefect.client.schemas.objects import FlowRun

__all__ = ["FLOW_RUN_VARIABLES", "SUPPORTED_PREFECT", "WORKER_TYPE", "ResidentProcessWorker", "locked_job_template",
           "prefect_refusal"]

WORKER_TYPE = "resident-process"
# The Prefect releases whose internals the warm start was built and tested against; pyproject.toml pins the same.
SUPPORTED_PREFECT = ">=3.9.1,<3.10"

# What a flow run may choose about how the worker starts it: a name, labels, whether output streams. Prefect's
# own process template also offers `command`, `env` and `working_dir`: each runs code as the worker's user
# (a command; PYTHONPATH or LD_PRELOAD; a folder whose planted modules the engine imports), and whoever creates
# a flow run may set them. Without them the server refuses such a flow run (422), and the worker, having no
# placeholder for them, could not apply one anyway.
FLOW_RUN_VARIABLES = ("name", "labels", "stream_output")


def locked_job_template() -> dict[str, Any]:
    """Prefect's process template with only FLOW_RUN_VARIABLES, and no other variable accepted."""
    default = ProcessWorker.get_default_base_job_template()
    variables = default["variables"]
    return {"job_configuration": {name: default["job_configuration"][name] for name in FLOW_RUN_VARIABLES},
            "variables": {**variables, "additionalProperties": False,
                          "properties": {name: variables["properties"][name] for name in FLOW_RUN_VARIABLES}}}


def prefect_refusal(version: str) -> str | None:
    """Why flow runs cannot be forked under Prefect ``version`` (it is outside SUPPORTED_PREFECT), or None."""
    try:
        if Version(version) in SpecifierSet(SUPPORTED_PREFECT):
            return None
    except InvalidVersion:
        pass
    return (f"Prefect {version} is outside {SUPPORTED_PREFECT}, the releases whose internals this worker's warm "
            "start rests on: every flow run starts as Prefect's process worker starts it (pip install the "
            "project again for a Prefect in that range)")


class ResidentProcessWorker(ProcessWorker):
    """Prefect's process worker, its flow runs forked warm, woken by events, its job template locked."""

    type = WORKER_TYPE
    job_configuration = ProcessJobConfiguration
    _display_name = "Resident process (warm)"
    _description = ("Flow runs forked from a warm zygote that has imported Prefect and the flows, each as isolated "
                    "as a process worker's; the job template allows no command, env or working_dir.")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.config = settings()  # a worker's own start (Prefect makes it): its settings are those of then
        self.refusal = prefect_refusal(prefect.__version__)
        self.zygote: FlowRunZygote | None = None
        self._wake = asyncio.Event()
        self._wake_scope: anyio.CancelScope | None = None
        self._delivery: Any = None

    @classmethod
    def get_default_base_job_template(cls) -> dict[str, Any]:
        return locked_job_template()

    # -- life ------------------------------------------------------------------------------------
    async def setup(self) -> None:
        if self.refusal is None:
            self.zygote = FlowRunZygote(paths=Paths.of(self.config), kill_grace_s=self.config.kill_grace_s)
            # Registered before Prefect's setup enters the runs' task group: the stack unwinds that first, so
            # the zygote, the only process that can report how its forks ended, outlives every run.
            self._exit_stack.callback(self.zygote.stop)
        await super().setup()
        if self.refusal is not None:
            self._logger.warning(self.refusal)
            return
        await self._warm()

    async def teardown(self, *exc_info: Any) -> None:
        if self._wake_scope is not None:
            self._wake_scope.cancel()
        await super().teardown(*exc_info)

    async def sync_with_backend(self) -> None:
        await super().sync_with_backend()
        if self.zygote is not None:
            await self._warm()

    async def _warm(self) -> None:
        """The zygote built for the pool's flow files as they are now, and the wake on new runs started."""
        if self._work_pool is None:  # not synced yet: the next heartbeat tries again
            return
        from prefect.client.schemas.filters import WorkPoolFilter, WorkPoolFilterName

        deployments = await self.client.read_deployments(
            work_pool_filter=WorkPoolFilter(name=WorkPoolFilterName(any_=[self._work_pool_name])))
        sources = flow_sources(deployments)
        files, folders = [file for file, _ in sources], [folder for _, folder in sources]
        if await anyio.to_thread.run_sync(self.zygote.build, files, folders):
            self._logger.info("forking flow runs from a zygote that preloads Prefect, resident_pool and the installed "
                              "modules %d flow file(s) import (its transcript: zygote-flow-runs-*.log in the pool's "
                              "log folder)", len(set(files)))
        if self._delivery is None:
            await self._start_wake()

    async def _start_wake(self) -> None:
        from prefect._internal._observation_delivery import ObservationDelivery
        from prefect.events.clients import get_events_subscriber
        from prefect.events.filters import EventAnyResourceFilter, EventFilter, EventNameFilter

        wanted = EventFilter(event=EventNameFilter(name=["prefect.flow-run.Scheduled"]),
                             any_resource=EventAnyResourceFilter(id=[f"prefect.work-pool.{self._work_pool.id}"]))

        async def poll() -> None:
            self._wake.set()

        self._delivery = ObservationDelivery(
            name="ResidentProcessWorker wake", logger=self._logger,
            subscriber_factory=lambda: get_events_subscriber(filter=wanted, reconnection_attempts=0),
            on_event=lambda _event: self._wake.set(), check_current_state=poll,
            on_unavailable=lambda error: self._logger.warning(
                "neither Prefect's events stream nor polling answers (%s): new flow runs wait for the next "
                "PREFECT_WORKER_QUERY_SECONDS poll", error),
            polling_interval=self.config.flow_run_poll_s)
        await self._delivery.start()
        self._exit_stack.push_async_callback(self._delivery.stop)
        self._wake_scope = anyio.CancelScope()
        self._runs_task_group.start_soon(self._wake_loop)

    async def _wake_loop(self) -> None:
        """One query for scheduled runs per wake (wakes that come while one is under way make one more)."""
        with self._wake_scope:
            while True:
                await self._wake.wait()
                self._wake.clear()
                try:
                    await self.get_and_submit_flow_runs()
                except Exception as exc:  # noqa: BLE001 - the regular poll still runs; the next wake tries again
                    self._logger.warning("asking for scheduled flow runs on a wake failed: %s", exc)

    # -- a flow run ---------------------------------------------------------------------------------
    async def run(self, flow_run: FlowRun, configuration: ProcessJobConfiguration,
                  task_status: anyio.abc.TaskStatus[int] | None = None) -> ProcessWorkerResult:
        if self.zygote is None:
            return await super().run(flow_run, configuration, task_status)
        from prefect.runner._flow_run_executor import FlowRunExecutionResult, FlowRunExecutorContext

        task_status = task_status or anyio.TASK_STATUS_IGNORED
        execution: FlowRunExecutionResult | None = None
        root = configuration.working_dir  # the template has no such variable: always a folder of its own
        with (contextlib.nullcontext(root) if root else tempfile.TemporaryDirectory(suffix="prefect")) as workspace, \
                tempfile.TemporaryDirectory(prefix="prefect-workspace-attempt-") as runtime:
            async with FlowRunExecutorContext() as ctx:
                starter = ForkStarter(zygote=self.zygote, workspace_root=Path(workspace).resolve(),
                                      runtime_dir=Path(runtime), job_env=configuration.env,
                                      stream_output=configuration.stream_output,
                                      control_channel=ctx.control_channel, logger=self.get_flow_run_logger(flow_run))
                ctx.call_after_exit(starter.close)
                executor = ctx.create_executor(flow_run, starter, propose_submitting=False, hook_runner=starter)
                executor._state_proposer = exit_in_words_proposer(ctx.client, starter)

                async def execute(*, task_status: anyio.abc.TaskStatus[Any] = anyio.TASK_STATUS_IGNORED) -> None:
                    nonlocal execution
                    execution = await executor.submit(task_status=task_status)

                async with anyio.create_task_group() as group:
                    handle = await group.start(execute)
                    if handle.pid is None:
                        raise RuntimeError("Flow run process has no PID")
                    task_status.started(handle.pid)
        self.zygote.maintain()
        if execution is None or execution.status_code is None:
            raise RuntimeError("Failed to start flow run process.")
        return ProcessWorkerResult(status_code=execution.status_code, identifier=str(execution.handle.pid))
