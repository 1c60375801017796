"""The commands about providers themselves: check, schema, and the kits' JIT caches."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from ..providers.manifest import json_schema
from ..providers.transcripts import without_controls
from ..validation.check import NOT_JUDGED, check_providers, junit_xml
from ..validation.provenance import columns
from .base import (
    AsJson,
    ManifestsOption,
    app,
    configured,
    console,
    json_chosen,
    manifests_dir,
    require_provider,
    safe,
)
from .tables import Column, fit_table

__all__ = ["cache_app"]

CHECK_COLUMNS = [Column("provider", 100), Column("step", 90), Column("result", 95), Column("detail", text=True)]


@app.command()
def schema(
    as_json: Annotated[bool, typer.Option("--json", help="Accepted for scripts: the schema is JSON either way.")]
    = False,
) -> None:
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
    as_json: AsJson = False,
    manifests: ManifestsOption = None,
) -> None:
    """Verify weights against their pins and probe each kit; exit 1 on any failure."""
    if bless and not slugs:
        raise typer.BadParameter("name the providers to bless: `resident-pool check --bless SLUG...`")
    if force and not bless:
        raise typer.BadParameter("--force only applies to --bless")
    folder = manifests_dir(manifests)
    for slug in slugs or []:
        require_provider(slug, folder, as_json=as_json)
    config, paths = configured()
    results = check_providers(folder, slugs or [], smoke=smoke, config=config, paths=paths,
                              against_stock=against_stock, bless=bless, force=force)
    if junit:
        junit.write_text(junit_xml(results))
    failed = [r for r in results if not r.ok and not r.skipped]
    if as_json:
        typer.echo(json.dumps([r.__dict__ for r in results], indent=2, default=str))
    else:
        rows = []
        for r in results:
            verdict = "[yellow]skipped[/]" if r.skipped else ("[green]ok[/]" if r.ok else "[red]FAILED[/]")
            rows.append([safe(r.slug), r.step, verdict, safe(r.detail)])  # paths like items[0] are not markup
        table, _ = fit_table(console, "resident-pool check", CHECK_COLUMNS, rows)
        console.print(table)
        _print_provenance(results)
        for r in results:
            if r.step == "bless" and r.data.get("diff"):
                console.print(f"{safe(r.slug)}: against the old {safe(r.data['expected_file'])}:", highlight=False)
                for line in r.data["diff"]:
                    console.print(f"  {without_controls(line)}", highlight=False, markup=False)
        if not results:
            console.print(f"no provider in {safe(folder)}", highlight=False)
        unjudged = [r.slug for r in results if r.step == "answers" and r.data.get("reason") == NOT_JUDGED]
        skipped = sum(r.skipped for r in results)
        console.print(f"{len(failed)} failed, {sum(r.ok for r in results)} passed"
                      + (f", {skipped} skipped" if skipped else "")
                      + (f"; answers not judged ({', '.join(map(safe, unjudged))}): run with --smoke to judge them"
                         if unjudged else "")
                      + (f"; JUnit report: {junit}" if junit else ""), highlight=False)
    if failed or not results:
        raise typer.Exit(1)


def _print_provenance(results) -> None:
    """One line per provider: what produced its answers."""
    for slug in dict.fromkeys(r.slug for r in results):
        values: dict[str, str] = {}
        for r in results:
            if r.slug == slug:
                values.update(r.provenance)  # a smoke or bless step adds the expected file it compared or wrote
        if "manifest.fingerprint" in values:
            line = "; ".join(f"{name} {value}" for name, value in columns(values).items() if value)
            console.print(f"{slug}: {without_controls(line)}", highlight=False, markup=False, soft_wrap=True)


cache_app = typer.Typer(help="The kits' JIT caches: one folder per provider and stack key.", no_args_is_help=True)
app.add_typer(cache_app, name="cache")


@cache_app.command("prune")
def cache_prune(
    older_than: Annotated[float, typer.Option(
        "--older-than", help="Days a superseded stack key is kept after its last use (0: remove them all now).",
    )] = 7.0,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Say what would go; remove nothing.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print what was removed and kept as JSON.",
                                          callback=json_chosen)] = False,
) -> None:
    """Remove JIT cache folders no start uses: each provider's newest stack key is always kept.

    Only the pool's own root (jit in its cache folder: $RESIDENT_POOL_CACHE_DIR, else
    $XDG_CACHE_HOME/resident-pool) is pruned; a root you named
    ([kit] jit_root, $MODEL_OPT_JIT_ROOT) is yours.
    """
    from ..providers import jit_cache

    if older_than < 0:
        raise typer.BadParameter("--older-than takes a number of days, 0 or more")
    base = jit_cache.default_base(configured()[1].cache)
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
