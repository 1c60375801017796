"""Register the three flows as deployments on a work pool of the project's own worker type (resident-process).

    python flows/deploy.py [--work-pool resident-pool] [--manifests DIR]
                           [--schedule "0 2 * * *" --inbox DIR [--outbox DIR]] [--provider minilm]
                           [--default-input FILE] [--input-root DIR]
                           [--validate-schedule "0 3 * * *"] [--timezone Europe/Berlin] [--paused]

`validate` runs nightly (``--validate-schedule``). With ``--schedule``,
`screen` runs on that cron over an inbox folder: every input file in it,
computing only what no earlier run computed, one output per file. Crons are
read in ``--timezone`` (default: this host's). ``--paused`` registers the
deployments paused (``make stack-up`` does, so a developer's laptop does not
screen at night); the deployment's own toggle in the UI resumes it.
``--default-input`` is the screen form's default input (``make stack-up`` gives
the demo file it copies into the inbox); the schedule keeps screening the inbox.
``--input-root`` (default: the inbox) is the folder the worker reads inputs under,
which the form's ``input`` field names so a person knows where a file must go.

The forms are drawn for a person: each parameter described; the provider a
dropdown of the providers in ``--manifests`` at deploy time, each described;
predict's payload a choice of one JSON form per provider, drawn from its
``[smoke]`` payload. Run this again after adding a provider.
Run a worker for the pool (`prefect worker start --pool resident-pool --type resident-process`) on
each GPU host, with ``RESIDENT_POOL_MANIFESTS``, ``RESIDENT_POOL_INPUT_ROOT``
(and ``RESIDENT_POOL_OUTPUT_ROOT``) in its environment; every flow run then
reaches that host's resident pool and its folders (docs/security.md).
"""

from __future__ import annotations

import argparse
import os
import sys
import zoneinfo
from pathlib import Path
from typing import Any

from prefect import flow
from prefect.client.orchestration import get_client
from prefect.deployments.runner import deploy
from prefect.exceptions import ObjectAlreadyExists
from prefect.schedules import Cron

from resident_pool.errors import ManifestError
from resident_pool.prefect import escape_markdown
from resident_pool.prefect.worker import WORKER_TYPE, locked_job_template
from resident_pool.providers.manifest import SLUG, Manifest, load_manifest
from resident_pool.validation.expected import smoke_set

ROOT = Path(__file__).resolve().parents[1]
FLOWS = {
    "screen": "flows/screen.py:screen",
    "validate": "flows/validate.py:validate",
    "predict": "flows/predict.py:predict",
}
VALIDATE_CRON = "0 3 * * *"  # nightly, after the 2 a.m. screen a README example sets up
DEFAULT_PROVIDER = "minilm"  # the demo model: what a first run from the UI should meet


def ensure_work_pool(name: str) -> None:
    """The work pool ``name``, of the project's worker type with its locked job template (resident_pool.prefect.
    worker); one made before is updated, and a process pool an earlier version of this script made is replaced."""
    from prefect.client.schemas.actions import WorkPoolCreate, WorkPoolUpdate

    template = locked_job_template()
    with get_client(sync_client=True) as client:
        try:
            client.create_work_pool(WorkPoolCreate(name=name, type=WORKER_TYPE, base_job_template=template))
            return
        except ObjectAlreadyExists:
            existing = client.read_work_pool(name)
        if existing.type == WORKER_TYPE:
            client.update_work_pool(name, WorkPoolUpdate(base_job_template=template))
            return
        if existing.type != "process" or existing.base_job_template != template:
            raise ValueError(f"work pool {name!r} is of type {existing.type!r}, not this project's {WORKER_TYPE!r}, "
                             "and was not made by this script: give another --work-pool, or delete it "
                             f"(`prefect work-pool delete {name}`) and deploy again")
        # Ours (the locked template), from before the project had its own worker type: its deployments are
        # registered again below, on the new pool of the same name.
        client.delete_work_pool(name)
        client.create_work_pool(WorkPoolCreate(name=name, type=WORKER_TYPE, base_job_template=template))
        print(f"work pool {name!r} was a process pool; it is now of type {WORKER_TYPE!r}: start its worker with "
              f"`prefect worker start --pool {name} --type {WORKER_TYPE}`", file=sys.stderr)


def provider_choices(manifests: str | Path) -> list[str]:
    """The providers in ``manifests`` (folders holding a manifest.toml), sorted."""
    return sorted(path.parent.name for path in Path(manifests).glob("*/manifest.toml")
                  if SLUG.fullmatch(path.parent.name))


def host_timezone() -> str:
    """This host's IANA time zone: $TZ when it names one, else /etc/timezone or /etc/localtime's target, else UTC."""
    candidates = [os.environ.get("TZ", "").removeprefix(":")]
    try:
        candidates.append(Path("/etc/timezone").read_text().strip())
    except OSError:
        pass  # not every system keeps one
    target = os.path.realpath("/etc/localtime")
    if "/zoneinfo/" in target:
        candidates.append(target.split("/zoneinfo/", 1)[1])
    for name in candidates:
        try:
            if name and zoneinfo.ZoneInfo(name):
                return name
        except (zoneinfo.ZoneInfoNotFoundError, ValueError):
            continue
    return "UTC"


