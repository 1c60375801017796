"""`resident-pool status`: the workers, the providers, the queue and the breakers, as an operator reads them."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from typing import Annotated, Any

import typer

from ..errors import ResidentPoolError
from ..providers.transcripts import without_controls
from .base import AsJson, ManifestsOption, app, console, display_name, safe
from .pools import pool_client
from .tables import Column, fit_table

__all__ = ["breaker_words", "status"]

WORKER_COLUMNS = [
    Column("slug", 100), Column("replica", 90), Column("pid", 60), Column("state", 95), Column("version", 30),
    Column("fingerprint", 20), Column("device", 50), Column("gpu_gb", 70), Column("served", 55),
    Column("idle_s", 65), Column("in_flight", 45), Column("uptime_s", 35), Column("lease", 40),
    Column("transcript", text=True, whole=True),  # a file name: the folder is said once, below the table
]
QUEUE_COLUMNS = [
    Column("#", 100), Column("slug", 100), Column("class", 95), Column("age_s", 80), Column("needs", 80),
    Column("waits for", text=True, min_text=30),
]
HOST_COLUMNS = [Column("#", 100), Column("user", 100), Column("slug", 100), Column("class", 95),
                Column("age_s", 80), Column("needs", 80)]
PROVIDER_COLUMNS = [
    Column("provider", 100), Column("running", 90), Column("min/max", 50), Column("budget_gb", 60),
    Column("measured_peak_gb", 55), Column("fingerprint", 20), Column("breaker", 80),
    Column("last error / advice", text=True),
]


@app.command()
def status(
    as_json: AsJson = False,
    require: Annotated[bool, typer.Option(
        "--require", help="Exit 1 when no pool runs (for health checks); without it that is not an error.")] = False,
    manifests: ManifestsOption = None,
) -> None:
    """The pool's workers, the providers it knows, its admission queue and any open breaker."""
    try:
        with pool_client(manifests, start=False) as pool:
            state = pool.status()
    except (ResidentPoolError, OSError) as exc:
        if as_json:
            typer.echo(json.dumps({"pool": None, "workers": [], "error": str(exc)}))
        else:
            console.print(safe(exc), highlight=False)
        raise typer.Exit(1 if require else 0) from None
    if as_json:
        typer.echo(json.dumps(state, indent=2))
        return
    pool = state["pool"]
    title = (f"resident-pool {pool['version']} (pid {pool['pid']}, manifests {safe(pool['manifests'])})"
             + (" [yellow]draining to stop[/]" if pool.get("draining") else ""))
    if state["workers"]:
        # One folder holds every transcript: said once below the table, each row names its file.
        folders = {os.path.dirname(w["transcript"]) for w in state["workers"] if w.get("transcript")}
        folder = folders.pop() if len(folders) == 1 else None
        # A whole path per row (transcripts in several folders) may fold; a bare file name never does.
        columns = WORKER_COLUMNS if folder else [replace(c, whole=False) for c in WORKER_COLUMNS]
        _print(title, columns, [_worker_row(worker, folder) for worker in state["workers"]])
        if folder:
            console.print(f"transcripts in {safe(folder)}", highlight=False)
    else:
        console.print(f"resident-pool (pid {pool['pid']}): no workers held; the next request starts one")
    if pool.get("metrics_error"):
        console.print(f"[red]no metrics served[/]: {safe(pool['metrics_error'])}")
    admission = state.get("admission")
    if admission:
        console.print(_admission_line(admission), highlight=False, markup=False)
    if state["waiting"]:
        _print("waiting, in the order they are served", QUEUE_COLUMNS,
               [_queue_row(n, w) for n, w in enumerate(state["waiting"])])
    if admission and admission.get("host_line"):
        _print("the host's line, every user's pool", HOST_COLUMNS, [
            [str(w["position"]), safe(w["user"]), safe(f"{w['slug']}[{w['replica']}]"), _class(w),
             f"{w['age_s']:.1f}", f"{w['needs_gb']:g} GB"] for w in admission["host_line"]])
    for over in (admission or {}).get("over_quota", []):
        console.print(f"over quota: {safe(over['user'])}'s {safe(over['slug'])} ({over['needs_gb']:g} GB): "
                      f"{safe(over['why'])}", highlight=False)
    for key, breaker in state["breakers"].items():
        console.print(f"[red]breaker[/] {safe(display_name(key))}: {breaker_words(breaker)} "
                      f"({breaker['failures']} failed starts, {breaker['refused']} refused): {safe(breaker['error'])}",
                      highlight=False)
    for worker in state["workers"]:
        if worker.get("over_budget"):
            console.print(f"[red]over budget[/] {safe(worker['over_budget'])}")
    providers = state.get("providers", {})
    if providers:
        _print("providers", PROVIDER_COLUMNS, [_provider_row(key, p) for key, p in sorted(providers.items())])
    for key, provider in providers.items():
        for line in _provider_lines(display_name(key), provider):
            console.print(without_controls(line), highlight=False, markup=False, soft_wrap=True)


