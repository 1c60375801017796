"""A provider's expected (golden) smoke answer: the file beside its manifest, checked against and blessed.

The file (``[smoke] expected``) is JSON: ``format``, the ``payload`` it answers,
the ``result`` (ignored fields left out, float32 base64 fields stored decoded as
numbers so a diff is readable), and ``blessed``: when, and the provenance of the
run that produced it.
"""

from __future__ import annotations

import json
import os
import stat
import tempfile
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ..campaigns.inputs import InputFile
from ..errors import GoldenMismatch, InputError, ManifestError, ResidentPoolError
from ..providers.input_rules import kind_option
from ..providers.manifest import Manifest
from .golden import Tolerance, compare, normalize, summary

__all__ = ["FORMAT", "SmokeSet", "bless", "expected_file", "read_expected", "smoke_set", "tolerance", "verdict"]

FORMAT = 1
MAX_BYTES = 64 * 1024 * 1024
# Paths on the blessing machine: noise in a file that is committed and read on other hosts.
_LOCAL = frozenset({"manifest.path", "env.executable"})


def tolerance(manifest: Manifest) -> Tolerance:
    smoke = manifest.smoke
    return Tolerance(smoke.atol, smoke.rtol, smoke.cosine_min, tuple(smoke.ignore), tuple(smoke.float32_base64))


def expected_file(manifest: Manifest) -> Path | None:
    return manifest.directory / manifest.smoke.expected if manifest.smoke.expected else None


@dataclass(frozen=True)
class SmokeSet:
    """What a smoke run sends (``payload``) and, where it sends inputs, their ids and texts in order."""

    payload: dict[str, Any]
    ids: list[str]
    texts: list[str]


def smoke_set(manifest: Manifest) -> SmokeSet:
    """The smoke payload: ``[smoke] payload``, its "inputs" read from ``[smoke] inputs`` where that names a file.

    The file is read as a campaign reads an input file and each input ruled by ``[inputs]``, so a smoke set
    holds only what a campaign could send; a bad one is a ManifestError naming its line.
    """
    smoke, slug = manifest.smoke, manifest.slug
    if smoke.inputs is None:
        inputs = smoke.payload.get("inputs")
        texts = list(inputs) if isinstance(inputs, list) and all(isinstance(t, str) for t in inputs) else []
        return SmokeSet(dict(smoke.payload), [str(number) for number in range(1, len(texts) + 1)], texts)
    path = manifest.directory / smoke.inputs

    def refuse(why: str) -> ManifestError:
        return ManifestError(f"{slug}: the smoke inputs {why}", slug=slug, details={"field": "smoke.inputs"})

    _owned(path, refuse)
    try:
        source = InputFile(path)
        source.check()
        records = list(source.records())
    except InputError as error:
        raise refuse(f"cannot be read: {error}") from None
    kind = manifest.inputs.kind_for(source.kind)
    ids, texts = [], []
    for record in records:
        text, problem = (record.text, record.error) if record.error else manifest.inputs.check(record.text, kind)
        if record.error is None and problem is not None:
            problem = f"{path}:{record.line}: {record.id}: {problem}"
        if problem is not None:
            raise refuse(f"hold an input {slug} refuses, {problem}")
        ids.append(record.id)
        texts.append(text)
    if not texts:
        raise refuse(f"in {path} hold no input")
    return SmokeSet({**smoke.payload, "inputs": texts, **kind_option(manifest.inputs, kind)}, ids, texts)


def _owned(path: Path, refuse) -> None:
    """A file that decides what check passes: yours (or root's), and writable by nobody else."""
    try:
        info = path.lstat()
    except FileNotFoundError:
        raise refuse(f"file {path} does not exist") from None
    if not stat.S_ISREG(info.st_mode):
        raise refuse(f"file {path} is not a plain file")
    if info.st_uid not in (os.getuid(), 0) or info.st_mode & 0o022:
        raise refuse(f"file {path} is writable by others (owner uid {info.st_uid}, mode "
                     f"{stat.S_IMODE(info.st_mode):04o}); run `chmod go-w {path}` as its owner")


def read_expected(manifest: Manifest) -> dict[str, Any]:
    """The recorded expected answer; refused when missing, malformed, or writable by another user."""
    path = expected_file(manifest)
    assert path is not None
    slug = manifest.slug

    def refuse(why: str) -> ManifestError:
        return ManifestError(f"{slug}: the expected answer {path} {why}", slug=slug,
                             details={"field": "smoke.expected", "expected_file": str(path)})

    try:
        info = path.lstat()
    except FileNotFoundError:
        raise refuse(f"does not exist; record it with `resident-pool check --bless {slug}`") from None
    # A golden file another user can replace proves nothing about the answer.
    _owned(path, lambda why: refuse(why.removeprefix(f"file {path} ")))
    if info.st_size > MAX_BYTES:
        raise refuse(f"is {info.st_size} bytes, over the {MAX_BYTES} byte limit; shrink the smoke payload")
    rebless = f"re-bless it with `resident-pool check --bless {slug} --force`"
    try:
        document = json.loads(path.read_bytes())
    except (OSError, ValueError, RecursionError) as exc:
        raise refuse(f"cannot be read as JSON ({exc}); {rebless}") from None
    if not (isinstance(document, dict) and document.get("format") == FORMAT and "result" in document
            and isinstance(document.get("payload"), dict)):
        raise refuse(f"is not an expected-answer file (format {FORMAT}, with payload and result); {rebless}")
    return document


