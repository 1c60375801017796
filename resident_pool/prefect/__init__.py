"""Prefect integration: predict through the host pool from a task, failures as artifacts.

Flow runs from a deployment each run in a fresh process, so nothing warm lives
here: warmth comes from the host pool, which outlives every flow run. This
module keeps only a client per process (and per manifests folder).
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import logging
import os
import re
import signal
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

from prefect import get_run_logger, runtime, task
from prefect.artifacts import acreate_markdown_artifact, create_markdown_artifact
from prefect.context import FlowRunContext, TaskRunContext
from prefect.events import Event, emit_event
from prefect.events.clients import get_events_client
from prefect.exceptions import MissingContextError
from prefect.settings import PREFECT_API_URL

from ..aio import AsyncPool, AsyncSession
from ..client import Pool, Session, default_manifests
from ..errors import (
    AdmissionRefused,
    AdmissionTimeout,
    KitUnavailable,
    ManifestError,
    ResidentPoolError,
    WeightsMismatch,
    WorkerRequestError,
    WorkerStartError,
    error_from_dict,
)
from ..exits import REFUSAL_CODES, describe_exit
from ..host.paths import Paths
from ..ops.events import EVENTS_FILE, Follower
from ..protocol import ProtocolError
from ..providers.transcripts import read_tail, without_controls
from ..settings import Settings, settings

__all__ = [
    "BREAKER_OPEN",
    "COMPLETED_WITH_FAILURES",
    "Priority",
    "apool_session",
    "apredict",
    "apredict_batch",
    "artifact_key",
    "breaker_words",
    "escape_markdown",
    "failure_artifact_key",
    "host_settings",
    "pool_session",
    "predict",
    "predict_batch",
    "queue_summary",
    "relay_events",
    "retry_pool_failures",
    "warm_provider",
]

log = logging.getLogger("resident_pool.prefect")
HOST = socket.gethostname()
BREAKER_OPEN = "breaker_open"  # the reason of a request refused at once because the provider's starts keep failing
# The name of a Completed state whose run answered some inputs and failed others: the UI shows the name (in
# Completed's colour) where a bare "Completed" would read as every input answered.
COMPLETED_WITH_FAILURES = "Completed with failures"
# While a task waits for its worker (a cold start, every replica busy), its log says so this often: a 27 s
# start that logs nothing until the end looks hung.
WAITING_FIRST_S = 3.0
WAITING_EVERY_S = 10.0


# A deployment parameter of this type is a drop-down in the Prefect UI.
Priority = Literal["interactive", "normal", "batch"]

_KEY_CHARACTERS = frozenset("abcdefghijklmnopqrstuvwxyz0123456789")
_clients: dict[tuple[Path, Path], Pool] = {}
_clients_lock = threading.Lock()


def host_settings() -> tuple[Settings, Paths]:
    """The worker host's settings, as this process's environment gives them now, and the folders they name: what a
    flow reads once at its start and hands to what it calls (never a flow-run parameter)."""
    config = settings()
    return config, Paths.of(config)


def _client(manifests: str | os.PathLike[str] | None) -> Pool:
    """One client per process and manifests folder (it is thread-safe); process pools get their own.

    The helpers' edge: the settings are read here, as the environment gives them now; a task's failure report
    takes them from the client that served it.
    """
    config, where = host_settings()
    directory = default_manifests(manifests, config, where)
    key = (directory, where.state_dir())
    with _clients_lock:
        client = _clients.get(key)
        if client is None:
            client = _clients[key] = Pool(directory)
        return client


def _log_wait(wait: dict[str, Any]) -> None:
    """A report of a wait for GPU admission, in the run's log (a call's own ``on_wait``: the client is shared)."""
    free = ", ".join(f"GPU {device}: {gb:g} GB" for device, gb in wait["free"].items()) or "no device"
    holders = "; ".join(wait["holders"]) or "nobody in the pool (memory held outside it)"
    if wait.get("ahead"):
        holders += "; queued ahead: " + ", ".join(wait["ahead"])
    get_run_logger().info(
        "waiting for GPU admission (%s, position %s in the line, %s): %s needs %g GB; free now %s; held by %s; "
        "waited %.0f s so far", wait.get("priority", "normal"), wait.get("position", 0),
        wait.get("admission", "per-user ledger"), wait["slug"], wait["needs_gb"], free, holders, wait["waited_s"],
    )


def queue_summary(manifests: str | os.PathLike[str] | None = None, limit: int = 5) -> str:
    """The pool's waiting line in a few lines of markdown (position, provider, class, age, need, what it waits
    for), for a progress artifact's description; "" when nothing waits or no pool answers."""
    try:
        waiting = _client(manifests).waiting()
    except (ResidentPoolError, OSError):
        return ""
    lines = []
    for number, row in enumerate(waiting[:limit]):
        cls = row.get("priority", "normal") + (f", ranks as {row['ranks_as']}" if row.get("ranks_as") not in
                                               (None, row.get("priority")) else "")
        need = f"{row['needs_gb']:g} GB" if row.get("needs_gb") is not None else "a replica"
        lines.append(f"{number + 1}. {row['slug']} ({cls}), {row.get('age_s', 0):.0f} s, needs {need}: "
                     f"{row.get('waits_for') or 'its turn'}")
    if len(waiting) > limit:
        lines.append(f"... and {len(waiting) - limit} more (`resident-pool status`)")
    return "\n".join(lines)