def _manifests(manifests: Path, choices: list[str]) -> dict[str, Manifest]:
    """The providers' manifests, for their descriptions and examples; one that does not load is left out."""
    loaded = {}
    for slug in choices:
        try:
            loaded[slug] = load_manifest(manifests / slug / "manifest.toml")
        except ManifestError:
            continue  # `resident-pool check` says why; the form still offers the others
    return loaded


def example_payload(manifest: Manifest, inputs: int = 2) -> dict[str, Any] | None:
    """What a form shows as the provider's request: its smoke payload, at most ``inputs`` of its inputs; None when
    its smoke inputs cannot be read (`resident-pool check` says why)."""
    try:
        payload = smoke_set(manifest).payload
    except ManifestError:
        return None
    listed = payload.get("inputs")
    return {**payload, "inputs": listed[:inputs]} if isinstance(listed, list) else payload


def schema_of(value: Any) -> dict[str, Any]:
    """A JSON Schema that ``value`` (a provider's [smoke] payload) is an instance of, field by field."""
    if isinstance(value, dict):
        return {"type": "object", "properties": {str(k): schema_of(v) for k, v in value.items()},
                "additionalProperties": True}
    if isinstance(value, list):
        return {"type": "array", "items": schema_of(value[0]) if value else {}}
    if isinstance(value, bool):
        return {"type": "boolean"}
    if isinstance(value, int):
        return {"type": "integer"}
    if isinstance(value, float):
        return {"type": "number"}
    if isinstance(value, str):
        return {"type": "string"}
    return {}


def _plain(prop: dict[str, Any]) -> dict[str, Any]:
    """``anyOf [T, null]`` as T: the form shows a field, not a T/None toggle; left empty, the flow's default holds."""
    options = prop.get("anyOf")
    if not options or len(options) != 2 or {"type": "null"} not in options:
        return prop
    (kept,) = [option for option in options if option != {"type": "null"}]
    flat = {**{k: v for k, v in prop.items() if k != "anyOf"}, **kept}
    if flat.get("default", "") is None:
        flat.pop("default")
    return flat


def input_words(input_root: str | None, default_input: str | None) -> str:
    """The screen form's ``input`` field described for a person: which folder its file must be in, and how to get a
    file there."""
    where = (f"It must lie under {input_root} on the worker's host (the worker's RESIDENT_POOL_INPUT_ROOT): copy "
             f"a file there first, for example `cp proteins.fasta {input_root}/`, then give its path here."
             if input_root else
             "It must lie under the folder the worker's RESIDENT_POOL_INPUT_ROOT names on its host: copy a file "
             "there first, then give its path here.")
    shipped = f" The default, {default_input}, is the demo's 500 UniProt proteins." if default_input else ""
    return ("An input file (FASTA, CSV, TSV or JSONL, optionally .gz), or a folder of them (an inbox: every input "
            f"file in it, one output each), on the worker's host. {where}{shipped}")


def describe_form(deployment, choices: list[str], manifests: dict[str, Manifest], *, input_root: str | None = None,
                  default_input: str | None = None) -> None:
    """Draw the deployment's form for a person: described providers, plain fields, per-provider payloads, where
    the screen's inputs must be."""
    schema = deployment._parameter_openapi_schema  # what Prefect sends with the deployment; the UI draws from it
    properties = schema.properties
    for name in list(properties):
        properties[name] = _plain(properties[name])
    if "input" in properties and "fail_on_input_errors" in properties:  # the screen flow's
        properties["input"] = {**properties["input"], "description": input_words(input_root, default_input)}
    if "provider" in properties and choices:
        default = properties["provider"].get("default")
        default = default if default in choices else DEFAULT_PROVIDER if DEFAULT_PROVIDER in choices else choices[0]
        listed = "\n\n".join(f"- **{slug}**: {escape_markdown(manifests[slug].description or '(no description)')}"
                           if slug in manifests else f"- **{slug}**: (its manifest does not load)" for slug in choices)
        properties["provider"] = {**properties["provider"], "type": "string", "enum": choices, "default": default,
                                  "description": f"{properties['provider'].get('description', '')}\n\n{listed}"}
        schema.required = sorted({*(schema.required or []), "provider"})  # it always has one: not "(Optional)"
    examples = {slug: example_payload(manifest) for slug, manifest in manifests.items()}
    if "sequences" in properties:
        example = examples.get(DEFAULT_PROVIDER) or next(iter(examples.values()), None)
        inputs = (example or {}).get("inputs")
        properties["sequences"] = {**properties["sequences"], "type": "array", "items": {"type": "string"},
                                   "default": [], **({"examples": [inputs]} if inputs else {})}
    if "payload" in properties:
        forms = [{"title": slug, **schema_of(example), "examples": [example],
                  "description": f"{slug}'s request, as in its manifest's [smoke] payload"}
                 for slug, example in examples.items() if isinstance(example, dict)]
        properties["payload"] = {key: value for key, value in properties["payload"].items()
                                 if key not in ("type", "additionalProperties")}
        properties["payload"].update({"anyOf": [{"type": "null", "title": "none"}, *forms], "default": None})
    if "providers" in properties and choices:
        properties["providers"] = {**properties["providers"], "type": "array", "default": [],
                                   "items": {"type": "string", "enum": choices}}


