"""The kits' JIT caches: one folder per provider and stack key, kept across worker lifetimes; sizes and pruning.

A warm cache took one provider's first prediction from 42 s to 12 s, so a worker's compiled
kernels outlive it. Under the default root (``<the pool's cache folder>/jit/<slug>``) each stack
key (the kit's ``jit_cache_key()``: its version, the torch and CUDA builds) has a folder of
its own, so an upgrade starts a fresh cache beside the old one instead of mixing them, and
``resident-pool cache prune`` removes the keys no start uses any more. A folder's mtime is
its last use: the pool touches it at every start, the kit's writes touch it too. A root the
user names (``[kit] jit_root``, ``$MODEL_OPT_JIT_ROOT``) is used as is, and never pruned.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import threading
import time
from pathlib import Path
from typing import Any

__all__ = ["SIZE_TTL_S", "JitSizes", "default_base", "default_root", "key_folders", "prune", "stack_folder", "usage"]

_SAFE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,99}")
# Walking a large cache costs; status reports a size at most this old.
SIZE_TTL_S = 60.0


def default_base(cache_dir: Path) -> Path:
    """``jit`` in the pool's cache folder (``Paths.cache``: ``RESIDENT_POOL_CACHE_DIR``, else XDG's): every default
    root's folder."""
    return cache_dir / "jit"


def default_root(cache_dir: Path, slug: str) -> Path:
    return default_base(cache_dir) / slug


def stack_folder(root: Path, key: str) -> Path:
    """``root/<key>`` (a key that is no safe folder name goes by its hash), created, and marked used now."""
    name = key if _SAFE.fullmatch(key) else f"key-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    folder = root / name
    folder.mkdir(parents=True, exist_ok=True)
    os.utime(folder)
    return folder


def usage(path: Path) -> int:
    """Bytes on disk under ``path`` (as ``du`` counts them), symlinks not followed; 0 when it is absent."""
    total = 0
    stack = [path]
    while stack:
        try:
            entries = list(os.scandir(stack.pop()))
        except OSError:
            continue
        for entry in entries:
            try:
                info = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            total += info.st_blocks * 512
            if entry.is_dir(follow_symlinks=False):
                stack.append(Path(entry.path))
    return total


def key_folders(root: Path) -> list[dict[str, Any]]:
    """The stack-key folders under a provider's root, newest use first: key, path, bytes, last_used."""
    try:
        entries = [entry for entry in os.scandir(root) if entry.is_dir(follow_symlinks=False)]
    except OSError:
        return []
    folders = [{"key": entry.name, "path": entry.path, "last_used": entry.stat(follow_symlinks=False).st_mtime}
               for entry in entries]
    for folder in folders:
        folder["bytes"] = usage(Path(folder["path"]))
    return sorted(folders, key=lambda folder: folder["last_used"], reverse=True)


def prune(base: Path, older_than_s: float, dry_run: bool = False,
          now: float | None = None) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Remove stack-key folders under the default ``base`` that no start will use: every one that is not its
    provider's newest and was last used more than ``older_than_s`` ago. Returns (removed, kept)."""
    now = time.time() if now is None else now
    removed, kept = [], []
    try:
        providers = sorted(entry.path for entry in os.scandir(base) if entry.is_dir(follow_symlinks=False))
    except OSError:
        return [], []
    for provider in providers:
        for rank, folder in enumerate(key_folders(Path(provider))):
            folder["provider"] = Path(provider).name
            if rank == 0 or now - folder["last_used"] < older_than_s:
                kept.append(folder)
                continue
            if not dry_run:
                shutil.rmtree(folder["path"], ignore_errors=True)
            removed.append(folder)
    return removed, kept


class JitSizes:
    """Sizes of JIT roots for ``status``, each walked at most once per ``SIZE_TTL_S``."""

    def __init__(self, ttl_s: float = SIZE_TTL_S) -> None:
        self.ttl_s = ttl_s
        self._cache: dict[str, tuple[float, dict[str, Any]]] = {}
        self._lock = threading.Lock()

    def report(self, root: Path) -> dict[str, Any]:
        """``{"root", "bytes", "keys": [{"key", "bytes", "last_used"}...]}``, newest key first."""
        now = time.monotonic()
        with self._lock:
            cached = self._cache.get(str(root))
        if cached is not None and now - cached[0] < self.ttl_s:
            return cached[1]
        folders = key_folders(root)
        report = {"root": str(root), "bytes": usage(root),  # with whatever a kit writes into the root itself
                  "keys": [{name: folder[name] for name in ("key", "bytes", "last_used")} for folder in folders]}
        with self._lock:
            self._cache[str(root)] = (now, report)
        return report