def artifact_key(*parts: str) -> str:
    """The one way an artifact key is made: Prefect takes lowercase ASCII letters, digits and dashes only.

    Any slug works; runs of other characters become one dash, and a part that had to change gets a short
    hash of itself, so two slugs never share a key (``esm_2`` -> ``esm-2-<hash>``, ``esm-2`` -> ``esm-2``).
    """
    words = []
    for part in parts:
        cleaned = [word for word in "".join(ch if ch in _KEY_CHARACTERS else "-" for ch in part.lower()).split("-")
                   if word]
        if cleaned and "-".join(cleaned) != part:
            cleaned.append(hashlib.sha256(part.encode()).hexdigest()[:6])
        words += cleaned
    return "-".join(words) or "resident-pool"


def failure_artifact_key(slug: str) -> str:
    """One stable failure artifact key per provider."""
    return artifact_key("resident-pool-failure", slug)


def _original(error: ResidentPoolError) -> ResidentPoolError | None:
    """The error an open breaker refuses with: the start failure that opened it (None for any other error)."""
    if error.reason != BREAKER_OPEN:
        return None
    original = error.details.get("original")
    return error_from_dict(original) if isinstance(original, dict) else None


def breaker_words(error: ResidentPoolError) -> str | None:
    """For a request an open breaker refused: why, when it closes and how to reset it, in one sentence; else None."""
    if error.reason != BREAKER_OPEN:
        return None
    breaker = error.details.get("breaker") or {}
    slug = error.slug or "the provider"
    failures = breaker.get("failures")
    closes = breaker.get("closes_in_s")
    opened = f"its last {failures} start(s) failed" if failures else "its starts failed"
    when = f"the breaker closes in {_seconds(closes)}" if isinstance(closes, int | float) else \
        "the breaker closes (RESIDENT_POOL_BREAKER_COOLDOWN_S after it opened)"
    return (f"{opened}, so it is not started again until {when}; to try sooner, fix the cause, then run "
            f"`resident-pool stop {slug}` or edit its manifest (either closes the breaker)")


def _seconds(value: float) -> str:
    value = max(0.0, float(value))
    return f"{value:.0f} s" if value < 600 else f"{value / 60:.0f} min"


def _one_line(error: ResidentPoolError) -> str:
    original = _original(error)
    if original is not None:  # the original error first: it is what to fix
        return f"{error.slug or original.slug}: {BREAKER_OPEN}: {breaker_words(error)}; the start failure: " \
               + _one_line(original)
    parts = [f"{error.slug or 'resident-pool'}: {error.reason}"]
    first = error.headline
    if first:
        parts.append(first.removeprefix(f"{error.slug}: "))
    if error.exit_code is not None and "exit code" not in first and "killed by" not in first:
        parts.append(describe_exit(error.exit_code))
    if error.transcript and error.transcript not in first:
        parts.append(f"transcript {error.transcript}")
    return "; ".join(parts)


# Enough to stop emphasis, links, images, code, tables, headings and HTML; paths stay readable.
_MARKDOWN_SPECIAL = re.compile(r"([\\`*~\[\]#!|>])")
_LINE_BREAK = re.compile(r"\s*\n\s*")


def escape_markdown(text: str) -> str:
    """Text from a worker (its error can quote the input) shown as text on one line, never as markdown or
    HTML: a line break would end a table row, or start a heading, outside the escaping. Prefect renders
    artifact descriptions and table cells as markdown too (a ``~`` pair strikes text through)."""
    text = _LINE_BREAK.sub(" ", without_controls(text)).replace("&", "&amp;").replace("<", "&lt;")
    return _MARKDOWN_SPECIAL.sub(r"\\\1", text)


