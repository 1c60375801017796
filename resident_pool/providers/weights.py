"""Pinned weights: every file checked by size, then sha256, before a worker starts."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from filelock import FileLock

from ..errors import StateDirError, WeightsMismatch
from ..host.paths import Paths
from ..host.trust import check_trusted

__all__ = ["HASH_CACHE_FILE", "HashCache", "WeightsMismatch", "WeightsReport", "verify_weights"]

_BLOCK = 4 * 1024 * 1024
HASH_CACHE_FILE = "sha256-cache.json"  # in the pool's cache folder


class HashCache:
    """sha256 of files keyed by (device, inode, size, mtime, ctime), shared by every process of this user.

    A 10 GB checkpoint takes about a minute to hash; an unchanged file is not re-read. ctime
    is in the key because nobody can set it: a file swapped at the same size with its mtime
    put back still has a new ctime (and usually a new inode), so it is hashed again.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.reads = 0  # files actually hashed, for tests and the check report
        self._entries: dict[str, dict] | None = None

    @classmethod
    def of(cls, paths: Paths) -> HashCache:
        """The user's one cache, in the pool's cache folder: every process of the user shares it."""
        return cls(paths.cache / HASH_CACHE_FILE)

    def _load(self) -> dict[str, dict]:
        if self._entries is None:
            try:
                self._entries = json.loads(self.path.read_text())
            except (OSError, ValueError):
                self._entries = {}
        return self._entries

    def sha256(self, path: Path) -> str:
        with open(path, "rb") as handle:
            info = os.fstat(handle.fileno())  # the key and the bytes come from the same open file
            key = str(path.resolve())
            identity = [info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns]
            entry = self._load().get(key)
            if entry and entry.get("identity") == identity:
                return entry["sha256"]
            digest = hashlib.sha256()
            while block := handle.read(_BLOCK):
                digest.update(block)
        self.reads += 1
        value = digest.hexdigest()
        self._store(key, {"identity": identity, "sha256": value})
        return value

    def _store(self, key: str, entry: dict) -> None:
        # A poisoned entry would pass swapped weights: the folder must be this user's alone to write.
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        check_trusted(self.path.parent, "the hash cache folder (RESIDENT_POOL_CACHE_DIR)", error=StateDirError)
        with FileLock(str(self.path) + ".lock"):
            try:
                current = json.loads(self.path.read_text())
            except (OSError, ValueError):
                current = {}
            current[key] = entry
            handle, temp = tempfile.mkstemp(dir=self.path.parent, prefix=".sha256-cache.")
            with os.fdopen(handle, "w") as out:
                json.dump(current, out)
            os.replace(temp, self.path)
        self._entries = current


@dataclass
class WeightsReport:
    slug: str
    root: Path | None
    problems: list[str] = field(default_factory=list)
    checked: int = 0

    @property
    def ok(self) -> bool:
        return not self.problems

    def error(self) -> WeightsMismatch:
        where = f"weights under {self.root}" if self.root is not None else "weights"
        return WeightsMismatch(
            f"{self.slug}: {where} are not at their pins: " + "; ".join(self.problems)
            + f"; run `resident-pool check {self.slug}` once they are restored",
            slug=self.slug,
            details={"problems": self.problems, "root": str(self.root)},
        )


def verify_weights(
    slug: str, root: Path | None, files, cache: HashCache, root_hint: str | None = None
) -> WeightsReport:
    """Check each pinned file: present, then its size, then its sha256.

    ``root_hint`` is the next step when the root is missing ("set MINILM_WEIGHTS
    to the weights directory").
    """
    report = WeightsReport(slug=slug, root=root)
    if not files:
        return report
    if root is None or not root.is_dir():
        what = "no weights directory is given" if root is None else f"the weights directory {root} does not exist"
        report.problems.append(f"{what}; {root_hint}" if root_hint else what)
        return report
    check_trusted(root, "the weights directory", slug, "weights")
    for pin in files:
        path = root / pin.path
        report.checked += 1
        if not path.is_file():
            report.problems.append(f"{pin.path} is missing (expected {pin.size} bytes, sha256 {pin.sha256})")
            continue
        if path.parent != root:
            check_trusted(path.parent, "a folder of pinned weights", slug, "weights")
        check_trusted(path, "a pinned weights file", slug, "weights")  # a pickle in there is code
        size = path.stat().st_size
        if size != pin.size:
            report.problems.append(f"{pin.path} is {size} bytes, {pin.size} expected")
            continue
        found = cache.sha256(path)
        if found != pin.sha256:
            report.problems.append(f"{pin.path} sha256 {pin.sha256} expected, {found} found")
    return report
