"""Register the three flows as deployments on a process work pool.

    python flows/deploy.py [--work-pool resident-pool] [--manifests DIR]
                           [--schedule "0 2 * * *" --inbox DIR [--outbox DIR]] [--provider minilm]
                           [--validate-schedule "0 3 * * *"] [--paused]

`validate` runs nightly (``--validate-schedule``). With ``--schedule``,
`screen` runs on that cron over an inbox folder: every input file in it,
computing only what no earlier run computed, one output per file.
``--paused`` registers both schedules paused (``make stack-up`` does, so a
developer's laptop does not screen at night); resume them in the UI.

The provider parameter of `predict` and `screen` is a dropdown of the
providers in ``--manifests`` at deploy time; run this again after adding one.
Run a worker for the pool (`prefect worker start --pool resident-pool`) on
each GPU host, with ``RESIDENT_POOL_MANIFESTS``, ``RESIDENT_POOL_INPUT_ROOT``
(and ``RESIDENT_POOL_OUTPUT_ROOT``) in its environment; every flow run then
reaches that host's resident pool and its folders (docs/security.md).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from prefect import flow
from prefect.client.orchestration import get_client
from prefect.deployments.runner import deploy
from prefect.exceptions import ObjectAlreadyExists

from resident_pool.providers.manifest import SLUG

ROOT = Path(__file__).resolve().parents[1]
FLOWS = {
    "screen": "flows/screen.py:screen",
    "validate": "flows/validate.py:validate",
    "predict": "flows/predict.py:predict",
}
VALIDATE_CRON = "0 3 * * *"  # nightly, after the 2 a.m. screen a README example sets up


# What a flow run may choose about how the worker starts it: a name, labels, whether output streams. Prefect's
# own process template also offers `command`, `env` and `working_dir`: each runs code as the worker's user
# (a command; PYTHONPATH or LD_PRELOAD; a folder whose planted modules `python -m prefect.engine` imports), and
# whoever creates a flow run may set them. Without them here the server refuses such a flow run (422), and the
# worker, having no placeholder for them, could not apply one anyway.
FLOW_RUN_VARIABLES = ("name", "labels", "stream_output")


def base_job_template() -> dict[str, Any]:
    """The process work pool's template with only FLOW_RUN_VARIABLES, and no other variable accepted."""
    from prefect.workers.process import ProcessWorker

    default = ProcessWorker.get_default_base_job_template()
    variables = default["variables"]
    return {"job_configuration": {name: default["job_configuration"][name] for name in FLOW_RUN_VARIABLES},
            "variables": {**variables, "additionalProperties": False,
                          "properties": {name: variables["properties"][name] for name in FLOW_RUN_VARIABLES}}}


def ensure_work_pool(name: str) -> None:
    """The process work pool ``name`` with base_job_template(); a pool made before (with Prefect's) is updated."""
    from prefect.client.schemas.actions import WorkPoolCreate, WorkPoolUpdate

    template = base_job_template()
    with get_client(sync_client=True) as client:
        try:
            client.create_work_pool(WorkPoolCreate(name=name, type="process", base_job_template=template))
        except ObjectAlreadyExists:
            client.update_work_pool(name, WorkPoolUpdate(base_job_template=template))


def provider_choices(manifests: str | Path) -> list[str]:
    """The providers in ``manifests`` (folders holding a manifest.toml), sorted."""
    return sorted(path.parent.name for path in Path(manifests).glob("*/manifest.toml")
                  if SLUG.fullmatch(path.parent.name))


def _dropdown(deployment, choices: list[str]) -> None:
    """Make the provider parameter a choice among ``choices`` in the UI form (and checked by the server)."""
    # The schema Prefect sends with the deployment: the UI draws its form from it.
    properties = deployment._parameter_openapi_schema.properties
    if "provider" not in properties or not choices:
        return
    default = properties["provider"].get("default")
    properties["provider"] = {**properties["provider"], "type": "string", "enum": choices,
                              "default": default if default in choices else choices[0]}
    properties["provider"].pop("anyOf", None)


