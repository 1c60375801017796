"""The `resident-pool` command."""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ..arrays import plain
from ..errors import ManifestError, ResidentPoolError
from ..providers.manifest import json_schema, manifest_path
from ..providers.transcripts import without_controls
from ..validation.check import check_providers, junit_xml
from ..validation.provenance import columns

app = typer.Typer(help="Keep model workers warm within a GPU memory budget.", no_args_is_help=True,
                  pretty_exceptions_enable=False)
# Tables are wide; a pipe or a CI log gets 160 columns rather than rich's 80.
console = Console(width=shutil.get_terminal_size((160, 24)).columns)

ManifestsOption = Annotated[
    Path | None,
    typer.Option(
        "--manifests", help="Folder of <slug>/manifest.toml (default: $RESIDENT_POOL_MANIFESTS, else ./manifests)."
    ),
]




def safe(value: object) -> str:
    """Text from a worker, a transcript or a payload: no rich markup, no terminal control characters."""
    return escape(without_controls(str(value)))


def manifests_dir(option: Path | None) -> Path:
    from ..client import default_manifests

    return default_manifests(option)


@app.command()
def schema() -> None:
    """Print the JSON Schema of a provider manifest."""
    typer.echo(json.dumps(json_schema(), indent=2))


@app.command()
def check(
    slugs: Annotated[list[str] | None, typer.Argument(help="Providers to check (default: all).")] = None,
    smoke: Annotated[bool, typer.Option(
        "--smoke", help="Also start each worker, run its smoke payload and compare the answer with [smoke] expected.",
    )] = False,
    against_stock: Annotated[bool, typer.Option(
        "--against-stock", help="Also run the smoke payload stock (the kit off) and fail a kit that changes the "
        "answer beyond the tolerance or says it engaged nothing. Implies --smoke.",
    )] = False,
    bless: Annotated[bool, typer.Option(
        "--bless", help="Record each named provider's smoke answer as its expected answer, and print the diff "
        "against the old one.",
    )] = False,
    force: Annotated[bool, typer.Option("--force", help="With --bless: overwrite an existing answer.")] = False,
    junit: Annotated[Path | None, typer.Option("--junit", help="Write a JUnit XML report here.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print results as JSON.")] = False,
    manifests: ManifestsOption = None,
) -> None:
    """Verify weights against their pins and probe each kit; exit 1 on any failure."""
    if bless and not slugs:
        raise typer.BadParameter("name the providers to bless: `resident-pool check --bless SLUG...`")
    if force and not bless:
        raise typer.BadParameter("--force only applies to --bless")
    directory = manifests_dir(manifests)
    for slug in slugs or []:
        try:
            manifest_path(directory, slug)
        except ManifestError as exc:  # a name that is not a provider's: nothing is checked
            raise typer.BadParameter(safe(exc), param_hint="SLUG") from None
    results = check_providers(directory, slugs or [], smoke=smoke, against_stock=against_stock, bless=bless,
                              force=force)
    if junit:
        junit.write_text(junit_xml(results))
    failed = [r for r in results if not r.ok and not r.skipped]
    if as_json:
        typer.echo(json.dumps([r.__dict__ for r in results], indent=2, default=str))
    else:
        table = Table(title="resident-pool check")
        for column in ("provider", "step", "result", "detail"):
            table.add_column(column, overflow="fold")
        for r in results:
            verdict = "[yellow]skipped[/]" if r.skipped else ("[green]ok[/]" if r.ok else "[red]FAILED[/]")
            table.add_row(r.slug, r.step, verdict, safe(r.detail))  # paths like items[0] are not markup
        console.print(table)
        _print_provenance(results)
        for r in results:
            if r.step == "bless" and r.data.get("diff"):
                console.print(f"{r.slug}: against the old {safe(r.data['expected_file'])}:", highlight=False)
                for line in r.data["diff"]:
                    console.print(f"  {without_controls(line)}", highlight=False, markup=False)
        console.print(f"{len(failed)} failed, {sum(r.ok for r in results)} passed"
                      + (f"; JUnit report: {junit}" if junit else ""))
    if failed or not results:
        raise typer.Exit(1)


