"""Kit validation for CI: every provider's manifest, weights against pins, kit probe, and (with smoke) its
answer against the expected one and (with against_stock) against the same payload answered stock."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from prefect import flow, task
from prefect.artifacts import create_table_artifact

from resident_pool.client import default_manifests
from resident_pool.prefect import Priority
from resident_pool.prefect.roots import check_path
from resident_pool.providers.manifest import manifest_path
from resident_pool.validation.check import check_provider
from resident_pool.validation.provenance import columns


@task(name="check-provider")
def check_one(manifest_path: str, smoke: bool, against_stock: bool = False, priority: str = "normal") -> list[dict]:
    return [result.__dict__ for result in check_provider(Path(manifest_path), smoke=smoke,
                                                         against_stock=against_stock, priority=priority)]


class ValidationFailed(RuntimeError):
    """At least one provider failed validation."""


@flow(name="validate", log_prints=True)
def validate(manifests: str | None = None, smoke: bool = False, providers: list[str] | None = None,
             against_stock: bool = False, priority: Priority = "normal") -> list[dict]:
    """Check every provider (or the named ones); fail the flow if any step fails. ``priority``: the class its
    smoke runs wait in for a worker (CI's default: normal, behind people at the UI, ahead of campaigns)."""
    if manifests is not None:
        check_path(manifests, "manifests")  # a deployment's run checks only the worker host's providers
    directory = default_manifests(manifests)
    paths = [manifest_path(directory, slug) for slug in providers or []] or sorted(
        directory.glob("*/manifest.toml"))
    futures = [check_one.submit(str(path), smoke, against_stock, priority) for path in paths]
    rows = [row for future in futures for row in future.result()]
    table = [{"provider": r["slug"], "step": r["step"],
              "result": "skipped" if r["skipped"] else ("ok" if r["ok"] else "FAILED"),
              "detail": r["detail"], **columns(r["provenance"])} for r in rows]
    failed = [r for r in rows if not r["ok"] and not r["skipped"]]
    named = ", ".join(f"{r['slug']} {r['step']}" for r in failed)
    create_table_artifact(key="resident-pool-validation", table=table,
                          description=f"provider validation of {directory}: "
                          + (f"{len(failed)} failed step(s): {named}" if failed else "every step passed"))
    for row in table:
        print(f"{row['provider']:>12} {row['step']:<13} {row['result']:<8} {row['detail'].splitlines()[0]}")
    if failed:
        raise ValidationFailed("; ".join(f"{r['slug']} {r['step']}: {r['detail'].splitlines()[0]}" for r in failed))
    return rows


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--manifests")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--against-stock", action="store_true")
    parser.add_argument("providers", nargs="*")
    arguments = parser.parse_args()
    state = validate(manifests=arguments.manifests, smoke=arguments.smoke, providers=arguments.providers or None,
                     against_stock=arguments.against_stock, return_state=True)
    sys.exit(0 if state.is_completed() else 1)
