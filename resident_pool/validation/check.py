"""`resident-pool check`: each provider's manifest, interpreter, pinned weights, kit probe and smoke run.

The smoke answer is compared with the provider's expected (golden) answer; with
``against_stock`` also with the same payload answered stock (the kit off). Every
result carries the provenance of what produced it.
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, NamedTuple

from ..admission import read_devices
from ..campaigns.answers import per_input
from ..client import Pool
from ..errors import AdmissionRefused, GoldenMismatch, KitUnavailable, ResidentPoolError, error_from_dict
from ..host.paths import Paths
from ..providers.exec_env import interpreter
from ..providers.kit_rules import KitRow
from ..providers.launch import check_weights, plan_launch
from ..providers.manifest import Manifest, VenvEnv, load_manifest, manifest_path
from ..providers.weights import HashCache
from ..settings import Settings
from . import expected, sanity
from .golden import compare, summary
from .provenance import environment, gpu, gpu_name, host, own_version

__all__ = ["DECLARED", "SmokeRun", "StepResult", "Variant", "check_providers", "junit_xml", "run_smoke"]

NOT_JUDGED = "answers_not_judged"  # the answers step's reason when no smoke run gave answers to judge
STEPS = ("manifest", "interpreter", "weights", "gpu", "kit", "smoke", "answers", "bless", "against-stock")


@dataclass
class StepResult:
    slug: str
    step: str
    ok: bool
    detail: str
    seconds: float = 0.0
    skipped: bool = False
    provenance: dict[str, str] = field(default_factory=dict)  # what produced this result
    data: dict[str, Any] = field(default_factory=dict)  # for scripts: mismatches, the bless diff


def _run(slug: str, step: str, action) -> StepResult:
    started = time.monotonic()
    try:
        answer = action()
    except (ResidentPoolError, OSError, ValueError) as exc:
        data = dict(exc.details) if isinstance(exc, ResidentPoolError) else {}
        return StepResult(slug, step, False, str(exc), time.monotonic() - started, data=data)
    detail, data = answer if isinstance(answer, tuple) else (answer, {})
    return StepResult(slug, step, True, detail or "ok", time.monotonic() - started, data=data)


# -- the smoke run -------------------------------------------------------------


@dataclass(frozen=True)
class Variant:
    """Which build of a provider answers a smoke run: as declared, or stock (its kit off, or no kit).

    A variant is never a new version of the production provider: the pool keeps
    it apart (``slug~stock``), with replicas of its own, so running it drains nothing.
    """

    name: str = "declared"
    kit_mode: str | None = None  # the kit runs in this mode instead of the manifest's
    without_kit: bool = False  # the worker runs plainly, the kit's variables removed

    def manifest(self, manifest: Manifest) -> Manifest:
        return manifest.variant(self.kit_mode, self.without_kit)

    def wire(self, run: str) -> dict[str, Any]:
        """How the pool is told which build to run, as a variant of its own named for this check run."""
        return {"name": f"{self.name}-{run}", "kit_mode": self.kit_mode, "without_kit": self.without_kit}

    def describe(self, manifest: Manifest) -> str:
        if manifest.kit is None:
            return "no kit"
        if self.without_kit:
            return f"without the kit ({manifest.kit.package_name} lists no off mode)"
        return f"kit mode {self.kit_mode or manifest.kit.mode}"


DECLARED = Variant()


def stock_variant(manifest: Manifest, row: KitRow) -> Variant:
    """Stock: the kit's own ``off`` mode where its MODES lists one, else the worker without the kit."""
    if "off" in (row.modes or []):
        return Variant("stock", kit_mode="off")
    return Variant("stock", without_kit=True)


class SmokeRun(NamedTuple):
    result: Any
    transcript: Path | None
    lease: dict[str, Any]  # what answered: its kit as it said at start, its device, version and pid