def _print_provenance(results) -> None:
    """One line per provider: what produced its answers."""
    for slug in dict.fromkeys(r.slug for r in results):
        values = next(r for r in results if r.slug == slug).provenance
        if "manifest.fingerprint" in values:
            line = "; ".join(f"{name} {value}" for name, value in columns(values).items())
            console.print(f"{slug}: {without_controls(line)}", highlight=False, markup=False, soft_wrap=True)


@app.command()
def daemon(
    manifests: ManifestsOption = None,
    background: Annotated[bool, typer.Option("--background", help="Detach and return once started.")] = False,
    quiet_exit_s: Annotated[
        float | None, typer.Option(help="Exit after this long with no workers and no clients (0: never).")
    ] = None,
) -> None:
    """Run this host's pool: it owns the workers, the ledger writes and the admission queue."""
    from ..server.pool import PoolServer

    if background and os.fork() > 0:
        os._exit(0)  # the client that started us waits for this exit, then for the socket
    log_format = "%(asctime)s %(name)s %(levelname)s %(message)s"
    if background:
        os.setsid()
        # Detached, it writes pool.log in the log folder (its stdout and stderr too), rotated by size;
        # under systemd it logs to stderr and the journal rotates.
        from ..host.paths import log_dir
        from ..ops.retention import PoolLogHandler
        from ..settings import settings

        handler = PoolLogHandler(log_dir() / "pool.log", int(settings().pool_log_max_mb * 2**20))
        handler.setFormatter(logging.Formatter(log_format))
        logging.basicConfig(level=logging.INFO, handlers=[handler])
    else:
        logging.basicConfig(level=logging.INFO, format=log_format)
    server = PoolServer(manifests_dir(manifests), quiet_exit_s=quiet_exit_s)
    # Never the folder it was started from (a shared project or scratch folder): what runs later
    # (`python -c` probes, a tool's relative path) must find nothing planted there.
    os.chdir(server.state_dir)
    server.serve_forever()


def _pool(manifests: Path | None, start: bool = True):
    from ..client import Pool

    return Pool(manifests_dir(manifests), start=start)


@app.command()
def status(
    as_json: Annotated[bool, typer.Option("--json", help="Print the pool's state as JSON.")] = False,
    require: Annotated[bool, typer.Option(
        "--require", help="Exit 1 when no pool runs (for health checks); without it that is not an error.")] = False,
    manifests: ManifestsOption = None,
) -> None:
    """The pool's workers, the providers it knows, its admission queue and any open breaker."""
    try:
        with _pool(manifests, start=False) as pool:
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
    table = Table(title=f"resident-pool {pool['version']} (pid {pool['pid']}, manifests {safe(pool['manifests'])})"
                        + (" [yellow]draining to stop[/]" if pool.get("draining") else ""))
    columns = ("slug", "replica", "pid", "state", "version", "fingerprint", "device", "gpu_gb", "served",
               "idle_s", "in_flight", "uptime_s", "lease", "transcript")
    for column in columns:
        table.add_column(column, overflow="fold")
    for worker in state["workers"]:
        row = dict(worker)
        lease = worker.get("lease")
        row["lease"] = "" if lease is None else (
            f"{lease['age_s']:g} s" + (f" ({', '.join(lease['holder'].values())})" if lease["holder"] else ""))
        if not worker.get("current", True):
            row["version"] = f"{worker['version']} (old)"
        row["fingerprint"] = (worker.get("fingerprint") or "")[:8]
        row["gpu_gb"] = _gpu_cell(worker)
        row["in_flight"] = "" if worker.get("in_flight_s") is None else f"{worker['in_flight_s']:g} s"
        if worker.get("kept_warm"):
            row["state"] = f"{worker['state']} (kept warm)"
        table.add_row(*("" if row[c] is None else safe(row[c]) for c in columns))
    if state["workers"]:
        console.print(table)
    else:
        console.print(f"resident-pool (pid {state['pool']['pid']}): no workers held; the next request starts one")
    if pool.get("metrics_error"):
        console.print(f"[red]no metrics served[/]: {safe(pool['metrics_error'])}")
    if state["waiting"]:
        console.print("waiting: " + safe("; ".join(json.dumps(w) for w in state["waiting"])))
    for slug, breaker in state["breakers"].items():
        console.print(f"[red]breaker[/] {slug}: {'open' if breaker['open'] else 'closed'} "
                      f"({breaker['failures']} failed starts, {breaker['refused']} refused): {safe(breaker['error'])}")
    for worker in state["workers"]:
        if worker.get("over_budget"):
            console.print(f"[red]over budget[/] {safe(worker['over_budget'])}")
    _print_providers(state.get("providers", {}))
    for slug, provider in state.get("providers", {}).items():
        for line in _provider_lines(slug, provider):
            console.print(without_controls(line), highlight=False, markup=False, soft_wrap=True)