def deploy_all(work_pool: str, manifests: str | None = None, tags: list[str] | None = None, *,
               schedule: str | None = None, inbox: str | None = None, outbox: str | None = None,
               provider: str | None = None, validate_schedule: str | None = VALIDATE_CRON,
               paused: bool = False, timezone: str | None = None, default_input: str | None = None,
               input_root: str | None = None) -> list[str]:
    """Register screen, validate and predict; returns the deployment ids."""
    if schedule and not inbox:
        raise ValueError("--schedule screens an inbox folder: give --inbox DIR")
    timezone = timezone or host_timezone()
    try:
        zoneinfo.ZoneInfo(timezone)
    except (zoneinfo.ZoneInfoNotFoundError, ValueError):
        raise ValueError(f"--timezone {timezone!r} is not a time zone; give an IANA name such as Europe/Berlin "
                         "or UTC") from None
    ensure_work_pool(work_pool)
    manifests_dir = Path(manifests).expanduser().resolve() if manifests else ROOT / "manifests"
    choices = provider_choices(manifests_dir)
    loaded = _manifests(manifests_dir, choices)
    # The flow runs find the providers (and the folders they may read and write) in the worker's own
    # environment: RESIDENT_POOL_MANIFESTS, _INPUT_ROOT, _OUTPUT_ROOT, set where the worker starts.
    deployments = []
    default_input = str(Path(default_input).expanduser().resolve()) if default_input else None
    root = input_root or inbox
    for name, entrypoint in FLOWS.items():
        parameters: dict[str, Any] = {}
        scheduled: dict[str, Any] = {}  # what the schedule's runs take, over the deployment's defaults
        cron = None
        limit = None
        if name == "screen" and schedule:
            cron = schedule
            # One screen at a time: a night that outlasts the next start queues behind it (and a second run on
            # the same inbox at once would find each output locked and compute nothing).
            limit = 1
            scheduled["input"] = str(Path(inbox).expanduser().resolve())
            if outbox:
                scheduled["output"] = str(Path(outbox).expanduser().resolve())
            if provider:
                scheduled["provider"] = provider
            parameters.update(scheduled)
        if name == "screen" and default_input:
            parameters["input"] = default_input  # the form's default: a file; the night screens the whole inbox
        if name == "validate":
            cron = validate_schedule
            # Nightly means what CI means: the answer against the expected one, and against stock.
            parameters.update({"smoke": True, "against_stock": True})
        remote = flow.from_source(source=str(ROOT), entrypoint=entrypoint)
        schedules = [Cron(cron, timezone=timezone, parameters=scheduled or None)] if cron else None
        deployment = remote.to_deployment(name=name, parameters=parameters, schedules=schedules,
                                          paused=paused if cron else None, tags=tags or ["resident-pool"],
                                          work_pool_name=work_pool,
                                          concurrency_limit=limit)
        describe_form(deployment, choices, loaded,
                      input_root=str(Path(root).expanduser().resolve()) if root else None,
                      default_input=default_input)
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
    parser.add_argument("--default-input", help="the screen form's default input (a file the worker may read)")
    parser.add_argument("--input-root", help="the folder the worker reads inputs under (RESIDENT_POOL_INPUT_ROOT), "
                        "named in the form (default: --inbox)")
    parser.add_argument("--validate-schedule", default=VALIDATE_CRON,
                        help=f"cron for the validate deployment (default {VALIDATE_CRON!r}; '' for none)")
    parser.add_argument("--timezone", help=f"the crons' time zone (default this host's: {host_timezone()})")
    parser.add_argument("--paused", action="store_true", help="register the scheduled deployments paused")
    arguments = parser.parse_args()
    for deployment_id in deploy_all(arguments.work_pool, arguments.manifests, schedule=arguments.schedule,
                                    inbox=arguments.inbox, outbox=arguments.outbox, provider=arguments.provider,
                                    validate_schedule=arguments.validate_schedule or None, paused=arguments.paused,
                                    timezone=arguments.timezone, default_input=arguments.default_input,
                                    input_root=arguments.input_root):
        print(deployment_id)
    # A deployment's flow runs take their folders from the worker's environment (docs/security.md).
    needs = [f"RESIDENT_POOL_MANIFESTS={Path(arguments.manifests).expanduser().resolve()}"]
    if arguments.inbox:
        needs.append(f"RESIDENT_POOL_INPUT_ROOT covering {Path(arguments.inbox).expanduser().resolve()}")
    if arguments.outbox:
        needs.append(f"RESIDENT_POOL_OUTPUT_ROOT covering {Path(arguments.outbox).expanduser().resolve()}")
    print("the worker that runs these needs, in its own environment: " + "; ".join(needs), file=sys.stderr)
