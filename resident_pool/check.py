"""`resident-pool check`: each provider's manifest, interpreter, pinned weights, kit probe and smoke run."""

from __future__ import annotations

import os
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from .errors import ResidentPoolError
from .exec_env import interpreter
from .launch import check_weights, plan_launch, worker_for
from .manifest import Manifest, VenvEnv, load_manifest
from .weights import HashCache

__all__ = ["StepResult", "check_providers", "junit_xml"]

STEPS = ("manifest", "interpreter", "weights", "kit", "smoke")


@dataclass
class StepResult:
    slug: str
    step: str
    ok: bool
    detail: str
    seconds: float = 0.0
    skipped: bool = False


def _run(slug: str, step: str, action) -> StepResult:
    started = time.monotonic()
    try:
        detail = action()
    except (ResidentPoolError, OSError, ValueError) as exc:
        return StepResult(slug, step, False, str(exc), time.monotonic() - started)
    return StepResult(slug, step, True, detail or "ok", time.monotonic() - started)


def check_provider(path: Path, smoke: bool = False, cache: HashCache | None = None) -> list[StepResult]:
    """Every step for the provider whose manifest is at ``path``; later steps skip after a failure."""
    slug = path.parent.name
    holder: dict[str, Manifest] = {}

    def manifest_step():
        holder["manifest"] = load_manifest(path)
        return f"{path}"

    results = [_run(slug, "manifest", manifest_step)]
    if not results[0].ok:
        return results + [StepResult(slug, step, False, "skipped: the manifest is not valid", skipped=True)
                          for step in STEPS[1:] if smoke or step != "smoke"]
    manifest = holder["manifest"]
    python_holder: dict[str, str] = {}

    def interpreter_step():
        python_holder["python"] = interpreter(manifest)
        return python_holder["python"]

    def weights_step():
        python = python_holder.get("python") if isinstance(manifest.env, VenvEnv) else None
        report = check_weights(manifest, python, cache)
        if not report.ok:
            raise report.error()
        if not manifest.weights.files:
            return "no pinned files"
        return f"{report.checked} files at their pins under {report.root}"

    def kit_step():
        if manifest.kit is None:
            return "no kit"
        # The plan a start builds: the probe runs under the worker's environment (and in its
        # container), and every start rule is applied, so a kit that check passes can start.
        with tempfile.TemporaryDirectory(prefix="rp-check-") as run_dir:
            row = plan_launch(manifest, os.path.join(run_dir, "worker.sock"), cache=cache).row
        detail = (f"{row.package} {row.activation}, MODEL_OPT {row.model_opt} ({row.model_opt_source}), "
                  f"mode variable {row.mode_env}, {len(row.env)} variables")
        if row.jit_cache_key_error:
            detail += f"; jit_cache_key failed: {row.jit_cache_key_error}"
        return detail

    def smoke_step():
        worker = worker_for(manifest, replica=99)
        try:
            result = worker.request(manifest.smoke.payload)
        finally:
            worker.close()
        return f"one prediction answered ({len(str(result))} characters) by pid {worker.pid}"

    steps = [("interpreter", interpreter_step), ("weights", weights_step), ("kit", kit_step)]
    if smoke:
        steps.append(("smoke", smoke_step))
    failed = False
    for step, action in steps:
        if failed and step in ("kit", "smoke"):
            results.append(StepResult(slug, step, False, "skipped: an earlier step failed", skipped=True))
            continue
        result = _run(slug, step, action)
        failed = failed or not result.ok
        results.append(result)
    return results


def check_providers(directory: Path, slugs: Iterable[str] = (), smoke: bool = False) -> list[StepResult]:
    """Check the named providers (all under ``directory`` when none is named)."""
    wanted = list(slugs)
    paths = [directory / slug / "manifest.toml" for slug in wanted] or sorted(directory.glob("*/manifest.toml"))
    cache = HashCache()
    results: list[StepResult] = []
    for path in paths:
        results += check_provider(path, smoke=smoke, cache=cache)
    return results


def junit_xml(results: list[StepResult]) -> str:
    """JUnit XML: one test case per provider and step, for CI systems."""
    suite = ET.Element("testsuite", name="resident-pool check", hostname=os.uname().nodename,
                       tests=str(len(results)),
                       failures=str(sum(not r.ok and not r.skipped for r in results)),
                       skipped=str(sum(r.skipped for r in results)),
                       time=f"{sum(r.seconds for r in results):.3f}")
    for result in results:
        case = ET.SubElement(suite, "testcase", classname=f"resident-pool.{result.slug}", name=result.step,
                             time=f"{result.seconds:.3f}")
        if result.skipped:
            ET.SubElement(case, "skipped", message=result.detail)
        elif not result.ok:
            failure = ET.SubElement(case, "failure", message=result.detail.splitlines()[0][:500])
            failure.text = result.detail
        else:
            ET.SubElement(case, "system-out").text = result.detail
    root = ET.Element("testsuites")
    root.append(suite)
    ET.indent(root)
    return ET.tostring(root, encoding="unicode", xml_declaration=True) + "\n"
