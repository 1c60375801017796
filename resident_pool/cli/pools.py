"""The commands that talk to the running pool: daemon, warm, predict, stop, metrics, events, logs."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from ..errors import ResidentPoolError
from ..providers.transcripts import read_tail, without_controls
from .base import (
    AsJson,
    ManifestsOption,
    app,
    check_slug,
    configured,
    console,
    errors,
    fail,
    json_chosen,
    manifests_dir,
    print_json,
    require_provider,
    safe,
)

__all__ = ["pool_client"]

FOLLOW_POLL_S = 0.5
SERVING_POLL_S = 1.0  # how often `logs -f` asks the pool which worker serves, while the transcript is quiet


def pool_client(manifests: Path | None, start: bool = True):
    from ..client import Pool

    return Pool(manifests_dir(manifests), start=start)


@app.command()
def daemon(
    manifests: ManifestsOption = None,
    background: Annotated[bool, typer.Option("--background", help="Detach and return once started.")] = False,
    quiet_exit_s: Annotated[
        float | None, typer.Option(help="Exit after this long with no workers and no clients (0: never).")
    ] = None,
) -> None:
    """Run this host's pool: it owns the workers, the ledger writes and the admission queue."""
    from ..server.daemon import run

    status = run(manifests, background=background, quiet_exit_s=quiet_exit_s)
    if status:
        raise typer.Exit(status)


@app.command()
def warm(
    slug: str,
    replicas: Annotated[int, typer.Option("--replicas", min=1, max=64,
                                          help="How many workers of SLUG to have running.")] = 1,
    as_json: AsJson = False,
    manifests: ManifestsOption = None,
) -> None:
    """Start SLUG's workers now (starting the pool if none runs), so the next request finds them warm."""
    folder = manifests_dir(manifests)
    require_provider(slug, folder, as_json=as_json)
    try:
        with pool_client(folder) as pool:
            result = pool.warm(slug, replicas)
    except ResidentPoolError as exc:
        fail(f"{type(exc).__name__}: {exc}", as_json, reason=exc.reason or "error")
    if as_json:
        print_json({**result, "replicas": replicas})
    else:
        console.print(f"{slug}: {result['already_warm'] + result['started']} of {replicas} worker(s) warm "
                      f"({result['started']} started now)", highlight=False)
        for error in result["errors"]:
            errors.print(f"[red]failed[/]: {safe(error)}")
    if result["errors"]:
        raise typer.Exit(1)


@app.command()
def predict(
    slug: str,
    payload: Annotated[str | None, typer.Option("--payload", help="The payload as JSON text.")] = None,
    input_file: Annotated[Path | None, typer.Option("--input", help="A file holding the JSON payload.")] = None,
    json_text: Annotated[str | None, typer.Option(
        "--json", hidden=True, help="The payload as JSON text (deprecated: use --payload).")] = None,
    kind: Annotated[str | None, typer.Option(
        "--kind", help="How the payload's inputs are read: protein or text (default: its \"kind\", else the "
        "provider's first).")] = None,
    manifests: ManifestsOption = None,
) -> None:
    """Send one prediction to SLUG through the pool and print its result as JSON.

    The payload's "inputs" are ruled as every entry point rules them (the provider's \\[inputs]): one it refuses
    fails alone, named on stderr and as {"ok": false, "reason": "bad_input", ...} in its place among the items;
    the others are answered, and the command exits 1.
    """
    if json_text is not None:
        errors.print("resident-pool predict: --json TEXT is deprecated and goes in the next release: use "
                     "--payload TEXT (--json means JSON output everywhere else)", highlight=False, markup=False)
    given = [value for value in (payload, json_text, input_file) if value is not None]
    if len(given) != 1:
        raise typer.BadParameter("give the payload with exactly one of --payload TEXT or --input FILE")
    try:
        text = input_file.read_text() if input_file is not None else given[0]
    except (OSError, UnicodeDecodeError) as exc:
        raise typer.BadParameter(f"cannot read {input_file}: {exc}", param_hint="--input") from None
    try:
        body = json.loads(text)
    except ValueError as exc:
        raise typer.BadParameter(f"the payload is not JSON: {exc}") from None
    folder = manifests_dir(manifests)
    require_provider(slug, folder)
    ruled = _ruled(slug, folder, body, kind)
    if ruled is not None and ruled[2] and not ruled[1]:  # every input refused: nothing to send
        for why in ruled[2].values():
            errors.print(f"{safe(slug)}: {safe(why)}", highlight=False)
        fail(f"{slug}: every input was refused by its input rule", reason="bad_input")
    try:
        with pool_client(folder) as pool:
            result = pool.predict(slug, ruled[0] if ruled is not None else body)
    except ResidentPoolError as exc:
        fail(f"{type(exc).__name__}: {exc}", reason=exc.reason or "error")
    from ..arrays import plain

    if ruled is not None and ruled[2]:
        from ..campaigns.answers import per_input, with_refused

        sent, kept, refused = ruled
        items = with_refused(per_input(result, len(sent["inputs"])), kept, refused, len(body["inputs"]))
        result = {**result, "items": items} if isinstance(result, dict) else result
    typer.echo(json.dumps(result, default=plain))  # arrays as nested lists, bytes as base64
    if ruled is not None and ruled[2]:
        for why in ruled[2].values():
            errors.print(f"{safe(slug)}: {safe(why)}", highlight=False)
        raise typer.Exit(1)