def run_smoke(manifest: Manifest, payload: Any, variant: Variant = DECLARED, priority: str = "normal") -> SmokeRun:
    """Answer ``payload`` through this host's pool, on a fresh worker of ``manifest``'s provider as ``variant``.

    Through the pool, so a smoke run is admitted against the same GPU ledger as everything
    else: it waits for its budget, and a budget no device holds fails with AdmissionRefused.
    On a worker of its own (a variant named for this run, never the warm production one), started
    now from what is installed now, and stopped after, whatever happened. ``priority``: the class it waits in
    (a CI validation's default is ``normal``).
    """
    name = f"{manifest.slug}~{variant.name}-{secrets.token_hex(3)}"
    with Pool(manifests=manifest.directory.parent) as pool:
        try:
            wire = variant.wire(name.rsplit("-", 1)[1])
            with pool.session(manifest.slug, variant=wire, priority=priority) as session:
                result = session.predict(payload)
                transcript = Path(session.transcript) if session.transcript else None
                lease = dict(session.lease)
        except ResidentPoolError as error:
            raise _named_for_people(error, name, manifest.slug, variant) from None
        finally:
            pool.stop(name, now=True)
    return SmokeRun(result, transcript, lease)


def _named_for_people(error: ResidentPoolError, key: str, slug: str, variant: Variant) -> ResidentPoolError:
    """The error with the provider as people name it: the pool names a check's own build by its key
    (``refuses~declared-1d2c9f``), which means nothing to a reader. Paths that hold the key (a transcript's)
    are left whole: they are where the file is."""
    said = slug if variant.name == DECLARED.name else f"{slug} ({variant.name})"
    alone = re.compile(r"(?<![\w/.~-])" + re.escape(key) + r"(?![\w~-])")
    data = error.to_dict()
    for name in ("error", "headline"):
        if isinstance(data.get(name), str):
            data[name] = alone.sub(said, data[name])
    data["slug"] = slug
    return error_from_dict(data)


def kit_says(transcript: Path | None, package: str) -> tuple[str | None, str]:
    """The kit's own verdict in a transcript: ACTIVE, NOT ACTIVE or None, and its last such line."""
    if transcript is None:
        return None, ""
    pattern = re.compile(rf"(?<![\w.]){re.escape(package)}: (NOT ACTIVE|ACTIVE)\b")
    verdict, said = None, ""
    with open(transcript, encoding="utf-8", errors="replace") as handle:
        while line := handle.readline(64 * 1024):
            line = _ANSI.sub("", line)  # a coloured line is still the kit's word
            if found := pattern.search(line):
                verdict, said = found.group(1), line.strip()[:300]
    return verdict, said


def _answered_by(lease: dict[str, Any]) -> str:
    slug, _, variant = str(lease.get("slug")).partition("~")  # the check's own build: named as people name it
    build = f", the check's {variant.rsplit('-', 1)[0]} build" if variant else ""
    return (f"pid {lease.get('pid')} ({slug}{build}, version {lease.get('version')}, "
            f"device {lease.get('device') if lease.get('device') not in (None, '') else 'cpu'})")


def _what_answered(lease: dict[str, Any], fake_nvml: Path | None) -> dict[str, str]:
    """Provenance from the worker that answered, over what the check's own probe saw: they differ when
    the pool's environment differs from this command's."""
    device = lease.get("device")
    out = {"gpu.device": "cpu" if device in (None, "") else f"GPU {device}"}
    if device not in (None, ""):
        name = gpu_name(int(str(device).split(",")[0]), fake_nvml)
        if name:
            out["gpu"] = name  # the card that answered, not every card on the host
    for key, value in (lease.get("kit") or {}).items():
        if value is not None:
            out[f"kit.{key}"] = str(value)
    return out


def _refuse_varying(manifest: Manifest, first: SmokeRun, second: SmokeRun) -> None:
    """A field that differs between the answers of two fresh workers cannot be expected: it must be ignored."""
    varying = compare(first.result, second.result, expected.tolerance(manifest))
    if varying:
        fields = ", ".join(sorted({m.path for m in varying})[:10])
        raise GoldenMismatch(
            f"{manifest.slug}: two fresh workers answered the smoke payload differently, in {fields}; a "
            f"golden answer cannot hold fields that vary: add them to [smoke] ignore in {manifest.path}, or "
            "loosen the tolerance", slug=manifest.slug, reason="answer_varies",
            details={"mismatches": [m.to_dict() for m in varying]})


# -- provenance ----------------------------------------------------------------