def code_span(text: str) -> str:
    """Text from a worker or an input as inline code on one line: markdown and HTML are not read inside a code
    span, and neither are backslash escapes (escape_markdown there would show its backslashes), so the span is
    delimited by a run of backticks longer than any inside it."""
    text = _LINE_BREAK.sub(" ", without_controls(text))
    fence = "`" * (1 + max((len(run) for run in re.findall(r"`+", text)), default=0))
    padded = f" {text} " if text.startswith("`") or text.endswith("`") else text
    return f"{fence}{padded}{fence}"


def _fence(lines: list[str]) -> str:
    """A code fence longer than any run of backticks in ``lines``, so no line can close it."""
    longest = max((len(run) for line in lines for run in re.findall(r"`+", line)), default=0)
    return "`" * max(3, longest + 1)


def _readable_transcript(path: str, where: Paths) -> Path | None:
    """The transcript if it lies inside the log directory; a reply naming any other file is not read."""
    try:
        resolved = Path(path).resolve()
        return resolved if resolved.is_relative_to(where.log_dir().resolve()) else None
    except (OSError, ResidentPoolError):
        return None


def _markdown(error: ResidentPoolError, tail_lines: int, where: Paths) -> str:
    original = _original(error)
    if original is not None:  # refused by an open breaker: what opened it, when it closes, how to reset it
        breaker = error.details.get("breaker") or {}
        closes = breaker.get("closes_in_s")
        lead = (f"## resident-pool: {escape_markdown(error.slug or '?')} not started: its breaker is open\n\n"
                f"{escape_markdown(error.slug or '?')}: {escape_markdown(breaker_words(error) or '')}\n\n"
                "| breaker | |\n|---|---|\n"
                f"| reason | {BREAKER_OPEN} |\n"
                f"| failed starts | {escape_markdown(str(breaker.get('failures', '?')))} |\n"
                f"| closes in | {escape_markdown(_seconds(closes) if isinstance(closes, int | float) else '?')} |\n"
                f"| reset | `resident-pool stop {escape_markdown(error.slug or 'SLUG')}`, or edit its manifest |\n\n"
                "### The start failure that opened it\n\n")
        return lead + _markdown(original, tail_lines, where).split("\n\n", 1)[1]
    rows = [
        ("provider", error.slug or "?"),
        ("reason", error.reason),
        ("exit code", "" if error.exit_code is None else str(error.exit_code)),
        ("exit hint", error.hint or ""),
        ("transcript", error.transcript or ""),
        ("host", socket.gethostname()),
        ("error", type(error).__name__),
    ]
    table = "\n".join(f"| {name} | {escape_markdown(value)} |" for name, value in rows)
    tail = error.transcript_tail[-tail_lines:]
    note = ""
    if not tail and error.transcript:
        readable = _readable_transcript(error.transcript, where)
        if readable is None:
            note = "\n(the transcript named is outside the log directory, so it was not read)\n"
        else:
            tail = read_tail(readable, tail_lines)
    tail = [without_controls(line) for line in tail]
    text = (f"## resident-pool: {escape_markdown(error.slug or '?')} failed\n\n{escape_markdown(error.headline)}\n\n"
            f"| | |\n|---|---|\n{table}\n{note}")
    if tail:
        fence = _fence(tail)
        text += f"\n### Last lines of the transcript\n\n{fence}\n" + "\n".join(tail) + f"\n{fence}\n"
    return text


def _named(error: ResidentPoolError, slug: str) -> ResidentPoolError:
    """``error`` naming the provider it was asked for: a failure of the pool itself (it could not start, another
    version holds it) names none, and its artifact would be filed under no provider."""
    if error.slug:
        return error
    return type(error)(str(error), slug=slug, reason=error.reason, exit_code=error.exit_code, hint=error.hint,
                       transcript=error.transcript, transcript_tail=error.transcript_tail, details=error.details,
                       headline=error.headline)


def _report(error: ResidentPoolError, tail_lines: int, where: Paths) -> ResidentPoolError:
    """Attach the failure artifact (``tail_lines`` of the transcript, read only from ``where``'s log folder) to the
    running task and return the error with a one-line message."""
    if TaskRunContext.get() is not None:
        # _sync: Prefect's blocking call also where a sync helper runs in an async task; there it would otherwise
        # hand back a coroutine nobody awaits, and the artifact would never be made.
        create_markdown_artifact(**_failure_artifact(error, tail_lines, where), _sync=True)
    return _summary(error)


