"""``resident-pool status``: the pool's records as an operator reads them, from one snapshot."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from ..errors import ResidentPoolError
from ..ops.gpu_memory import budget_advice
from ..providers.kit_rules import jit_root
from ..providers.manifest import Manifest, load_manifest
from ..version import __version__

if TYPE_CHECKING:
    from .pool import PoolServer

__all__ = ["build_status"]


def build_status(server: PoolServer) -> dict[str, Any]:
    """Per worker, per provider, the queue, the ledger and the zygotes; known providers not running too."""
    state, workers = server._snapshot()
    observer = server.observer
    rows = []
    for row in state["replicas"]:
        worker = workers.get(row["rid"])
        process = worker.process if worker is not None else None
        measured = observer.measured_of(row["rid"])
        provider = state["providers"][row["key"]]
        in_flight = process.in_flight_s() if process is not None and row["state"] in ("leased", "draining") else None
        rows.append({
            "slug": row["key"], "replica": row["replica"],
            "pid": process.pid if process is not None and process.returncode is None else None,
            "state": row["state"], "version": row["version"], "current": row["current"], "device": row["device"],
            "budget_gb": row["budget_gb"], "served": row["served"], "starts": provider["starts"],
            "idle_s": row["idle_s"], "uptime_s": _round(process.uptime_s()) if process is not None else None,
            "transcript": process.transcript_path if process is not None else None,
            "socket": process.socket_path if process is not None else None, "last_error": row["last_error"],
            "retiring": row["retiring"], "started_by": process.started_by if process is not None else None,
            "hibernation": worker.hibernation.describe() if worker is not None and worker.hibernation else None,
            "lease": row["lease"], "fingerprint": worker.loaded.fingerprint if worker is not None else None,
            "in_flight_s": None if in_flight is None else round(in_flight, 1),
            "gpu_used_gb": measured.gpu_used_gb, "gpu_peak_gb": measured.gpu_peak_gb,
            "over_budget": measured.over_budget, "kept_warm": row["kept_warm"],
            "idle": _idle(row, in_flight),
        })
    providers: dict[str, Any] = {}
    breakers = {}
    for key, provider in sorted(state["providers"].items()):
        loaded = server.registry.get(key)
        if loaded is None:
            continue
        manifest = loaded.manifest
        if provider["breaker"]:
            breakers[key] = provider["breaker"]
        peak = observer.peaks.get(provider["slug"], provider["version"])
        facts = _provider_facts(manifest, provider["fingerprint"])
        providers[key] = {
            "version": provider["version"], "manifest": str(loaded.source), "starts": provider["starts"],
            "last_error": provider["last_error"], "breaker": provider["breaker"],
            "start": server.zygotes.status(key, manifest),
            "eviction": server.hibernator.status(key, manifest.lifecycle.evict), **facts,
            "running": sum(1 for row in state["replicas"] if row["key"] == key and row["state"] not in
                           ("stopping", "stopped", "failed")),
            "measured_peak_gb": peak, "budget_advice": budget_advice(facts["budget_gb"], peak),
        }
        if manifest.kit is not None:  # walked at most once a minute per root
            providers[key]["jit_cache"] = server.jit_sizes.report(jit_root(manifest, os.environ, server.paths.cache))
    for path in sorted(server.manifests.glob("*/manifest.toml")):
        slug = path.parent.name
        if slug in providers:
            continue
        try:
            manifest = load_manifest(path)
        except ResidentPoolError as exc:
            providers[slug] = {"manifest": str(path), "running": 0, "last_error": exc.headline, "breaker": None}
            continue
        try:
            peak = observer.peaks.get(slug, manifest.version())
        except ResidentPoolError:
            peak = None
        facts = _provider_facts(manifest, manifest.fingerprint())
        providers[slug] = {"manifest": str(path), "running": 0, "last_error": None, "breaker": None,
                           "measured_peak_gb": peak, "budget_advice": budget_advice(facts["budget_gb"], peak),
                           **facts}
    return {
        "pool": {"pid": os.getpid(), "version": __version__, "socket": server.socket_path,
                 "manifests": str(server.manifests), "since": server.started, "ledger": str(server.ledger.path),
                 "draining": state["stopping"] is not None, **observer.describe()},
        "workers": rows, "providers": providers, "waiting": server.waiting(), "breakers": breakers,
        "ledger": server.admission.entries(), "zygotes": server.zygotes.describe(),
        "admission": _admission(server, state),
    }


def _admission(server: PoolServer, state: dict[str, Any]) -> dict[str, Any]:
    """Which ledger admits; with the host service, its line across every user (and who waits over a quota)."""
    found = {**state["policy"], **server.admission.in_force()}
    if server.service is not None:
        try:
            host = server.service.status()
            found.update(host_line=host.get("line", []), over_quota=host.get("over_quota", []))
        except ResidentPoolError as exc:
            found["error"] = exc.headline
    return found


def _idle(row: dict[str, Any], in_flight: float | None) -> bool:
    """Whether the worker counts as idle now: nobody holds it, or a kept lease (Pool.predict's) holds it between
    calls; such a worker is retired, evicted or recalled as a ready one is (docs/workers.md)."""
    if row["state"] in ("ready", "hibernated"):
        return True
    lease = row["lease"]
    return (row["state"] == "leased" and lease is not None and lease["kept"] and not lease["recalling"]
            and in_flight is None)


def _round(value: float | None) -> float | None:
    return round(value, 1) if value is not None else None


def _provider_facts(manifest: Manifest, fingerprint: str) -> dict[str, Any]:
    gpu = manifest.gpu
    return {"fingerprint": fingerprint, "budget_gb": gpu.vram_budget_gb if gpu.policy != "none" else None,
            "over_budget": gpu.over_budget, "min_replicas": manifest.lifecycle.min_replicas,
            "max_replicas": manifest.lifecycle.max_replicas, "mode": manifest.mode}
