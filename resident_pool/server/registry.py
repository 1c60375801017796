"""The manifests the pool serves: read from disk when they change, each with its version and its spec."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

from ..errors import ManifestError
from ..messages import Variant
from ..providers.manifest import Manifest, load_manifest
from .replica import Spec

__all__ = ["Loaded", "Registry", "spec_of"]


@dataclass(frozen=True)
class Loaded:
    """One provider's manifest as last read: what the runtime starts its workers from."""

    key: str  # the slug, or ``slug~variant``
    slug: str
    manifest: Manifest
    source: Path
    stamp: tuple[int, ...]  # the manifest's and the worker script's inode, mtime and size
    version: str
    fingerprint: str
    variant: Variant | None
    strip_kit: str | None  # a stock variant without its kit: that kit's package, whose variables go


def spec_of(manifest: Manifest) -> Spec:
    """What the decision core needs of a manifest."""
    life, gpu, batching = manifest.lifecycle, manifest.gpu, manifest.batching
    return Spec(mode=manifest.mode, max_replicas=life.max_replicas, min_replicas=life.min_replicas,
                idle_timeout_s=life.idle_timeout_s, ping_interval_s=life.ping_interval_s,
                abandon_grace_s=life.abandon_grace_s, admission_timeout_s=life.admission_timeout_s,
                start_timeout_s=life.start_timeout_s, request_timeout_s=life.request_timeout_s, evict=life.evict,
                budget_gb=gpu.vram_budget_gb if gpu.policy != "none" else None,
                max_callers=batching.callers if batching is not None else 1,
                max_queue_wait_s=batching.max_queue_wait_s if batching is not None else None)


def _stamp(path: Path) -> tuple[int, ...]:
    try:
        info = path.stat()
    except OSError:
        return (0, 0, 0)
    return (info.st_ino, info.st_mtime_ns, info.st_size)


class Registry:
    """Reads a provider's manifest again only when it (or its worker script) changed on disk."""

    def __init__(self, manifests: Path) -> None:
        self.manifests = manifests
        self._lock = threading.Lock()
        self._loaded: dict[str, Loaded] = {}

    def get(self, key: str) -> Loaded | None:
        with self._lock:
            return self._loaded.get(key)

    def forget(self, key: str) -> None:
        with self._lock:
            self._loaded.pop(key, None)

    def keep(self, loaded: Loaded) -> None:
        """``loaded`` is known again (after a ``forget``), unless a newer read of it is already."""
        with self._lock:
            self._loaded.setdefault(loaded.key, loaded)

    def load(self, slug: str, manifests: str | None, variant: Variant | None = None,
             serving: bool = False) -> Loaded:
        """``slug``'s manifest as it is now (a variant is a provider of its own, ``slug~name``).

        ``serving``: the pool has live replicas of it, so it must keep the folder they came from.
        """
        key = f"{slug}~{variant.name}" if variant else slug
        # Clients send absolute folders; resolving symlinks on every acquire costs a stat per component.
        path = (Path(manifests) if manifests else self.manifests) / slug / "manifest.toml"
        stamp = _stamp(path)
        if stamp == (0, 0, 0):
            raise ManifestError(
                f"{slug}: no provider of that name: {path} does not exist; check the slug or pass --manifests",
                slug=slug)
        with self._lock:
            known = self._loaded.get(key)
        if known is not None and known.source != path and serving:
            raise ManifestError(
                f"{slug}: this pool already serves {slug} from {known.source}, not {path}; stop it first "
                f"(`resident-pool stop {slug}`)", slug=slug)
        if known is not None and known.source == path and known.stamp[:3] == stamp and known.variant == variant \
                and known.stamp[3:] == _stamp(known.manifest.worker_path):
            return known
        declared = load_manifest(path)
        manifest = declared.variant(variant.kit_mode, variant.without_kit) if variant else declared
        strip = declared.kit.package_name if variant and variant.without_kit and declared.kit else None
        loaded = Loaded(key, slug, manifest, path, stamp + _stamp(manifest.worker_path), manifest.version(),
                        manifest.fingerprint(), variant, strip)
        with self._lock:
            self._loaded[key] = loaded
        return loaded

    def changed(self) -> list[Loaded]:
        """The providers whose manifest or worker script changed on disk since they were last read."""
        with self._lock:
            loaded = list(self._loaded.values())
        return [known for known in loaded
                if known.stamp != _stamp(known.source) + _stamp(known.manifest.worker_path)]

    def kept_warm(self) -> list[str]:
        """The providers of the pool's own folder that ask for warm workers from the start."""
        slugs = []
        for path in sorted(self.manifests.glob("*/manifest.toml")):
            try:
                if load_manifest(path).lifecycle.min_replicas:
                    slugs.append(path.parent.name)
            except ManifestError:
                continue
        return slugs