async def _areport(error: ResidentPoolError, tail_lines: int, where: Paths) -> ResidentPoolError:
    """``_report`` for async tasks."""
    if TaskRunContext.get() is not None:
        await acreate_markdown_artifact(**_failure_artifact(error, tail_lines, where))
    return _summary(error)


def _failure_artifact(error: ResidentPoolError, tail_lines: int, where: Paths) -> dict[str, str]:
    return {
        "markdown": _markdown(error, tail_lines, where),
        "key": failure_artifact_key(error.slug or "unknown"),
        # The description is what the task run's Artifacts tab shows without a click.
        "description": escape_markdown(_one_line(error)),  # the UI renders it as markdown too
    }


def _summary(error: ResidentPoolError) -> ResidentPoolError:
    return type(error)(_one_line(error), slug=error.slug, reason=error.reason, exit_code=error.exit_code,
                       hint=error.hint, transcript=error.transcript, transcript_tail=error.transcript_tail,
                       details=error.details)


def _holder() -> dict[str, str]:
    """The flow and task run this lease is for, so `resident-pool status` and waits can name them."""
    holder = {}
    if FlowRunContext.get() is not None:
        holder["flow_run"] = str(runtime.flow_run.name)[:100]
        holder["flow_run_id"] = str(runtime.flow_run.id)
        if runtime.flow_run.ui_url:
            holder["url"] = str(runtime.flow_run.ui_url)[:200]
    if TaskRunContext.get() is not None:
        holder["task_run"] = str(runtime.task_run.name)[:100]
    return holder


# -- events: what a lease saw, related to the flow and task run it ran in ----------------------------
def _emit(name: str, slug: str, *, event_id: str | None = None, occurred: str | None = None, **payload: Any) -> None:
    """Emit ``resident-pool.<name>`` about provider ``slug``; Prefect relates it to the current run.

    ``event_id``, ``occurred``: those of the pool's own record of the same happening (its events stream), so that
    the two reach the Prefect server as one event. An event that cannot be sent is logged, never raised: the
    task's own work comes first.
    """
    try:
        emit_event(event=f"resident-pool.{name}", resource=_provider_resource(slug),
                   related=[_host_resource()], payload={"host": HOST, **payload},
                   id=uuid.UUID(event_id) if event_id else None,
                   occurred=datetime.fromisoformat(occurred) if occurred else None)
    except Exception as exc:  # noqa: BLE001 - events are best effort; EventTooLarge and client errors alike
        log.warning("could not emit resident-pool.%s for %s: %s", name, slug, exc)


def _provider_resource(slug: str) -> dict[str, str]:
    return {"prefect.resource.id": f"resident-pool.provider.{slug}", "prefect.resource.name": slug,
            "resident-pool.provider": slug}


def _host_resource() -> dict[str, str]:
    return {"prefect.resource.id": f"resident-pool.host.{HOST}", "prefect.resource.role": "host",
            "prefect.resource.name": HOST}


def _emit_leased(slug: str, session: Session, wait: dict[str, Any] | None) -> None:
    if wait is not None:
        _emit("admission.waited", slug, needs_gb=wait.get("needs_gb"), waited_s=wait.get("waited_s"),
              holders=wait.get("holders"))
    if session.cold:
        _emit("worker.cold-start", slug, replica=session.replica, pid=session.pid, transcript=session.transcript)


def _emit_failure(error: ResidentPoolError) -> None:
    slug = error.slug or "unknown"
    if isinstance(error, AdmissionTimeout):
        _emit("admission.timeout", slug, needs_gb=error.details.get("needs_gb"),
              waited_s=error.details.get("waited_s"), holders=error.details.get("holders"))
    refused = error.reason == BREAKER_OPEN or bool(error.details.get("breaker"))
    opening = error.details.get("breaker_event")
    if isinstance(opening, dict) and not refused:  # once per opening: the start that opened it
        # The pool wrote this opening to its events stream under this id: sent with it, the relay's copy and this
        # one are one event to the Prefect server, whichever arrives first.
        _emit("breaker.open", slug, event_id=opening.get("id"), occurred=opening.get("occurred"),
              reason=error.reason, exit_code=error.exit_code,
              exit=None if error.exit_code is None else describe_exit(error.exit_code), error=error.headline,
              transcript=error.transcript)
    _emit("request.failed", slug, reason=error.reason, exit_code=error.exit_code,
          exit=None if error.exit_code is None else describe_exit(error.exit_code), error_type=type(error).__name__,
          error=error.headline, transcript=error.transcript, breaker_refused=refused)