def _admission_line(admission: dict[str, Any]) -> str:
    """Which ledger admits (the host service or this user's own), and the order's settings."""
    rules = (f"backfill {'on' if admission.get('backfill') else 'off'}, ageing one class per "
             f"{admission.get('aging_s', 0):g} s" if admission.get("aging_s") else
             f"backfill {'on' if admission.get('backfill') else 'off'}, no ageing")
    if admission.get("mode") == "host admission service":
        quota = "; ".join(f"{name}: {q.get('gpu_gb') if q.get('gpu_gb') is not None else 'any'} GB, "
                          f"{q.get('replicas') if q.get('replicas') is not None else 'any'} replicas"
                          for name, q in (admission.get("quota") or {}).items())
        return (f"admission: the host admission service ({admission.get('socket')}, pid {admission.get('service_pid')})"
                f" for every user's pool; you ({admission.get('user')}) may claim "
                f"{', '.join(admission.get('classes') or [])}; quota {quota or 'none'}; {rules}")
    return (f"admission: this user's own ledger ({admission.get('ledger')}); other users' pools are seen only "
            f"through NVML's free memory; {rules}")


def _class(waiting: dict[str, Any]) -> str:
    cls = waiting.get("priority") or "normal"
    if waiting.get("ranks_as") and waiting["ranks_as"] != cls:
        cls += f" (aged: ranks as {waiting['ranks_as']})"
    if waiting.get("asked") and waiting["asked"] != waiting.get("priority"):
        cls += f" (asked {waiting['asked']})"
    return cls


def _queue_row(number: int, waiting: dict[str, Any]) -> list[str]:
    cls = _class(waiting)
    slug = safe(display_name(waiting["slug"])) + (f"[{waiting['replica']}]" if waiting.get("replica") is not None
                                                  else "")
    needs = f"{waiting['needs_gb']:g} GB" if waiting.get("needs_gb") is not None else "a replica"
    held = "; held: " + "; ".join(waiting["held"]) if waiting.get("held") else ""
    holder = f" (for {waiting['holder']})" if waiting.get("holder") else ""
    return [str(number), slug + holder, cls, f"{waiting.get('age_s', 0):.1f}", needs,
            safe(f"{waiting.get('waits_for') or ''}{held}")]


def breaker_words(breaker: dict[str, Any]) -> str:
    """``open, closes in 157 s`` or ``closed``; the pool says ``closes_in_s`` (``open_s`` before 0.3)."""
    if not breaker.get("open"):
        return "closed"
    left = breaker.get("closes_in_s", breaker.get("open_s"))
    return "open" + (f", closes in {left:g} s" if isinstance(left, int | float) else "")


def _print(title: str, columns: list[Column], rows: list[list[str]]) -> None:
    table, left_out = fit_table(console, title, columns, rows)
    console.print(table)
    if left_out:
        console.print(f"(left out at {console.width} columns: {', '.join(left_out)}; a wider terminal or "
                      "--json shows them)", highlight=False, markup=False)