def verdict(manifest: Manifest, payload: dict[str, Any], result: Any,
            transcript: Path | None) -> tuple[str, dict[str, Any]]:
    """Pass, or raise GoldenMismatch naming each field off the expected answer to ``payload`` and by how much."""
    slug, tol = manifest.slug, tolerance(manifest)
    path = expected_file(manifest)
    if path is None:
        return (f"answered ({len(json.dumps(result))} characters); not compared: [smoke] expected is not set "
                f"(record an answer with `resident-pool check --bless {slug}`)"), {}
    document = read_expected(manifest)
    if document["payload"] != payload:
        raise GoldenMismatch(f"{slug}: the smoke payload changed since {path} was blessed; "
                             f"re-bless it with `resident-pool check --bless {slug} --force`", slug=slug,
                             transcript=str(transcript), details={"expected_file": str(path)})
    mismatches = compare(document["result"], result, tol)
    if mismatches:
        raise GoldenMismatch(
            f"{slug}: the answer differs from {path} in {len(mismatches)} field(s), tolerance {tol.describe()}:\n"
            + summary(mismatches), slug=slug, transcript=str(transcript),
            details={"expected_file": str(path), "mismatches": [m.to_dict() for m in mismatches]})
    return f"the answer matches {path} within {tol.describe()}", {"expected_file": str(path)}


def bless(manifest: Manifest, payload: dict[str, Any], result: Any, provenance: dict[str, str], *,
          force: bool) -> tuple[str, dict[str, Any]]:
    """Record ``result`` as the expected answer to ``payload``, over an existing file only with ``force``; says what
    changed."""
    slug, tol = manifest.slug, tolerance(manifest)
    path = expected_file(manifest)
    if path is None:
        raise ManifestError(f"{slug}: [smoke] expected is not set in {manifest.path}; add "
                            'expected = "smoke/expected.json" under [smoke], then bless again',
                            slug=slug, details={"field": "smoke.expected"})
    new = normalize(result, tol)
    data: dict[str, Any] = {"expected_file": str(path), "diff": [], "written": False}
    heading = "a new file"
    if path.exists() or path.is_symlink():
        heading, data["diff"] = _diff(manifest, payload, new)
        if not force:
            raise ResidentPoolError(f"{slug}: {path} exists and is not overwritten without --force; {heading}",
                                    slug=slug, reason="expected_exists", details=data)
    _write(path, {
        "format": FORMAT, "slug": slug, "payload": payload, "result": new,
        "blessed": {"at": datetime.now(UTC).isoformat(timespec="seconds"),
                    "provenance": {k: v for k, v in provenance.items() if k not in _LOCAL and not k.endswith(
                        "transcript")}},
    })
    data["written"] = True
    return f"wrote {path}: {heading}", data


def _diff(manifest: Manifest, payload: dict[str, Any], new: Any) -> tuple[str, list[str]]:
    """How ``new`` differs from the recorded answer: a heading, then one line per field."""
    tol = tolerance(manifest)
    try:
        old = read_expected(manifest)
    except ManifestError as exc:
        return f"the old file is unusable ({exc})", []
    lines = []
    if old["payload"] != payload:
        lines.append(f"the payload changed: {_short(old['payload'])} -> {_short(payload)}")
    changes = compare(old["result"], new, Tolerance(ignore=tol.ignore, float32_base64=tol.float32_base64))
    lines += [change.describe("old", "new") for change in changes]
    if not changes:
        return "no field differs from the old file", lines
    beyond = compare(old["result"], new, tol)
    return (f"{len(changes)} field(s) differ from the old file, {len(beyond)} of them beyond the tolerance "
            f"({tol.describe()})"), lines


def _short(payload: Any, limit: int = 300) -> str:
    """A payload as JSON, cut: a smoke set of 32 proteins would fill a screen."""
    text = json.dumps(payload)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _write(path: Path, document: dict[str, Any]) -> None:
    # What check will read back: finite numbers only (NaN would match NaN forever, and is not JSON),
    # and under the size check refuses.
    try:
        text = json.dumps(document, indent=1, allow_nan=False) + "\n"
    except ValueError:
        raise GoldenMismatch(f"{document['slug']}: the answer holds NaN or an infinity; a golden answer must be "
                             "finite numbers: fix the model, or ignore that field in [smoke]",
                             slug=document["slug"], reason="answer_not_finite") from None
    if len(text.encode()) > MAX_BYTES:
        raise GoldenMismatch(f"{document['slug']}: the answer is {len(text.encode())} bytes as JSON, over the "
                             f"{MAX_BYTES} byte limit check reads; shrink the smoke payload", slug=document["slug"],
                             reason="answer_too_large")
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as out:
            out.write(text)
        os.chmod(temp, 0o644)  # a file to commit, not a secret
        os.replace(temp, path)
    except BaseException:
        os.unlink(temp)
        raise