@contextmanager
def pool_session(slug: str, manifests: str | os.PathLike[str] | None = None, *,
                 max_attachment_bytes: int | None = None, priority: Priority = "normal") -> Iterator[Session]:
    """Hold one worker of ``slug`` for a batch inside a task; pool failures become artifacts and events.

    ``max_attachment_bytes``: a lower cap on what the session maps from the worker's answers (a campaign's);
    ``priority``: the class it waits in (interactive, normal, batch). The run's log says what the wait was:
    admission (``waiting for GPU admission``), a cold start as it goes and, once the worker answers, its phases.
    """
    client = _client(manifests)
    logger = _run_logger()
    notes = _WaitNotes(slug, client.manifests, logger)
    began = time.monotonic()
    try:
        with notes, client.session(slug, holder=_holder(), max_attachment_bytes=max_attachment_bytes,
                                   priority=priority, on_wait=_log_wait) as session:
            notes.close()
            waited = time.monotonic() - began
            if session.cold and logger is not None:
                logger.info("%s", _cold_start_line(client.manifests, session, waited, session.wait))
            _emit_leased(slug, session, session.wait)
            yield session
    except ResidentPoolError as error:
        named = _named(error, slug)
        _emit_failure(named)
        raise _report(named, client.config.artifact_tail_lines, client.paths) from error


def _run_logger() -> logging.Logger | logging.LoggerAdapter | None:
    try:
        return get_run_logger()
    except MissingContextError:
        return None  # called outside a flow or task run: nothing to log to


class _WaitNotes:
    """While a task waits for its worker, a line in its log every WAITING_EVERY_S: what the pool is doing."""

    def __init__(self, slug: str, manifests: Path, logger: logging.Logger | logging.LoggerAdapter | None) -> None:
        self.slug, self.manifests, self.logger = slug, manifests, logger
        self.began = time.monotonic()
        self.closed = threading.Event()
        self.thread: threading.Thread | None = None

    def __enter__(self) -> _WaitNotes:
        if self.logger is not None:
            self.thread = threading.Thread(target=self._run, name=f"waiting-for-{self.slug}", daemon=True)
            self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.closed.set()

    def _run(self) -> None:
        if self.closed.wait(WAITING_FIRST_S):
            return
        while True:
            line = self.describe()
            if self.closed.is_set():
                return  # leased meanwhile: the lease's own line says the rest
            self.logger.info("%s", line)
            if self.closed.wait(WAITING_EVERY_S):
                return

    def describe(self) -> str:
        waited = f"{time.monotonic() - self.began:.0f} s so far"
        try:
            with Pool(self.manifests, start=False) as probe:  # a connection of its own, closed at once
                status = probe.status()
        except (ResidentPoolError, OSError, ProtocolError) as exc:
            return f"{self.slug}: waiting for a worker, {waited} (the pool's status could not be read: {exc})"
        return _waiting_words(self.slug, status, waited)


def _waiting_words(slug: str, status: dict[str, Any], waited: str) -> str:
    """What a task waiting for ``slug``'s worker is waiting for, from the pool's status."""
    replicas = [w for w in status.get("workers", []) if w.get("slug") == slug]
    starting = [w for w in replicas if w.get("state") == "starting"]
    if starting:
        worker = starting[0]
        how = _start_way(status, slug)
        if worker.get("pid") is None:  # a zygote still importing its preload, or admission not yet passed
            what = f"replica {worker.get('replica')}{how} is starting (no process yet)"
        else:
            what = f"replica {worker.get('replica')} (pid {worker.get('pid')}{how}) is loading"
        return f"{slug}: cold start in progress, {waited}: {what}; transcript {worker.get('transcript')}"
    # Busy as the pool's core says: serving new requests, and not idle (a kept lease between its calls is idle).
    busy = [w for w in replicas if w.get("serving", w.get("state") == "leased") and not w.get("idle", False)]
    if busy:
        return (f"{slug}: waiting for a worker, {waited}: its {len(busy)} replica(s) are busy with other "
                "requests (max_replicas in its manifest says how many may run)")
    return f"{slug}: waiting for a worker, {waited}"