def _ruled(slug: str, folder: Path, body: Any, kind: str | None):
    """For a payload of inputs, (the payload to send, the positions sent, why each other was refused); else None."""
    from ..errors import ManifestError
    from ..providers.input_rules import KINDS, kind_option, rule_inputs
    from ..providers.manifest import load_manifest, manifest_path

    if kind is not None and kind not in KINDS:
        raise typer.BadParameter(f"{kind!r}: give one of {', '.join(KINDS)}", param_hint="--kind")
    try:
        manifest = load_manifest(manifest_path(folder, slug))
    except ManifestError as exc:
        fail(f"ManifestError: {exc}", reason=exc.reason or "bad_manifest")
    if not (isinstance(body, dict) and isinstance(body.get("inputs"), list) and manifest.takes_inputs()):
        return None
    wanted = kind or body.get("kind")
    read_as = manifest.inputs.kind_for(wanted if isinstance(wanted, str) else None)
    if wanted is not None and wanted != read_as:
        fail(f"{slug} takes {' and '.join(manifest.inputs.kinds)} inputs, not {wanted!r}", reason="bad_input")
    texts, kept, refused = rule_inputs(manifest.inputs, body["inputs"], read_as)
    sent = {key: value for key, value in body.items() if key != "kind"}
    return {**sent, "inputs": texts, **kind_option(manifest.inputs, read_as)}, kept, refused


@app.command()
def stop(
    slug: Annotated[str | None, typer.Argument(help="The provider whose workers to stop.")] = None,
    all_: Annotated[bool, typer.Option("--all", help="Stop every worker.")] = False,
    now: Annotated[bool, typer.Option("--now", help="Do not let leased requests finish first.")] = False,
    as_json: AsJson = False,
    manifests: ManifestsOption = None,
) -> None:
    """Stop a provider's workers (or all of them); leased ones finish their requests first; the device is given back."""
    if (slug is None) == (not all_):
        raise typer.BadParameter("name one SLUG, or --all")
    folder = manifests_dir(manifests)
    if slug is not None:
        check_slug(slug)
    try:
        with pool_client(folder, start=False) as pool:
            if slug is not None:
                # The pool's own providers count too: it may serve a folder other than this one.
                running = {key.partition("~")[0] for key in pool.status().get("providers", {})}
                require_provider(slug, folder, also=running, as_json=as_json)
            stopped = pool.stop(None if all_ else slug, now=now)
    except ResidentPoolError as exc:
        if slug is not None:
            require_provider(slug, folder, as_json=as_json)
        said = "no pool is running: nothing to stop" if exc.reason == "no_pool" else str(exc)
        if as_json:
            print_json({"pool": None, "stopped": [], "note": said})
        else:
            console.print(safe(said), highlight=False)
        if exc.reason != "no_pool":
            raise typer.Exit(1) from None
        return
    if as_json:
        print_json({"stopped": stopped})
    else:
        console.print("stopped: " + (", ".join(stopped) or "nothing was running"), highlight=False, markup=False)