def _describe_provider(manifest: Manifest, python: str | None, row: KitRow | None,
                       results: list[StepResult], fake_nvml: Path | None) -> dict[str, str]:
    """What produces this provider's answers: manifest, weights, kit, environment, GPU."""
    out = {"manifest.fingerprint": manifest.fingerprint()}
    weights = next((r for r in results if r.step == "weights"), None)
    files = len(manifest.weights.files)
    if not files:
        out["weights.pins"] = "no pinned files"
    elif weights is not None and weights.ok:
        out["weights.pins"] = f"{files} of {files} files at their pins (size and sha256)"
    else:
        out["weights.pins"] = "not verified: see the weights step"
    kit = manifest.kit
    if kit is None:
        out["kit"] = "none"
    else:
        out.update({"kit.package": kit.package_name, "kit.mode": kit.mode})
        if row is None:
            out["kit.version"] = "unknown: the kit was not probed"
        else:
            out["kit.version"] = str(row.version) if row.version else "unknown: the kit has no __version__"
            out["kit.activation"] = row.activation
            out["kit.jit_cache_key"] = row.jit_cache_key or (
                f"none: {row.jit_cache_key_error}" if row.jit_cache_key_error else "none")
    out.update(environment(manifest, python) if python else {"env.python": "unknown: the interpreter step failed"})
    out.update(gpu(fake_nvml))
    return out


def _against_stock(manifest: Manifest, payload: dict[str, Any], declared: SmokeRun, row: KitRow,
                   extras: dict[str, str], priority: str = "normal") -> str:
    """Run the payload stock and compare; the kit's own ACTIVE line must not say it engaged nothing."""
    kit, tol = manifest.kit, expected.tolerance(manifest)
    assert kit is not None
    variant = stock_variant(manifest, row)
    stock_how = variant.describe(manifest)
    extras["stock.kit.mode"] = stock_how
    stock = run_smoke(manifest, payload, variant, priority)
    extras["stock.transcript"] = str(stock.transcript)
    extras["stock.worker"] = _answered_by(stock.lease)
    said, said_line = kit_says(declared.transcript, kit.package_name)
    stock_said, stock_line = kit_says(stock.transcript, kit.package_name)
    extras["stock.kit.active"] = stock_line or "no ACTIVE line"
    problems, reasons = [], []
    if said == "NOT ACTIVE":
        problems.append(f"the kit engaged nothing: its transcript {declared.transcript} says {said_line!r}")
        reasons.append("kit_not_active")
    if stock_said == "ACTIVE":
        problems.append(f"the stock run ({stock_how}) is not stock: its transcript {stock.transcript} says "
                        f"{stock_line!r}")
        reasons.append("stock_not_stock")
    mismatches = compare(stock.result, declared.result, tol)
    if mismatches:
        problems.append(f"the kit (mode {kit.mode}) changes the answer beyond {tol.describe()} against stock "
                        f"({stock_how}) in {len(mismatches)} field(s):\n" + summary(mismatches, "stock", "kit"))
        reasons.append("kit_changes_answer")
    if problems:
        error = GoldenMismatch if mismatches else KitUnavailable
        raise error(f"{manifest.slug}: " + "; ".join(problems), slug=manifest.slug, reason=reasons[0],
                    transcript=str(declared.transcript),
                    details={"reasons": reasons, "mismatches": [m.to_dict() for m in mismatches]})
    engaged = said_line or f"{kit.package_name} printed no ACTIVE line"
    return f"the kit (mode {kit.mode}) answers as stock ({stock_how}) within {tol.describe()}; {engaged}"


# -- the checks ----------------------------------------------------------------