def _start_way(status: dict[str, Any], slug: str) -> str:
    start = (status.get("providers", {}).get(slug) or {}).get("start") or {}
    if start.get("way") == "zygote":
        return ", forked from its zygote"
    return ", spawned" if start.get("way") == "spawn" else ""  # how else: the pool did not say


def _cold_start_line(manifests: Path, session: Session, waited: float, wait: dict[str, Any] | None) -> str:
    """The cold start, once the worker answers: its time, its phases (admission, start), where it runs."""
    try:
        with Pool(manifests, start=False) as probe:
            start = (probe.status().get("providers", {}).get(session.slug) or {}).get("start") or {}
    except (ResidentPoolError, OSError, ProtocolError):
        start = {}  # the phases the pool would add; the line stands without them
    return _cold_start_words(start, session, waited, wait)


def _cold_start_words(start: dict[str, Any], session: Session | AsyncSession, waited: float,
                      wait: dict[str, Any] | None) -> str:
    """``_cold_start_line`` from what the pool's status says of the provider's starts (``start``)."""
    phases = []
    admission = float(wait.get("waited_s") or 0) if wait else 0.0
    if wait:
        phases.append(f"GPU admission {admission:.1f} s")
    phases.append(f"start {max(0.0, waited - admission):.1f} s")
    zygote = start.get("zygote") or {}
    if start.get("way") == "zygote" and zygote:
        modules = zygote.get("modules_s") or {}
        imports = sum(v for v in modules.values() if isinstance(v, int | float)) if isinstance(modules, dict) else 0
        loaded = zygote.get("load_s")
        phases.append("forked from its zygote (which paid its imports"
                      + (f", {imports:.1f} s" if imports else "")
                      + (f", and its load stage, {loaded:.1f} s" if isinstance(loaded, int | float) else "")
                      + ", once, when it started)")
    elif start.get("way") == "spawn":
        phases.append(f"spawned ({start.get('why')})" if start.get("why") else "spawned")
    device = session.lease.get("device")
    return (f"{session.slug}: cold start done in {waited:.1f} s ({'; '.join(phases)}): replica {session.replica}, "
            f"pid {session.pid}, {'GPU ' + str(device) if device not in (None, '') else 'no GPU'}; "
            f"transcript {session.transcript}")


def predict(slug: str, payload: Any, manifests: str | os.PathLike[str] | None = None, *,
            priority: Priority = "normal") -> Any:
    """One prediction through the host pool, from inside a Prefect task."""
    with pool_session(slug, manifests, priority=priority) as session:
        return session.predict(payload)


def predict_batch(slug: str, payloads: list[Any], manifests: str | os.PathLike[str] | None = None, *,
                  priority: Priority = "normal") -> list[Any]:
    """Several predictions on one held worker (one lease, no other caller in between)."""
    with pool_session(slug, manifests, priority=priority) as session:
        return [session.predict(payload) for payload in payloads]


# -- the same helpers for async tasks: no thread while a task waits ----------------------------------------------
_aclients: dict[tuple[Path, Path], AsyncPool] = {}


def _async_client(manifests: str | os.PathLike[str] | None) -> AsyncPool:
    """One asyncio client per process and manifests folder; it keeps connections per event loop. Its ``on_wait``
    runs in the waiting task, so the log line lands in that task's log. The helpers' edge, as ``_client``."""
    config, where = host_settings()
    directory = default_manifests(manifests, config, where)
    key = (directory, where.state_dir())
    with _clients_lock:
        client = _aclients.get(key)
        if client is None:
            client = _aclients[key] = AsyncPool(directory, on_wait=_log_wait)
        return client


@asynccontextmanager
async def apool_session(slug: str, manifests: str | os.PathLike[str] | None = None, *,
                        max_attachment_bytes: int | None = None,
                        priority: Priority = "normal") -> AsyncIterator[AsyncSession]:
    """``pool_session`` for async tasks (``async with apool_session(slug) as worker: await worker.predict(p)``):
    the same log lines while it waits, events, and failure artifacts."""
    client = _async_client(manifests)
    logger = _run_logger()
    began = time.monotonic()
    try:
        async with _AsyncWaitNotes(slug, client.manifests, logger) as notes, client.session(
                slug, holder=_holder(), max_attachment_bytes=max_attachment_bytes, priority=priority) as session:
            notes.close()
            waited = time.monotonic() - began
            if session.cold and logger is not None:
                logger.info("%s", _cold_start_words(await _provider_start(client.manifests, slug), session, waited,
                                                    session.wait))
            _emit_leased(slug, session, session.wait)
            yield session
    except ResidentPoolError as error:
        named = _named(error, slug)
        _emit_failure(named)
        raise await _areport(named, client.config.artifact_tail_lines, client.paths) from error


