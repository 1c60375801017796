"""``resident-pool status`` and ``waiting``: the pool's records as an operator reads them, from one view of the core
and what the pool knows beside it (its processes, manifests, measurements and ledger)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..admission import Admission
from ..admission.remote import ServiceClient
from ..errors import ResidentPoolError
from ..ops.gpu_memory import budget_advice
from ..providers.hibernate import Hibernator
from ..providers.jit_cache import JitSizes
from ..providers.kit_rules import jit_root
from ..providers.manifest import Manifest, load_manifest
from ..providers.zygote import Zygotes
from ..version import __version__
from .handles import Worker
from .observing import Observer
from .registry import Registry
from .view import CoreView, LineEntry, ReplicaView

__all__ = ["StatusFacts", "build_status", "describe_holder", "waiting"]


@dataclass(frozen=True)
class StatusFacts:
    """What the pool knows beside its core's view, taken with it under the pool's lock."""

    workers: dict[int, Worker]
    registry: Registry
    observer: Observer
    zygotes: Zygotes
    hibernator: Hibernator
    jit_sizes: JitSizes
    admission: Admission
    service: ServiceClient | None  # the host admission service's client
    manifests: Path
    socket_path: str
    started: float
    ledger_path: str
    cache_dir: Path  # the kits' default JIT caches are under it


def build_status(view: CoreView, facts: StatusFacts) -> dict[str, Any]:
    """Per worker, per provider, the queue, the ledger and the zygotes; known providers not running too."""
    observer = facts.observer
    rows = []
    for replica in view.replicas:
        worker = facts.workers.get(replica.rid)
        process = worker.process if worker is not None else None
        measured = observer.measured_of(replica.rid)
        provider = view.providers[replica.key]
        rows.append({
            "slug": replica.key, "replica": replica.index,
            "pid": process.pid if process is not None and process.returncode is None else None,
            "state": replica.state.value, "version": replica.version, "current": replica.current,
            "device": replica.device, "budget_gb": replica.budget_gb, "served": replica.served,
            "starts": provider.starts, "idle_s": replica.idle_s,
            "uptime_s": _round(process.uptime_s()) if process is not None else None,
            "transcript": process.transcript_path if process is not None else None,
            "socket": process.socket_path if process is not None else None, "last_error": replica.last_error,
            "retiring": replica.retiring, "started_by": process.started_by if process is not None else None,
            "hibernation": worker.hibernation.describe() if worker is not None and worker.hibernation else None,
            "lease": replica.lease.row() if replica.lease is not None else None,
            "fingerprint": worker.loaded.fingerprint if worker is not None else None,
            "in_flight_s": replica.in_flight_s,
            "gpu_used_gb": measured.gpu_used_gb, "gpu_peak_gb": measured.gpu_peak_gb,
            "over_budget": measured.over_budget, "kept_warm": replica.kept_warm, "idle": replica.idle,
            "serving": replica.serving, "ending": replica.ending,
            "callers": len(replica.leases), "max_callers": replica.max_callers,
            "leases": [lease.row() for lease in replica.leases], "queue_wait_s": replica.queue_wait_s,
        })
    providers: dict[str, Any] = {}
    breakers = {}
    for key, provider in sorted(view.providers.items()):
        loaded = facts.registry.get(key)
        if loaded is None:
            continue
        manifest = loaded.manifest
        if provider.breaker:
            breakers[key] = provider.breaker
        peak = observer.peaks.get(provider.slug, provider.version)
        found = _provider_facts(manifest, provider.fingerprint)
        providers[key] = {
            "version": provider.version, "manifest": str(loaded.source), "starts": provider.starts,
            "last_error": provider.last_error, "breaker": provider.breaker,
            "start": facts.zygotes.status(key, manifest),
            "eviction": facts.hibernator.status(key, manifest.lifecycle.evict), **found,
            "running": provider.running,
            "measured_peak_gb": peak, "budget_advice": budget_advice(found["budget_gb"], peak),
        }
        if manifest.kit is not None:  # walked at most once a minute per root
            providers[key]["jit_cache"] = facts.jit_sizes.report(jit_root(manifest, os.environ, facts.cache_dir))
    for path in sorted(facts.manifests.glob("*/manifest.toml")):
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
        found = _provider_facts(manifest, manifest.fingerprint())
        providers[slug] = {"manifest": str(path), "running": 0, "last_error": None, "breaker": None,
                           "measured_peak_gb": peak, "budget_advice": budget_advice(found["budget_gb"], peak),
                           **found}
    return {
        "pool": {"pid": os.getpid(), "version": __version__, "socket": facts.socket_path,
                 "manifests": str(facts.manifests), "since": facts.started, "ledger": facts.ledger_path,
                 "draining": view.stopping is not None, **observer.describe()},
        "workers": rows, "providers": providers, "waiting": waiting(view, facts.workers), "breakers": breakers,
        "ledger": facts.admission.entries(), "zygotes": facts.zygotes.describe(),
        "admission": _admission(view, facts),
    }


def _admission(view: CoreView, facts: StatusFacts) -> dict[str, Any]:
    """Which ledger admits; with the host service, its line across every user (and who waits over a quota)."""
    found = {**view.policy, **facts.admission.in_force()}
    if facts.service is not None:
        try:
            host = facts.service.status()
            found.update(host_line=host.get("line", []), over_quota=host.get("over_quota", []))
        except ResidentPoolError as exc:
            found["error"] = exc.headline
    return found


def waiting(view: CoreView, workers: dict[int, Worker]) -> list[dict[str, Any]]:
    """Every waiting request in the order it is served: for GPU memory (the GPU line), then for a free replica,
    each with its class, age, need and what it waits for (memory held by whom, in which lease)."""
    queued = []
    held = [_held_line(r) for r in view.replicas if r.budget_gb and r.device is not None]
    for entry in view.gpu_line:
        worker = workers.get(entry.rid)
        queued.append({"slug": entry.key, "replica": entry.replica, "for": "GPU memory",
                       "position": entry.position, "priority": entry.priority, "ranks_as": entry.ranks_as,
                       "age_s": entry.age_s, "waited_s": entry.waited_s, "needs_gb": entry.needs_gb,
                       "holder": _ticket_holder(view, entry), "waits_for": (worker.waits_for if worker else None)
                       or ("its placement is being tried" if entry.placing else "its turn"),
                       "held": held})
    for key, provider in view.providers.items():
        busy = [f"{r.name} {r.state.value}" + (
            f" (lease {r.lease.id}: {describe_holder(r.lease.holder) or 'a client'})" if r.lease else "")
            for r in view.replicas if r.key == key]
        for position, ticket in enumerate(provider.waiting):
            queued.append({"slug": key, "for": "a free replica", "position": position,
                           "priority": ticket.priority, "asked": ticket.asked, "ranks_as": ticket.ranks_as,
                           "age_s": ticket.waited_s,
                           "holder": describe_holder(ticket.holder) if ticket.holder else None,
                           "waits_for": f"max_replicas = {provider.max_replicas}; " + ("; ".join(busy) or "a start")})
    return queued


def _ticket_holder(view: CoreView, entry: LineEntry) -> str | None:
    provider = view.providers.get(entry.key)
    for ticket in provider.waiting if provider is not None else ():
        if ticket.ticket == entry.ticket and ticket.holder:
            return describe_holder(ticket.holder)
    return None


def _held_line(replica: ReplicaView) -> str:
    """``a6[0] 6 GB on GPU 0, leased (lease 4, flow run 'x'), backfilled``."""
    lease = replica.lease
    text = f"{replica.name} {replica.budget_gb:g} GB on GPU {replica.device}, {replica.state.value}"
    if lease:
        text += f" (lease {lease.id}, {lease.priority}" + (
            f", {describe_holder(lease.holder)}" if lease.holder else "") + (
            ", recalled" if lease.recalling else "") + ")"
    return text + (", backfilled" if replica.backfilled else "")


def describe_holder(holder: dict[str, str]) -> str:
    """``flow run 'nimble-fox' (task predict-chunk[0-63])``, or whatever the client said."""
    if "flow_run" in holder:
        text = f"flow run {holder['flow_run']!r}"
        if holder.get("task_run"):
            text += f" (task {holder['task_run']})"
        return text
    return ", ".join(f"{key} {value}" for key, value in holder.items())


def _round(value: float | None) -> float | None:
    return round(value, 1) if value is not None else None


def _provider_facts(manifest: Manifest, fingerprint: str) -> dict[str, Any]:
    gpu = manifest.gpu
    return {"fingerprint": fingerprint, "budget_gb": gpu.vram_budget_gb if gpu.policy != "none" else None,
            "over_budget": gpu.over_budget, "min_replicas": manifest.lifecycle.min_replicas,
            "max_replicas": manifest.lifecycle.max_replicas, "mode": manifest.mode}