def _provider_lines(slug: str, provider: dict) -> list[str]:
    """How the provider's workers start, what eviction does to them, and its JIT cache, one line each."""
    lines = []
    start = provider.get("start") or {}
    zygote = start.get("zygote")
    if start.get("way") == "zygote" and zygote and zygote.get("pid"):
        preload = sum((zygote.get("modules_s") or {}).values())
        load = f", load stage {zygote['load_s']:g} s" if zygote.get("load_s") is not None else ""
        lines.append(f"{slug}: workers forked from zygote pid {zygote['pid']} (preload {preload:.1f} s{load}; "
                     f"{zygote['forks']} fork(s), {zygote['workers']} alive)")
    elif start.get("way") == "zygote":
        lines.append(f"{slug}: workers forked from a zygote (none running now; the next start starts one)")
    elif start.get("way") == "spawn" and start.get("why") != "no [lifecycle] preload":
        lines.append(f"{slug}: workers spawned: {start['why']}")
    eviction = provider.get("eviction") or {}
    if eviction.get("evict") == "hibernate":
        said = eviction.get("unavailable") or eviction.get("last")
        lines.append(f"{slug}: evicted workers hibernate" + (f" ({said})" if said else ""))
    cache = provider.get("jit_cache")
    if cache:
        lines.append(f"{slug}: JIT cache {cache['bytes'] / 2**20:.1f} MiB in {cache['root']} "
                     f"({len(cache['keys'])} stack key(s))")
    return lines


def _gpu_cell(worker: dict) -> str:
    """``used / budget GB (peak P)``: what the card says beside what the manifest declared."""
    budget, used, peak = worker.get("budget_gb"), worker.get("gpu_used_gb"), worker.get("gpu_peak_gb")
    if used is None:
        return "" if budget is None else f"? / {budget:g}"
    text = f"{used:.2f} / {budget:g}" if budget is not None else f"{used:.2f}"
    return text + (f" (peak {peak:.2f})" if peak is not None and peak != used else "")


def _print_providers(providers: dict) -> None:
    """Every provider the pool knows, running or not, with what an operator acts on."""
    if not providers:
        return
    table = Table(title="providers")
    columns = ("provider", "running", "min/max", "budget_gb", "measured_peak_gb", "fingerprint", "breaker",
               "last error / advice")
    for column in columns:
        table.add_column(column, overflow="fold")
    for slug, provider in sorted(providers.items()):
        breaker = provider.get("breaker")
        notes = "; ".join(x for x in (provider.get("last_error"), provider.get("budget_advice")) if x)
        table.add_row(
            slug, str(provider.get("running", 0)),
            f"{provider.get('min_replicas', '')}/{provider.get('max_replicas', '')}",
            "" if provider.get("budget_gb") is None else f"{provider['budget_gb']:g}",
            "" if provider.get("measured_peak_gb") is None else f"{provider['measured_peak_gb']:.2f}",
            (provider.get("fingerprint") or "")[:8],
            "" if not breaker else ("open" if breaker["open"] else "closed") + f" ({breaker['failures']} failed)",
            safe(notes))
    console.print(table)


