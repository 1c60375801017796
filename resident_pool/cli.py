"""The `resident-pool` command."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from .check import check_providers, junit_xml
from .manifest import json_schema

app = typer.Typer(help="Keep model workers warm within a GPU memory budget.", no_args_is_help=True,
                  pretty_exceptions_enable=False)
console = Console()

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


def main() -> None:
    app()