def _worker_row(worker: dict[str, Any], folder: str | None) -> list[str]:
    row = dict(worker)
    if folder and worker.get("transcript"):
        row["transcript"] = os.path.basename(worker["transcript"])
    row["slug"] = display_name(worker["slug"])
    lease = worker.get("lease")
    row["lease"] = "" if lease is None else (
        f"{lease['age_s']:g} s" + (f" ({', '.join(lease['holder'].values())})" if lease["holder"] else ""))
    if (worker.get("max_callers") or 1) > 1:  # a batching worker: its callers, and the wait in its queue
        row["lease"] = f"{worker.get('callers', 0)}/{worker['max_callers']} callers" + (
            f", queue {worker['queue_wait_s']:g} s" if worker.get("queue_wait_s") is not None else "")
    row["version"] = (worker.get("version") or "")[:8]  # as the fingerprint: --json has them whole
    if not worker.get("current", True):
        row["version"] += " (old)"
    row["fingerprint"] = (worker.get("fingerprint") or "")[:8]
    row["gpu_gb"] = _gpu_cell(worker)
    row["in_flight"] = "" if worker.get("in_flight_s") is None else f"{worker['in_flight_s']:g} s"
    said = []
    if lease is not None and lease.get("kept"):  # Pool.predict's: idle between calls, recalled when wanted
        said.append("kept lease, " + ("recalled" if lease.get("recalling") else
                                      "idle" if worker.get("idle") else "in use"))
    if worker.get("kept_warm"):
        said.append("kept warm")
    if said:
        row["state"] = f"{worker['state']} ({'; '.join(said)})"
    return ["" if row.get(c.name) is None else safe(row[c.name]) for c in WORKER_COLUMNS]


def _provider_row(key: str, provider: dict[str, Any]) -> list[str]:
    breaker = provider.get("breaker")
    notes = "; ".join(x for x in (provider.get("last_error"), provider.get("budget_advice")) if x)
    return [
        safe(display_name(key)), str(provider.get("running", 0)),
        f"{provider.get('min_replicas', '')}/{provider.get('max_replicas', '')}",
        "" if provider.get("budget_gb") is None else f"{provider['budget_gb']:g}",
        "" if provider.get("measured_peak_gb") is None else f"{provider['measured_peak_gb']:.2f}",
        (provider.get("fingerprint") or "")[:8],
        "" if not breaker else f"{breaker_words(breaker)} ({breaker['failures']} failed)",
        safe(notes),
    ]


def _gpu_cell(worker: dict[str, Any]) -> str:
    """``used / budget GB (peak P)``: what the card says beside what the manifest declared."""
    budget, used, peak = worker.get("budget_gb"), worker.get("gpu_used_gb"), worker.get("gpu_peak_gb")
    if used is None:
        return "" if budget is None else f"? / {budget:g}"
    text = f"{used:.2f} / {budget:g}" if budget is not None else f"{used:.2f}"
    return text + (f" (peak {peak:.2f})" if peak is not None and peak != used else "")


def _provider_lines(name: str, provider: dict[str, Any]) -> list[str]:
    """How the provider's workers start, what eviction does to them, and its JIT cache, one line each."""
    lines = []
    start = provider.get("start") or {}
    zygote = start.get("zygote")
    if start.get("way") == "zygote" and zygote and zygote.get("pid"):
        preload = sum((zygote.get("modules_s") or {}).values())
        load = f", load stage {zygote['load_s']:g} s" if zygote.get("load_s") is not None else ""
        lines.append(f"{name}: workers forked from zygote pid {zygote['pid']} (preload {preload:.1f} s{load}; "
                     f"{zygote['forks']} fork(s), {zygote['workers']} alive)")
    elif start.get("way") == "zygote":
        lines.append(f"{name}: workers forked from a zygote (none running now; the next start starts one)")
    elif start.get("way") == "spawn" and start.get("why") != "no [lifecycle] preload":
        lines.append(f"{name}: workers spawned: {start['why']}")
    eviction = provider.get("eviction") or {}
    if eviction.get("evict") == "hibernate":
        said = eviction.get("unavailable") or eviction.get("last")
        lines.append(f"{name}: evicted workers hibernate" + (f" ({said})" if said else ""))
    cache = provider.get("jit_cache")
    if cache:
        lines.append(f"{name}: JIT cache {cache['bytes'] / 2**20:.1f} MiB in {cache['root']} "
                     f"({len(cache['keys'])} stack key(s))")
    return lines
