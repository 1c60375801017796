"""Kit validation for CI: every provider's manifest, weights against pins, kit probe, and (with smoke) its
answer against the expected one, its answers judged by its [answers] checks, and (with against_stock) against the
same payload answered stock.

One task run per provider, named after it, that fails when that provider fails:
the run's task list says which providers failed, and the table lists failures first.
The providers are those of the worker host's own configuration
(``RESIDENT_POOL_MANIFESTS``), never a flow parameter.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_table_artifact
from prefect.states import Failed

from resident_pool.client import default_manifests
from resident_pool.errors import ResidentPoolError
from resident_pool.prefect import Priority, escape_markdown, host_settings
from resident_pool.providers.manifest import SLUG
from resident_pool.validation.check import STEPS, check_provider
from resident_pool.validation.provenance import columns

# A smoke run's worker is a variant of its own (``crashy~declared-eb8681``): internal, and its "~" strikes a
# table cell through. Said as the provider and the build it ran.
# A file name holding one (a transcript's path) is left whole: it must still name the file.
_VARIANT_KEY = re.compile(r"(?<![\w/.~-])([a-z0-9][a-z0-9_-]*)~([a-z]+)-[0-9a-f]{6}\b(?!-\d)")


class ValidationFailed(ResidentPoolError):
    """At least one provider failed validation; ``details["rows"]`` holds its steps."""

    default_reason = "validation_failed"


def user_facing(text: str) -> str:
    """``crashy~declared-eb8681`` as ``crashy (declared build)``: no internal variant key reaches a person."""
    return _VARIANT_KEY.sub(lambda m: f"{m[1]} ({m[2]} build)", text)


def _first_line(text: str) -> str:
    return next((line for line in text.splitlines() if line.strip()), "")


@task(name="check-provider", task_run_name="check {slug}")
def check_one(slug: str, manifest_path: str, smoke: bool, against_stock: bool = False, priority: str = "normal"
              ) -> list[dict]:
    """One provider's steps; fails, naming each failed step, when any failed."""
    config, where = host_settings()
    rows = [{**result.__dict__, "detail": user_facing(result.detail)}
            for result in check_provider(Path(manifest_path), smoke=smoke, config=config, paths=where,
                                         against_stock=against_stock, priority=priority)]
    failed = [row for row in rows if not row["ok"] and not row["skipped"]]
    if failed:
        raise ValidationFailed(f"{slug}: " + "; ".join(f"{row['step']}: {_first_line(row['detail'])}"
                                                       for row in failed), slug=slug, details={"rows": rows})
    return rows


def _paths(directory: Path, providers: list[str] | None) -> list[Path]:
    known = sorted(path.parent.name for path in directory.glob("*/manifest.toml") if SLUG.fullmatch(path.parent.name))
    if not providers:
        return [directory / slug / "manifest.toml" for slug in known]
    unknown = [name for name in providers if name not in known]  # a whole known name, never a path
    if unknown:
        raise ValidationFailed(f"unknown provider(s) {', '.join(map(repr, unknown))}; the providers of {directory} are "
                               f"{', '.join(known) or 'none'}", reason="unknown_provider")
    return [directory / slug / "manifest.toml" for slug in dict.fromkeys(providers)]


def _order(row: dict) -> tuple:
    """Failures first, then what passed, then what was skipped; each by provider and step."""
    rank = 2 if row["skipped"] else (0 if not row["ok"] else 1)
    step = STEPS.index(row["step"]) if row["step"] in STEPS else len(STEPS)
    return rank, row["slug"], step


@flow(name="validate", log_prints=True)
def validate(smoke: bool = False, providers: list[str] | None = None, against_stock: bool = False,
             priority: Priority = "normal") -> list[dict]:
    """Check every provider (or the named ones); the run fails, as does each failed provider's task.

    Args:
        smoke: Also send each provider its [smoke] payload, compare the answer with its expected one, and judge
            what the answers mean where the provider declares [answers] (distinct inputs, distinct answers).
        providers: The providers to check (default: every provider of the worker's host).
        against_stock: Also answer the smoke payload stock (the kit off) and compare the two answers.
        priority: The class its smoke runs wait in for a worker (CI's default: normal, behind people at the UI,
            ahead of campaigns).
    """
    logger = get_run_logger()
    directory = default_manifests(None, *host_settings())  # the worker host's configuration, never a parameter
    try:
        paths = _paths(directory, providers)
    except ValidationFailed as error:
        logger.error("%s", error)
        return Failed(message=str(error))
    futures = {path.parent.name: check_one.submit(path.parent.name, str(path), smoke, against_stock, priority)
               for path in paths}
    rows, failed_providers = [], []
    for slug, future in futures.items():
        outcome = future.result(raise_on_failure=False)
        if isinstance(outcome, BaseException):
            failed_providers.append(slug)
            rows += outcome.details.get("rows", []) if isinstance(outcome, ResidentPoolError) else [
                {"slug": slug, "step": "check", "ok": False, "skipped": False, "detail": str(outcome),
                 "provenance": {}}]
        else:
            rows += outcome
    rows.sort(key=_order)
    failed = [r for r in rows if not r["ok"] and not r["skipped"]]
    table = [{"provider": escape_markdown(r["slug"]), "step": r["step"],
              "result": "skipped" if r["skipped"] else ("ok" if r["ok"] else "FAILED"),
              "detail": escape_markdown(r["detail"]),  # every line, joined: a cell holds one
              **{k: escape_markdown(str(v)) for k, v in columns(r["provenance"]).items()}} for r in rows]
    named = ", ".join(f"{r['slug']} {r['step']}" for r in failed)
    create_table_artifact(key="resident-pool-validation", table=table,
                          description=escape_markdown(f"provider validation of {directory}: " + (
                              f"{len(failed_providers)} provider(s) failed ({', '.join(failed_providers)}); "
                              f"{len(failed)} failed step(s): {named}" if failed else "every step passed")))
    for row in rows:
        result = "skipped" if row["skipped"] else ("ok" if row["ok"] else "FAILED")
        print(f"{row['slug']:>12} {row['step']:<13} {result:<8} {_first_line(row['detail'])}")
    if failed_providers:
        raise ValidationFailed(f"{len(failed_providers)} provider(s) failed: " + "; ".join(
            f"{r['slug']} {r['step']}: {_first_line(r['detail'])}" for r in failed))
    return rows


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--manifests", help="the providers' folder (this process's RESIDENT_POOL_MANIFESTS)")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--against-stock", action="store_true")
    parser.add_argument("providers", nargs="*")
    arguments = parser.parse_args()
    if arguments.manifests:
        os.environ["RESIDENT_POOL_MANIFESTS"] = str(Path(arguments.manifests).expanduser().resolve())
    state = validate(smoke=arguments.smoke, providers=arguments.providers or None,
                     against_stock=arguments.against_stock, return_state=True)
    sys.exit(0 if state.is_completed() else 1)