@app.command()
def metrics(as_json: AsJson = False, manifests: ManifestsOption = None) -> None:
    """The pool's metrics in Prometheus's text format (for a node-exporter textfile collector)."""
    from ..ops.metrics import no_pool_text

    try:
        with pool_client(manifests, start=False) as pool:
            text = pool.metrics_text()
    except (ResidentPoolError, OSError) as exc:
        errors.print(f"resident-pool metrics: {safe(exc)}", highlight=False)
        text = no_pool_text()
    if as_json:
        print_json(_metric_families(text))
    else:
        typer.echo(text, nl=False)


def _metric_families(text: str) -> list[dict[str, Any]]:
    """Prometheus text as data: one entry per metric, its samples with their labels."""
    from prometheus_client.parser import text_string_to_metric_families

    return [{"name": family.name, "type": family.type, "help": family.documentation,
             "samples": [{"name": s.name, "labels": s.labels, "value": s.value} for s in family.samples]}
            for family in text_string_to_metric_families(text)]


@app.command()
def replay(
    log: Annotated[Path, typer.Argument(help="a core event log (RESIDENT_POOL_CORE_LOG)")],
    as_json: AsJson = False,
) -> None:
    """Feed a pool's core event log to a fresh decision core: exit 0 when it decides the same actions throughout,
    else 1, naming the first event it decided otherwise."""
    from ..server.corelog import replay as replay_log

    notes: list[str] = []  # what was left out: a last line cut short, lines after the log stopped
    try:
        with open(log, encoding="utf-8") as lines:
            count, divergence = replay_log(lines, notes)
    except (OSError, ValueError, KeyError) as exc:
        fail(f"resident-pool replay: {log} cannot be replayed: {safe(exc)}", as_json, "bad_log", code=2)
    for note in notes if not as_json else ():
        errors.print(f"{log}: {note}", markup=False, highlight=False)
    if as_json:
        print_json({"events": count, "same": divergence is None, "notes": notes,
                    "divergence": None if divergence is None else {
                        "line": divergence.line, "event": divergence.event, "recorded": divergence.recorded,
                        "replayed": divergence.replayed}})
    elif divergence is None:
        console.print(f"{count} events replayed into a fresh core: the same decisions throughout", highlight=False)
    else:
        console.print(f"line {divergence.line}: the replayed core decided otherwise on {json.dumps(divergence.event)}"
                      f"\n  recorded: {json.dumps(divergence.recorded)}\n  replayed: {json.dumps(divergence.replayed)}",
                      markup=False, highlight=False)
    if divergence is not None:
        raise typer.Exit(1)


@app.command()
def events(
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep printing events as they come.")] = False,
    from_start: Annotated[bool, typer.Option(
        "--from-start", help="Begin at the oldest kept event (the relay otherwise resumes where it stopped, "
        "or begins with new events).")] = False,
    to_prefect: Annotated[bool, typer.Option(
        "--to-prefect", help="Relay each event to the Prefect API ($PREFECT_API_URL) instead of printing it; "
        "runs until stopped.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Accepted for scripts: the events are JSON lines "
                                          "either way.", callback=json_chosen)] = False,
) -> None:
    """The pool's lifecycle events (workers started, stopped and why, over budget), one JSON object a line."""
    from ..ops.events import EVENTS_FILE, Follower

    if to_prefect:
        try:
            from ..prefect import relay_events
        except ImportError as exc:
            raise typer.BadParameter(f"--to-prefect needs Prefect installed (pip install 'resident-pool[prefect]'): "
                                     f"{exc}") from None
        try:
            relay_events(configured()[1].log_dir(), from_start=from_start,
                         say=lambda line: typer.echo(line, err=True))
        except ResidentPoolError as exc:
            typer.echo(without_controls(str(exc)), err=True)
            raise typer.Exit(1) from None
        return
    follower = Follower(configured()[1].log_dir() / EVENTS_FILE, from_start=from_start or not follow)
    try:
        while True:
            for record in follower.poll():
                typer.echo(json.dumps(record))
            if not follow:
                return
            time.sleep(FOLLOW_POLL_S)
    except KeyboardInterrupt:
        return
    finally:
        follower.close()


# <slug>-<replica>-<date>-<time>-<random>.log: `esm` must not take `esm-2`'s transcripts.
_TRANSCRIPT = r"-\d+-(\d{8}-\d{6})-[0-9a-f]+\.log"