async def apredict(slug: str, payload: Any, manifests: str | os.PathLike[str] | None = None, *,
                   priority: Priority = "normal") -> Any:
    """``predict`` for async tasks: one prediction through the host pool."""
    async with apool_session(slug, manifests, priority=priority) as session:
        return await session.predict(payload)


async def apredict_batch(slug: str, payloads: list[Any], manifests: str | os.PathLike[str] | None = None, *,
                         priority: Priority = "normal") -> list[Any]:
    """``predict_batch`` for async tasks: several predictions on one held worker."""
    async with apool_session(slug, manifests, priority=priority) as session:
        return [await session.predict(payload) for payload in payloads]


async def _pool_status(manifests: Path) -> dict[str, Any] | Exception:
    """The pool's status, through a connection of its own (closed at once, never starting a pool); or what
    kept it from being read."""
    try:
        async with AsyncPool(manifests, start=False) as probe:
            return await probe.status()
    except (ResidentPoolError, OSError, ProtocolError) as exc:
        return exc


async def _provider_start(manifests: Path, slug: str) -> dict[str, Any]:
    status = await _pool_status(manifests)
    if isinstance(status, Exception):
        return {}  # the phases the pool would add; the line stands without them
    return (status.get("providers", {}).get(slug) or {}).get("start") or {}


class _AsyncWaitNotes:
    """_WaitNotes for a coroutine: the same lines, from a task on its loop instead of a thread."""

    def __init__(self, slug: str, manifests: Path, logger: logging.Logger | logging.LoggerAdapter | None) -> None:
        self.slug, self.manifests, self.logger = slug, manifests, logger
        self.began = time.monotonic()
        self.task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> _AsyncWaitNotes:
        if self.logger is not None:
            self.task = asyncio.create_task(self._run(), name=f"waiting-for-{self.slug}")
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()
        if self.task is not None:
            await asyncio.wait([self.task])  # cancelled: it ends at once, and is not left pending on the loop

    def close(self) -> None:
        if self.task is not None:
            self.task.cancel()

    async def _run(self) -> None:
        await asyncio.sleep(WAITING_FIRST_S)
        while True:
            waited = f"{time.monotonic() - self.began:.0f} s so far"
            status = await _pool_status(self.manifests)
            self.logger.info("%s", _waiting_words(self.slug, status, waited) if isinstance(status, dict) else
                             f"{self.slug}: waiting for a worker, {waited} (the pool's status could not be read: "
                             f"{status})")
            await asyncio.sleep(WAITING_EVERY_S)


@task(name="resident-pool-warm")
def warm_provider(slug: str, replicas: int = 1, manifests: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """Start ``slug``'s workers at the start of a flow, so its first chunk does not pay the start.

    ``warm_provider.submit(slug)`` lets the flow read its inputs meanwhile; pass the future to the
    chunk tasks (``wait_for=[...]``) so they find the workers warm.
    """
    client = _client(manifests)
    try:
        result = client.warm(slug, replicas, on_wait=_log_wait)
    except ResidentPoolError as error:
        named = _named(error, slug)
        _emit_failure(named)
        raise _report(named, client.config.artifact_tail_lines, client.paths) from error
    get_run_logger().info("%s: %d of %d worker(s) warm (%d started now)", slug,
                          result["already_warm"] + result["started"], replicas, result["started"])
    return result


# -- the relay: the pool's own lifecycle events, forwarded to Prefect --------------------------------
def relay_events(log_dir: Path, *, from_start: bool = False, follow: bool = True, poll_s: float = 0.5,
                 stop: threading.Event | None = None, say: Callable[[str], None] = print) -> int:
    """Forward the pool's event stream (in ``log_dir``) to the Prefect API until stopped (SIGTERM, SIGINT); returns
    how many.

    Its place is kept in a cursor beside the stream, so a restarted relay resumes without
    repeating or skipping (Prefect also drops an event id it already has).
    """
    if not PREFECT_API_URL.value():
        raise ResidentPoolError("resident-pool events --to-prefect: PREFECT_API_URL is not set; point it at the "
                                "Prefect server the flow runs report to (as the worker's unit does)",
                                reason="bad_setting")
    stop = stop or threading.Event()
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda *_: stop.set())
    return asyncio.run(_relay(log_dir, from_start, follow, poll_s, stop, say))


