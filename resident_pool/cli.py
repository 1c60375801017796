"""The `resident-pool` command."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from .arrays import plain
from .check import check_providers, junit_xml
from .errors import ResidentPoolError
from .manifest import json_schema

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


def manifests_dir(option: Path | None) -> Path:
    return option or Path(os.environ.get("RESIDENT_POOL_MANIFESTS", "manifests"))


@app.command()
def schema() -> None:
    """Print the JSON Schema of a provider manifest."""
    typer.echo(json.dumps(json_schema(), indent=2))


@app.command()
def check(
    slugs: Annotated[list[str] | None, typer.Argument(help="Providers to check (default: all).")] = None,
    smoke: Annotated[bool, typer.Option("--smoke", help="Also start each worker and run its smoke payload.")] = False,
    junit: Annotated[Path | None, typer.Option("--junit", help="Write a JUnit XML report here.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print results as JSON.")] = False,
    manifests: ManifestsOption = None,
) -> None:
    """Verify weights against their pins and probe each kit; exit 1 on any failure."""
    results = check_providers(manifests_dir(manifests), slugs or [], smoke=smoke)
    if junit:
        junit.write_text(junit_xml(results))
    failed = [r for r in results if not r.ok and not r.skipped]
    if as_json:
        typer.echo(json.dumps([r.__dict__ for r in results], indent=2))
    else:
        table = Table(title="resident-pool check")
        for column in ("provider", "step", "result", "detail"):
            table.add_column(column, overflow="fold")
        for r in results:
            verdict = "[yellow]skipped[/]" if r.skipped else ("[green]ok[/]" if r.ok else "[red]FAILED[/]")
            table.add_row(r.slug, r.step, verdict, r.detail)
        console.print(table)
        console.print(f"{len(failed)} failed, {sum(r.ok for r in results)} passed"
                      + (f"; JUnit report: {junit}" if junit else ""))
    if failed or not results:
        raise typer.Exit(1)


@app.command()
def daemon(
    manifests: ManifestsOption = None,
    background: Annotated[bool, typer.Option("--background", help="Detach and return once started.")] = False,
    quiet_exit_s: Annotated[
        float | None, typer.Option(help="Exit after this long with no workers and no clients (0: never).")
    ] = None,
) -> None:
    """Run this host's pool: it owns the workers, the ledger writes and the admission queue."""
    from .pool import PoolServer

    if background and os.fork() > 0:
        os._exit(0)  # the client that started us waits for this exit, then for the socket
    if background:
        os.setsid()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    PoolServer(manifests_dir(manifests), quiet_exit_s=quiet_exit_s).serve_forever()


def _pool(manifests: Path | None, start: bool = True):
    from .client import Pool

    return Pool(manifests_dir(manifests), start=start)


@app.command()
def status(
    as_json: Annotated[bool, typer.Option("--json", help="Print the pool's state as JSON.")] = False,
    manifests: ManifestsOption = None,
) -> None:
    """The pool's workers, its admission queue and any open breaker."""
    try:
        with _pool(manifests, start=False) as pool:
            state = pool.status()
    except ResidentPoolError as exc:
        if as_json:
            typer.echo(json.dumps({"pool": None, "workers": [], "error": str(exc)}))
        else:
            console.print(str(exc))
        raise typer.Exit(0) from None
    if as_json:
        typer.echo(json.dumps(state, indent=2))
        return
    table = Table(title=f"resident-pool (pid {state['pool']['pid']}, manifests {state['pool']['manifests']})")
    columns = ("slug", "replica", "pid", "state", "device", "budget_gb", "served", "idle_s", "uptime_s", "transcript")
    for column in columns:
        table.add_column(column, overflow="fold")
    for worker in state["workers"]:
        table.add_row(*("" if worker[c] is None else str(worker[c]) for c in columns))
    if state["workers"]:
        console.print(table)
    else:
        console.print(f"resident-pool (pid {state['pool']['pid']}): no workers held; the next request starts one")
    if state["waiting"]:
        console.print("waiting: " + "; ".join(json.dumps(w) for w in state["waiting"]))
    for slug, breaker in state["breakers"].items():
        console.print(f"[red]breaker[/] {slug}: {'open' if breaker['open'] else 'closed'} "
                      f"({breaker['failures']} failed starts, {breaker['refused']} refused): {breaker['error']}")


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
        console.print(f"[red]{type(exc).__name__}[/]: {exc}")
        raise typer.Exit(1) from None
    typer.echo(json.dumps(result, default=plain))  # arrays as nested lists, bytes as base64


@app.command()
def stop(
    slug: Annotated[str | None, typer.Argument(help="The provider whose workers to stop.")] = None,
    all_: Annotated[bool, typer.Option("--all", help="Stop every worker.")] = False,
    manifests: ManifestsOption = None,
) -> None:
    """Stop a provider's workers (or all of them); the device is given back."""
    if (slug is None) == (not all_):
        raise typer.BadParameter("name one SLUG, or --all")
    try:
        with _pool(manifests, start=False) as pool:
            stopped = pool.stop(None if all_ else slug)
    except ResidentPoolError as exc:
        console.print(str(exc))
        raise typer.Exit(0) from None
    console.print("stopped: " + (", ".join(stopped) or "nothing was running"))


@app.command()
def logs(
    slug: str,
    tail: Annotated[int, typer.Option("--tail", help="How many lines of the newest transcript.")] = 40,
) -> None:
    """The newest transcript of SLUG's workers: its path, then its last lines."""
    from .paths import log_dir
    from .supervisor import read_tail

    transcripts = sorted(log_dir().glob(f"{slug}-*.log"), key=lambda p: p.stat().st_mtime)
    if not transcripts:
        console.print(f"no transcript for {slug} in {log_dir()}")
        raise typer.Exit(1)
    newest = transcripts[-1]
    typer.echo(f"==> {newest} <==")
    for line in read_tail(newest, tail):
        typer.echo(line)


def main() -> None:
    app()