def check_provider(path: Path, smoke: bool = False, cache: HashCache | None = None, *, config: Settings,
                   paths: Paths, against_stock: bool = False, bless: bool = False, force: bool = False,
                   priority: str = "normal") -> list[StepResult]:
    """Every step for the provider whose manifest is at ``path``; later steps skip after a failure.

    ``smoke`` runs the smoke payload and compares the answer with the expected one;
    ``against_stock`` also runs it stock and compares; ``bless`` records the answer as
    the expected one (over an existing file only with ``force``); ``priority``: the class its smoke runs wait in.
    ``config`` and ``paths``: the settings and folders a start would have (the probe is planned as a start is).
    """
    cache = cache or HashCache.of(paths)
    slug = path.parent.name
    holder: dict[str, Any] = {}
    provenance = {"host": host(), "resident_pool.version": own_version(), "manifest.path": str(path)}

    def manifest_step():
        holder["manifest"] = load_manifest(path)
        return f"{path}"

    results = [_run(slug, "manifest", manifest_step)]
    if not results[0].ok:
        last = ["bless"] if bless else ["smoke"] if smoke or against_stock else []
        later = ["interpreter", "weights", "gpu", "kit", *last, *(["against-stock"] if against_stock else [])]
        results += [StepResult(slug, step, False, "skipped: the manifest is not valid", skipped=True)
                    for step in later]
        return _stamp(results, provenance, {})
    manifest = holder["manifest"]
    python_holder: dict[str, str] = {}

    def interpreter_step():
        python_holder["python"] = interpreter(manifest)
        return python_holder["python"]

    def weights_step():
        python = python_holder.get("python") if isinstance(manifest.env, VenvEnv) else None
        report = check_weights(manifest, python, cache=cache)
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
            row = holder["row"] = plan_launch(manifest, os.path.join(run_dir, "worker.sock"), config=config,
                                              paths=paths, cache=cache).row
        detail = (f"{row.package} {row.activation}, MODEL_OPT {row.model_opt} ({row.model_opt_source}), "
                  f"mode variable {row.mode_env}, {len(row.env)} variables")
        if row.jit_cache_key_error:
            detail += f"; jit_cache_key failed: {row.jit_cache_key_error}"
        return detail

    def gpu_step():
        return _gpu_feasible(manifest, config)

    steps = [("interpreter", interpreter_step), ("weights", weights_step), ("gpu", gpu_step), ("kit", kit_step)]
    failed = False
    for step, action in steps:
        if failed and step in ("kit", "smoke"):
            results.append(StepResult(slug, step, False, "skipped: an earlier step failed", skipped=True))
            continue
        result = _run(slug, step, action)
        failed = failed or not result.ok
        results.append(result)
    provenance.update(_describe_provider(manifest, python_holder.get("python"), holder.get("row"), results,
                                         config.fake_nvml))
    extras = _answer_steps(manifest, python_holder.get("python"), holder.get("row"), results, provenance,
                           smoke=smoke, against_stock=against_stock, bless=bless, force=force, priority=priority,
                           fake_nvml=config.fake_nvml)
    return _stamp(results, provenance, extras)


def _gpu_feasible(manifest: Manifest, config: Settings) -> str:
    """Whether this host can ever admit the provider: a budget no device holds fails every start."""
    gpu_spec = manifest.gpu
    if gpu_spec.policy == "none":
        return "no GPU asked for"
    devices, source = read_devices(config)
    if not devices:
        if gpu_spec.policy == "recommended":
            return f"no GPU capacity known ({source}): it runs on the CPU here"
        raise AdmissionRefused(f"{manifest.slug}: needs {gpu_spec.vram_budget_gb:g} GB of GPU memory but no GPU "
                               f"capacity is known ({source})", slug=manifest.slug)
    headroom = config.gpu_headroom_gb
    largest = max(d.total_gb for d in devices) - headroom
    if gpu_spec.vram_budget_gb > largest:
        raise AdmissionRefused(
            f"{manifest.slug}: needs {gpu_spec.vram_budget_gb:g} GB but the largest device holds {largest:g} GB "
            f"after {headroom:g} GB headroom ({source}); it can never be admitted here", slug=manifest.slug)
    return f"{gpu_spec.vram_budget_gb:g} GB fits the largest device ({largest:g} GB after headroom, {source})"