async def _relay(log_dir: Path, from_start: bool, follow: bool, poll_s: float, stop: threading.Event,
                 say: Callable[[str], None]) -> int:
    stream = log_dir / EVENTS_FILE
    follower = Follower(stream, cursor=log_dir / "events.relay-cursor", from_start=from_start)
    say(f"relaying {stream} (from byte {follower.offset}) to Prefect at {PREFECT_API_URL.value()}")
    sent = 0
    try:
        async with get_events_client(checkpoint_every=1) as client:
            while True:
                records = follower.poll()
                for record in records:
                    try:
                        event = _prefect_event(record)
                    except (KeyError, TypeError, ValueError) as exc:
                        say(f"skipping an event line that is not the pool's ({exc}): {str(record)[:200]}")
                        continue
                    await client.emit(event)
                    sent += 1
                if records:
                    follower.commit()
                    say(f"relayed {len(records)} event(s), {sent} in all")
                if not follow or stop.is_set():
                    return sent
                await asyncio.sleep(poll_s)
    finally:
        follower.close()


def _prefect_event(record: dict[str, Any]) -> Event:
    """One line of the pool's stream as a Prefect event: the worker (or the pool) as its resource."""
    slug, replica, host = record.get("slug"), record.get("replica"), str(record.get("host") or HOST)
    if slug is not None and replica is None:  # about the provider itself (its breaker), as a task names it
        resource = _provider_resource(str(slug))
        related = []
    elif slug is not None:
        resource = {"prefect.resource.id": f"resident-pool.worker.{host}.{slug}.{replica}",
                    "prefect.resource.name": f"{slug}[{replica}] on {host}", "resident-pool.provider": str(slug),
                    "resident-pool.replica": str(replica)}
        related = [{**_provider_resource(str(slug)), "prefect.resource.role": "provider"}]
    else:
        resource = {"prefect.resource.id": f"resident-pool.pool.{host}", "prefect.resource.name": f"pool on {host}"}
        related = []
    related.append({"prefect.resource.id": f"resident-pool.host.{host}", "prefect.resource.role": "host",
                    "prefect.resource.name": host})
    payload = {**(record.get("payload") or {}), "host": host, "pool_pid": record.get("pool_pid")}
    return Event(event=record["event"], occurred=datetime.fromisoformat(record["occurred"]),
                 id=uuid.UUID(record["id"]), resource=resource, related=related, payload=payload)


# worker_stopping and worker_unreachable did not run; connection_broken may have, as worker_died may have.
_RETRYABLE_REASONS = frozenset({"worker_died", "worker_stopped", "worker_exiting", "request_timeout",
                                "worker_stopping", "worker_unreachable", "connection_broken"})


def retry_pool_failures(task, task_run, state) -> bool | Awaitable[bool]:
    """``retry_condition_fn`` for tasks that use the pool.

    Retries a worker that died or timed out; never a refusal (exit 3 or 5), an
    open breaker, a bad manifest, pinned weights that do not match, a missing
    kit or a budget that can never fit. Errors not from the pool keep Prefect's
    usual behaviour (retry). For an async task Prefect reads the state's result
    asynchronously, so there this returns an awaitable, which Prefect awaits.
    """
    try:
        error = state.result(raise_on_failure=False)
    except Exception:  # noqa: BLE001 - a result that cannot be read: let the retry policy decide
        return True
    if inspect.isawaitable(error):
        return _retries_once_read(error)
    return _retries(error)


async def _retries_once_read(pending: Awaitable[Any]) -> bool:
    try:
        error = await pending
    except Exception:  # noqa: BLE001 - a result that cannot be read: let the retry policy decide
        return True
    return _retries(error)


def _retries(error: Any) -> bool:
    if not isinstance(error, BaseException):
        return True
    if isinstance(error, ResidentPoolError):
        if error.reason == BREAKER_OPEN or error.exit_code in REFUSAL_CODES or error.details.get("breaker"):
            return False
        if isinstance(error, ManifestError | WeightsMismatch | KitUnavailable | AdmissionRefused):
            return False
        if isinstance(error, WorkerRequestError):
            # request_failed is the model refusing this input: a retry fails the same way.
            return error.reason in _RETRYABLE_REASONS
        return isinstance(error, WorkerStartError)
    return True