@app.command()
def warm(
    slug: str,
    replicas: Annotated[int, typer.Option("--replicas", min=1, max=64,
                                          help="How many workers of SLUG to have running.")] = 1,
    manifests: ManifestsOption = None,
) -> None:
    """Start SLUG's workers now (starting the pool if none runs), so the next request finds them warm."""
    try:
        with _pool(manifests) as pool:
            result = pool.warm(slug, replicas)
    except ResidentPoolError as exc:
        console.print(f"[red]{type(exc).__name__}[/]: {safe(exc)}")
        raise typer.Exit(1) from None
    console.print(f"{slug}: {result['already_warm'] + result['started']} of {replicas} worker(s) warm "
                  f"({result['started']} started now)", highlight=False)
    for error in result["errors"]:
        console.print(f"[red]failed[/]: {safe(error)}")
    if result["errors"]:
        raise typer.Exit(1)


@app.command()
def metrics(manifests: ManifestsOption = None) -> None:
    """The pool's metrics in Prometheus's text format (for a node-exporter textfile collector)."""
    from ..ops.metrics import no_pool_text

    try:
        with _pool(manifests, start=False) as pool:
            text = pool.metrics_text()
    except (ResidentPoolError, OSError) as exc:
        typer.echo(f"resident-pool metrics: {without_controls(str(exc))}", err=True)
        text = no_pool_text()
    typer.echo(text, nl=False)


@app.command()
def events(
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep printing events as they come.")] = False,
    from_start: Annotated[bool, typer.Option(
        "--from-start", help="Begin at the oldest kept event (the relay otherwise resumes where it stopped, "
        "or begins with new events).")] = False,
    to_prefect: Annotated[bool, typer.Option(
        "--to-prefect", help="Relay each event to the Prefect API ($PREFECT_API_URL) instead of printing it; "
        "runs until stopped.")] = False,
) -> None:
    """The pool's lifecycle events (workers started, stopped and why, over budget), one JSON object a line."""
    from ..host.paths import log_dir
    from ..ops.events import EVENTS_FILE, Follower

    if to_prefect:
        try:
            from ..prefect import relay_events
        except ImportError as exc:
            raise typer.BadParameter(f"--to-prefect needs Prefect installed (pip install 'resident-pool[prefect]'): "
                                     f"{exc}") from None
        try:
            relay_events(from_start=from_start, say=lambda line: typer.echo(line, err=True))
        except ResidentPoolError as exc:
            typer.echo(without_controls(str(exc)), err=True)
            raise typer.Exit(1) from None
        return
    follower = Follower(log_dir() / EVENTS_FILE, from_start=from_start or not follow)
    try:
        while True:
            for record in follower.poll():
                typer.echo(json.dumps(record))
            if not follow:
                return
            time.sleep(0.5)
    except KeyboardInterrupt:
        return
    finally:
        follower.close()


@app.command()
def predict(
    slug: str,
    json_text: Annotated[str | None, typer.Option("--json", help="The payload as JSON text.")] = None,
    input_file: Annotated[Path | None, typer.Option("--input", help="A file holding the JSON payload.")] = None,
    manifests: ManifestsOption = None,
) -> None:
    """Send one prediction to SLUG through the pool and print its result as JSON."""
    if (json_text is None) == (input_file is None):
        raise typer.BadParameter("give the payload with exactly one of --json TEXT or --input FILE")
    text = json_text if json_text is not None else input_file.read_text()
    try:
        payload = json.loads(text)
    except ValueError as exc:
        raise typer.BadParameter(f"the payload is not JSON: {exc}") from None
    try:
        with _pool(manifests) as pool:
            result = pool.predict(slug, payload)
    except ResidentPoolError as exc:
        console.print(f"[red]{type(exc).__name__}[/]: {safe(exc)}")
        raise typer.Exit(1) from None
    typer.echo(json.dumps(result, default=plain))  # arrays as nested lists, bytes as base64