def deploy_all(work_pool: str, manifests: str | None = None, tags: list[str] | None = None, *,
               schedule: str | None = None, inbox: str | None = None, outbox: str | None = None,
               provider: str | None = None, validate_schedule: str | None = VALIDATE_CRON,
               paused: bool = False) -> list[str]:
    """Register screen, validate and predict; returns the deployment ids."""
    if schedule and not inbox:
        raise ValueError("--schedule screens an inbox folder: give --inbox DIR")
    ensure_work_pool(work_pool)
    manifests_dir = Path(manifests).expanduser().resolve() if manifests else ROOT / "manifests"
    choices = provider_choices(manifests_dir)
    # The flow runs find the providers (and the folders they may read and write) in the worker's own
    # environment: RESIDENT_POOL_MANIFESTS, _INPUT_ROOT, _OUTPUT_ROOT, set where the worker starts.
    deployments = []
    for name, entrypoint in FLOWS.items():
        parameters: dict[str, Any] = {}
        cron = None
        limit = None
        if name == "screen" and schedule:
            cron = schedule
            # One screen at a time: a night that outlasts the next start queues behind it (and a second run on
            # the same inbox at once would find each output locked and compute nothing).
            limit = 1
            parameters["input"] = str(Path(inbox).expanduser().resolve())
            if outbox:
                parameters["output"] = str(Path(outbox).expanduser().resolve())
            if provider:
                parameters["provider"] = provider
        if name == "validate":
            cron = validate_schedule
            # Nightly means what CI means: the answer against the expected one, and against stock.
            parameters.update({"smoke": True, "against_stock": True})
        remote = flow.from_source(source=str(ROOT), entrypoint=entrypoint)
        deployment = remote.to_deployment(name=name, parameters=parameters, cron=cron,
                                          paused=paused if cron else None, tags=tags or ["resident-pool"],
                                          work_pool_name=work_pool,
                                          concurrency_limit=limit)
        _dropdown(deployment, choices)
        deployments.append(deployment)
    ids = deploy(*deployments, work_pool_name=work_pool, print_next_steps_message=False, ignore_warnings=True)
    return [str(deployment_id) for deployment_id in ids]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work-pool", default="resident-pool")
    parser.add_argument("--manifests", default=str(ROOT / "manifests"))
    parser.add_argument("--schedule", help='cron for the screen deployment, e.g. "0 2 * * *" (needs --inbox)')
    parser.add_argument("--inbox", help="the folder the scheduled screen reads every input file from")
    parser.add_argument("--outbox", help="where its outputs go (default: <inbox>/screened)")
    parser.add_argument("--provider", help="the scheduled screen's provider (default: the flow's, minilm)")
    parser.add_argument("--validate-schedule", default=VALIDATE_CRON,
                        help=f"cron for the validate deployment (default {VALIDATE_CRON!r}; '' for none)")
    parser.add_argument("--paused", action="store_true", help="register the schedules paused")
    arguments = parser.parse_args()
    for deployment_id in deploy_all(arguments.work_pool, arguments.manifests, schedule=arguments.schedule,
                                    inbox=arguments.inbox, outbox=arguments.outbox, provider=arguments.provider,
                                    validate_schedule=arguments.validate_schedule or None, paused=arguments.paused):
        print(deployment_id)
    # A deployment's flow runs take their folders from the worker's environment (docs/security.md).
    needs = [f"RESIDENT_POOL_MANIFESTS={Path(arguments.manifests).expanduser().resolve()}"]
    if arguments.inbox:
        needs.append(f"RESIDENT_POOL_INPUT_ROOT covering {Path(arguments.inbox).expanduser().resolve()}")
    if arguments.outbox:
        needs.append(f"RESIDENT_POOL_OUTPUT_ROOT covering {Path(arguments.outbox).expanduser().resolve()}")
    print("the worker that runs these needs, in its own environment: " + "; ".join(needs), file=sys.stderr)