class _Smoke:
    """One provider's smoke run and what is judged of it: the golden answer, the [answers] checks, a blessing,
    the stock comparison. Each method is one step; they share the run."""

    def __init__(self, manifest: Manifest, row: KitRow | None, provenance: dict[str, str],
                 extras: dict[str, dict[str, str]], step: str, priority: str, fake_nvml: Path | None) -> None:
        self.manifest, self.row, self.provenance, self.extras = manifest, row, provenance, extras
        self.step, self.priority, self.fake_nvml = step, priority, fake_nvml
        self.chosen: expected.SmokeSet | None = None
        self.run: SmokeRun | None = None

    def answer(self) -> Any:
        manifest = self.manifest
        chosen = self.chosen = expected.smoke_set(manifest)
        run = self.run = run_smoke(manifest, chosen.payload, priority=self.priority)
        self.extras[self.step] = {"smoke.transcript": str(run.transcript), "smoke.worker": _answered_by(run.lease)}
        self.provenance.update(_what_answered(run.lease, self.fake_nvml))
        if manifest.kit is not None:
            self.provenance["kit.active"] = kit_says(run.transcript, manifest.kit.package_name)[1] or "no ACTIVE line"
        if self.step == "bless":
            return "answered"
        return expected.verdict(manifest, chosen.payload, run.result, run.transcript)

    def judge(self) -> tuple[str, dict[str, Any]]:
        chosen, run, slug = self.chosen, self.run, self.manifest.slug
        assert chosen is not None and run is not None
        found = sanity.judge(self.manifest.answers, chosen.ids, chosen.texts,
                             per_input(run.result, len(chosen.texts)))
        if not found.ok:
            raise GoldenMismatch(f"{slug}: the answers to its {len(chosen.texts)} smoke inputs fail their [answers] "
                                 "checks: " + "; ".join(found.problems), slug=slug, reason="answers_degenerate",
                                 transcript=str(run.transcript), details={"figures": found.figures})
        return f"the answers to {len(chosen.texts)} smoke inputs: {found.describe()}", {"figures": found.figures}

    def bless(self, force: bool) -> tuple[str, dict[str, Any]]:
        chosen, run = self.chosen, self.run
        assert chosen is not None and run is not None
        # A second start answers too: what differs between them varies, and cannot be expected.
        _refuse_varying(self.manifest, run, run_smoke(self.manifest, chosen.payload, priority=self.priority))
        return expected.bless(self.manifest, chosen.payload, run.result, self.provenance, force=force)

    def stock(self) -> str:
        assert self.chosen is not None and self.run is not None and self.row is not None
        return _against_stock(self.manifest, self.chosen.payload, self.run, self.row,
                              self.extras.setdefault("against-stock", {}), self.priority)


def _answer_steps(manifest: Manifest, python: str | None, row: KitRow | None, results: list[StepResult],
                  provenance: dict[str, str], *, smoke: bool, against_stock: bool, bless: bool,
                  force: bool, fake_nvml: Path | None, priority: str = "normal") -> dict[str, dict[str, str]]:
    """The steps that run the smoke payload (smoke then answers, or answers then bless; then against-stock); returns
    their own provenance. ``answers`` judges what the answers mean ([answers]): bless refuses answers it fails."""
    slug, extras = manifest.slug, {}
    first = "bless" if bless else "smoke" if smoke or against_stock else None
    judged = first is not None and manifest.answers.embedding is not None
    wanted = [step for step in (first, "answers" if judged else None, "against-stock" if against_stock else None)
              if step]
    if any(not r.ok for r in results):
        results += [StepResult(slug, step, False, "skipped: an earlier step failed", skipped=True) for step in wanted]
        return extras
    if first is None and manifest.answers.embedding is not None:
        # Said, not silent: a check that passes a degenerate model must not read as one that judged its answers.
        results.append(StepResult(slug, "answers", False, f"not judged: the [answers] checks run over the smoke "
                                  f"answers; run `resident-pool check --smoke {slug}`", skipped=True,
                                  data={"reason": NOT_JUDGED}))
    steps = _Smoke(manifest, row, provenance, extras, first or "smoke", priority, fake_nvml)
    if first:
        ran = _run(slug, first, steps.answer)
        if not bless or not ran.ok:
            results.append(ran)
        if judged:
            results.append(_run(slug, "answers", steps.judge) if steps.run is not None else
                           StepResult(slug, "answers", False, "skipped: the smoke run gave no answer", skipped=True))
        if bless and ran.ok:
            if judged and not results[-1].ok:
                results.append(StepResult(slug, "bless", False, f"not blessed: {results[-1].detail}", ran.seconds,
                                          data={"reason": "answers_degenerate"}))
            else:
                blessed = _run(slug, "bless", lambda: steps.bless(force))
                blessed.seconds += ran.seconds
                results.append(blessed)
        recorded = next((r.data.get("expected_file") for r in results if r.step == first), None)
        if recorded and os.path.isfile(recorded):
            digest = hashlib.sha256(Path(recorded).read_bytes()).hexdigest()
            extras.setdefault(first, {})["smoke.expected"] = f"{recorded} (sha256 {digest[:16]})"
    if against_stock:
        if manifest.kit is None or steps.run is None:
            why = "no kit: the smoke run is stock" if manifest.kit is None else "the smoke run gave no answer"
            results.append(StepResult(slug, "against-stock", False, f"skipped: {why}", skipped=True))
        else:
            results.append(_run(slug, "against-stock", steps.stock))
    return extras