def _transcripts(slug: str) -> list[Path]:
    """SLUG's transcripts in the log folder, the latest start last: plain files the pool named, never a link."""
    name = re.compile(re.escape(slug) + _TRANSCRIPT)
    found = []
    for path in configured()[1].log_dir().glob(f"{slug}-*.log"):
        match = name.fullmatch(path.name)
        if match and path.is_file() and not path.is_symlink():
            found.append(((match.group(1), path.stat().st_mtime), path))
    return [path for _, path in sorted(found)]


@app.command()
def logs(
    slug: str,
    tail: Annotated[int, typer.Option("--tail", help="How many lines of the transcript.")] = 40,
    follow: Annotated[bool, typer.Option(
        "--follow", "-f", help="Keep printing what the transcript gains, and move to the next one when another "
        "worker of SLUG starts serving, until Ctrl-C.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print {transcript, line} objects, one a line.",
                                          callback=json_chosen)] = False,
    manifests: ManifestsOption = None,
) -> None:
    """The transcript of the worker serving SLUG now (the running pool says which), else SLUG's newest: its
    path, then its last lines.

    A check's smoke run starts a worker of its own, whose transcript is newer than the serving one's: it is
    not the one a person following SLUG wants.
    """
    check_slug(slug)
    folder = manifests_dir(manifests)
    transcripts = _transcripts(slug)
    if not transcripts:
        require_provider(slug, folder, as_json=as_json)
        fail(f"no transcript for {slug} in {configured()[1].log_dir()}: none of its workers has started since the "
             "log folder was last cleared", as_json, reason="no_transcript")
    shown = _current(slug, folder, transcripts)
    say = _say(as_json)
    say(shown, None)
    for line in read_tail(shown, tail):
        say(shown, line)
    if follow:
        try:
            _follow(slug, folder, shown, say)
        except KeyboardInterrupt:
            return


def _serving(slug: str, folder: Path) -> Path | None:
    """The transcript of the worker serving SLUG now, as the running pool says: a worker of SLUG itself (not a
    check's build of it), alive, leased first, then the one used last; None when no pool answers or none serves."""
    from ..errors import ResidentPoolError

    try:
        with pool_client(folder, start=False) as pool:
            workers = pool.status().get("workers", [])
    except (ResidentPoolError, OSError):
        return None
    live = [w for w in workers if w.get("slug") == slug and w.get("pid") and w.get("transcript")
            and w.get("state") not in ("stopping", "stopped", "failed")]
    if not live:
        return None
    best = min(live, key=lambda w: (w.get("state") != "leased", w.get("idle_s") or 0.0, w.get("uptime_s") or 0.0))
    return Path(best["transcript"])


def _current(slug: str, folder: Path, transcripts: list[Path]) -> Path:
    """The transcript to show: the serving worker's where it is one of SLUG's in the log folder, else the newest."""
    serving = _serving(slug, folder)
    return serving if serving in transcripts else transcripts[-1]


def _say(as_json: bool):
    def say(path: Path, line: str | None) -> None:
        if as_json:
            if line is not None:
                typer.echo(json.dumps({"transcript": str(path), "line": without_controls(line)}))
        elif line is None:
            typer.echo(f"==> {without_controls(str(path))} <==")
        else:
            typer.echo(without_controls(line))
    return say


def _follow(slug: str, folder: Path, path: Path, say) -> None:
    """Print what ``path`` gains; when another worker of SLUG serves (or, with no pool, a newer transcript
    appears), go on with its transcript."""
    following = _follow_one(slug, folder, path, say, from_end=True)
    while True:
        say(following, None)
        following = _follow_one(slug, folder, following, say, from_end=False)


def _follow_one(slug: str, folder: Path, path: Path, say, from_end: bool) -> Path:
    """Print what ``path`` gains until another transcript is the one to show; return that one."""
    with open(path, "rb") as handle:
        if from_end:
            handle.seek(0, os.SEEK_END)
        partial = b""
        asked = 0.0
        while True:
            chunk = handle.read()
            if chunk:
                *lines, partial = (partial + chunk).split(b"\n")
                for line in lines:
                    say(path, line.decode("utf-8", "replace"))
                continue
            transcripts = _transcripts(slug)
            if transcripts and time.monotonic() - asked >= SERVING_POLL_S:
                asked = time.monotonic()
                now = _current(slug, folder, transcripts)
                if now != path:
                    if partial:
                        say(path, partial.decode("utf-8", "replace"))
                    return now
            time.sleep(FOLLOW_POLL_S)