@app.command()
def stop(
    slug: Annotated[str | None, typer.Argument(help="The provider whose workers to stop.")] = None,
    all_: Annotated[bool, typer.Option("--all", help="Stop every worker.")] = False,
    now: Annotated[bool, typer.Option("--now", help="Do not let leased requests finish first.")] = False,
    manifests: ManifestsOption = None,
) -> None:
    """Stop a provider's workers (or all of them); leased ones finish their requests first; the device is given back."""
    if (slug is None) == (not all_):
        raise typer.BadParameter("name one SLUG, or --all")
    try:
        with _pool(manifests, start=False) as pool:
            stopped = pool.stop(None if all_ else slug, now=now)
    except ResidentPoolError as exc:
        console.print(safe(exc))
        raise typer.Exit(0) from None
    console.print("stopped: " + (", ".join(stopped) or "nothing was running"), highlight=False, markup=False)


@app.command()
def logs(
    slug: str,
    tail: Annotated[int, typer.Option("--tail", help="How many lines of the newest transcript.")] = 40,
) -> None:
    """The newest transcript of SLUG's workers: its path, then its last lines."""
    from ..host.paths import log_dir
    from ..providers.manifest import SLUG
    from ..providers.transcripts import read_tail

    if not SLUG.fullmatch(slug):
        raise typer.BadParameter(f"{slug!r} is not a provider name (lowercase letters, digits, '-' and '_', "
                                 "as its manifests folder is named)", param_hint="SLUG")
    # Transcripts the pool wrote: plain files in the log folder, never a link planted there.
    transcripts = sorted((p for p in log_dir().glob(f"{slug}-*.log") if p.is_file() and not p.is_symlink()),
                         key=lambda p: p.stat().st_mtime)
    if not transcripts:
        console.print(f"no transcript for {slug} in {safe(log_dir())}")
        raise typer.Exit(1)
    newest = transcripts[-1]
    typer.echo(f"==> {without_controls(str(newest))} <==")
    for line in read_tail(newest, tail):
        typer.echo(without_controls(line))


cache_app = typer.Typer(help="The kits' JIT caches: one folder per provider and stack key.", no_args_is_help=True)
app.add_typer(cache_app, name="cache")


@cache_app.command("prune")
def cache_prune(
    older_than: Annotated[float, typer.Option(
        "--older-than", help="Days a superseded stack key is kept after its last use (0: remove them all now).",
    )] = 7.0,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Say what would go; remove nothing.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print what was removed and kept as JSON.")] = False,
) -> None:
    """Remove JIT cache folders no start uses: each provider's newest stack key is always kept.

    Only the pool's own root (under $XDG_CACHE_HOME/resident-pool/jit) is pruned; a root you named
    ([kit] jit_root, $MODEL_OPT_JIT_ROOT) is yours.
    """
    from ..providers import jit_cache

    if older_than < 0:
        raise typer.BadParameter("--older-than takes a number of days, 0 or more")
    base = jit_cache.default_base(os.environ)
    removed, kept = jit_cache.prune(base, older_than * 86400, dry_run=dry_run)
    if as_json:
        typer.echo(json.dumps({"base": str(base), "dry_run": dry_run, "removed": removed, "kept": kept}, indent=2))
        return
    verb = "would remove" if dry_run else "removed"
    for folder in removed:
        console.print(f"{verb} {folder['path']} ({folder['bytes'] / 2**20:.1f} MiB)", highlight=False, markup=False)
    if not removed:
        console.print(f"nothing to remove under {base}", highlight=False, markup=False)
    for folder in kept:
        console.print(f"kept {folder['provider']}/{folder['key']} ({folder['bytes'] / 2**20:.1f} MiB)",
                      highlight=False, markup=False)
    freed = sum(folder["bytes"] for folder in removed) / 2**20
    console.print(f"{len(removed)} folder(s), {freed:.1f} MiB {verb}", highlight=False, markup=False)


def main() -> None:
    app()