def _stamp(results: list[StepResult], provenance: dict[str, str],
           extras: dict[str, dict[str, str]]) -> list[StepResult]:
    for result in results:
        result.provenance = {**provenance, **extras.get(result.step, {})}
    return results


def check_providers(directory: Path, slugs: Iterable[str] = (), smoke: bool = False, *, config: Settings,
                    paths: Paths, against_stock: bool = False, bless: bool = False,
                    force: bool = False) -> list[StepResult]:
    """Check the named providers (all under ``directory`` when none is named)."""
    wanted = list(slugs)
    manifests = [manifest_path(directory, slug) for slug in wanted] or sorted(directory.glob("*/manifest.toml"))
    cache = HashCache.of(paths)
    results: list[StepResult] = []
    for path in manifests:
        results += check_provider(path, smoke=smoke, cache=cache, config=config, paths=paths,
                                  against_stock=against_stock, bless=bless, force=force)
    return results


_ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]")
_NOT_XML = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ufffe\uffff]")


def _xml_text(text: str) -> str:
    """XML 1.0 has no place for most control characters: a coloured line or a traceback must not make the
    whole report unreadable exactly when something failed."""
    return _NOT_XML.sub("", _ANSI.sub("", str(text)))


def _properties(parent: ET.Element, values: dict[str, str]) -> None:
    if values:
        holder = ET.SubElement(parent, "properties")
        for name, value in values.items():
            ET.SubElement(holder, "property", name=_xml_text(name), value=_xml_text(value))


def junit_xml(results: list[StepResult]) -> str:
    """JUnit XML: one test suite per provider, one test case per step, provenance as properties of both.

    Every JUnit consumer reads a suite's properties; GitHub's and Jenkins' reporters
    also read a test case's.
    """
    # No "skipped" on <testsuites>: Jenkins' xUnit schema refuses it there (each suite carries its own).
    root = ET.Element("testsuites", name="resident-pool check", tests=str(len(results)),
                      failures=str(sum(not r.ok and not r.skipped for r in results)),
                      time=f"{sum(r.seconds for r in results):.3f}")
    stamp = datetime.now(UTC).isoformat(timespec="seconds")
    for slug in dict.fromkeys(r.slug for r in results):
        group = [r for r in results if r.slug == slug]
        suite = ET.SubElement(root, "testsuite", name=f"resident-pool.{slug}", hostname=os.uname().nodename,
                              timestamp=stamp, tests=str(len(group)), errors="0",
                              failures=str(sum(not r.ok and not r.skipped for r in group)),
                              skipped=str(sum(r.skipped for r in group)),
                              time=f"{sum(r.seconds for r in group):.3f}")
        shared = {k: v for k, v in group[0].provenance.items() if all(r.provenance.get(k) == v for r in group)}
        _properties(suite, shared)
        for result in group:
            case = ET.SubElement(suite, "testcase", classname=f"resident-pool.{result.slug}", name=result.step,
                                 time=f"{result.seconds:.3f}")
            _properties(case, result.provenance)
            detail = _xml_text(result.detail)
            if result.skipped:
                ET.SubElement(case, "skipped", message=detail)
            elif not result.ok:
                failure = ET.SubElement(case, "failure", message=detail.splitlines()[0][:500] if detail else "")
                failure.text = detail
            else:
                ET.SubElement(case, "system-out").text = detail
    ET.indent(root)
    return ET.tostring(root, encoding="unicode", xml_declaration=True) + "\n"
