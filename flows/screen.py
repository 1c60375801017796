"""The screening campaign: every input through a resident provider, in chunks of Prefect task runs.

    python flows/screen.py [--input FILE_OR_INBOX] [--provider minilm] [--chunk-size 64]
                           [--output PATH] [--format jsonl|parquet] [--column NAME] [--id-column NAME]
                           [--fail-on-input-errors] [--no-report]

Inputs are read lazily; each input's result is stored under sha256(provider
version, options, text) in the user's result store, so a re-run, a reordered
file, a file with sequences appended, or a duplicate sequence computes only
what no earlier run computed. Results are appended to ``<output>.partial`` as
chunks finish; the output itself (one record per input, in input order) is
written at the end, with a small HTML report beside it (``<output>.report.html``:
progress, throughput and failures over time, a map of the answers' vectors).
Given a folder (an inbox), every input file in it is screened, one output per file.

The providers are those of the worker host's own configuration
(``RESIDENT_POOL_MANIFESTS``), never a flow parameter: whoever may start a run
must not choose what code the pool runs.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import socket
import stat
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, Literal

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_progress_artifact, update_progress_artifact
from prefect.cache_policies import NO_CACHE
from prefect.context import FlowRunContext
from prefect.settings import PREFECT_UI_URL
from prefect.states import Completed, Failed
from prefect.task_runners import ThreadPoolTaskRunner
from prefect.tasks import exponential_backoff

from resident_pool.campaigns.answers import per_input
from resident_pool.campaigns.campaign import (
    BLOCK,
    NO_ROOM,
    Campaign,
    CampaignSettings,
    Chunk,
    TaskSizer,
    output_name,
    summarize,
)
from resident_pool.campaigns.inputs import FORMATS, InputFile, Record, Region
from resident_pool.campaigns.progress import FileProgress, Progress
from resident_pool.campaigns.report import VectorSample, report_path, write_report
from resident_pool.campaigns.results import UNWRITABLE, ResultStore, provider_version
from resident_pool.client import default_manifests
from resident_pool.errors import CampaignFailed, InputError, ResidentPoolError, WorkerRequestError
from resident_pool.prefect import (
    COMPLETED_WITH_FAILURES,
    Priority,
    artifact_key,
    escape_markdown,
    host_settings,
    pool_session,
    queue_summary,
    retry_pool_failures,
)
from resident_pool.prefect.roots import check_path
from resident_pool.providers.input_rules import Inputs, kind_option
from resident_pool.providers.manifest import DISTINCT_COSINE, Manifest, load_manifest, manifest_path
from resident_pool.settings import Settings

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_INPUT = str(ROOT / "data" / "uniprot-500.fasta")
PROGRESS_EVERY_S = 2.0  # a progress update is an API call: a million-input campaign must not make thousands
LOG_EVERY_S = 5.0  # a line in the run's log: done, rate, ETA
# Failure reasons that say the provider's worker could not be had at all (not an input's fault): a run whose
# inputs all failed with one of these screened nothing, and ends Failed however it was asked to treat inputs.
NOT_STARTED = frozenset({"start_failed", "breaker_open", "admission_refused", "admission_timeout", "kit_unavailable",
                         "weights_mismatch", "bad_manifest", "interpreter_missing"})
# How each vector comes back (minilm's "encoding"; other providers ignore it): the key of every stored result.
Encoding = Literal["float32-base64", "array", "json"]


class Texts:
    """A chunk's texts, opaque to Prefect's walk of a task's parameters (it walks lists, tuples, dicts and models;
    16 ms per thousand texts, twice per run). Not Prefect's ``quote``: a NamedTuple, which a task runner that
    hands parameters through a graph of its own (Dask's) unpacks into a one-item tuple."""

    __slots__ = ("items",)

    def __init__(self, items: list[str]) -> None:
        self.items = items


@task(
    name="predict-chunk",
    task_run_name="predict-chunk[{label}]",
    retries=3,
    # 1, 2, 4 s (each +-50%): a worker that died of OOM gets time to be replaced, and retries do not align.
    retry_delay_seconds=exponential_backoff(backoff_factor=1),
    retry_jitter_factor=0.5,
    retry_condition_fn=retry_pool_failures,
    # The result store keeps every answer; Prefect's own copy under ~/.prefect/storage would only grow.
    persist_result=False,
    cache_policy=NO_CACHE,
)
def predict_chunk(provider: str, manifests: str, texts: list[str] | Texts, options: dict[str, Any], label: str,
                  max_attachment_bytes: int | None = None, chunk_size: int | None = None,
                  priority: str = "batch") -> dict[str, Any]:
    """One chunk on one held worker, in requests of ``chunk_size`` inputs; an input the model refuses fails alone.
    ``label`` names its inputs."""
    if isinstance(texts, Texts):
        texts = texts.items
    started = time.monotonic()
    size = chunk_size or max(len(texts), 1)
    results: list[dict[str, Any] | None] = []
    failed: dict[int, tuple[str, str]] = {}
    compute_s = 0.0  # the model's time, as the requests took it: what sizes the next chunks (TaskSizer)
    with _Held(lambda: pool_session(provider, manifests, max_attachment_bytes=max_attachment_bytes,
                                    priority=priority)) as held:
        session = held.session()
        cold, pid = session.cold, session.pid
        version = session.lease.get("version")
        for at in range(0, len(texts), size):
            sent = time.monotonic()
            results += _request(held, options, texts[at:at + size], at, failed)
            compute_s += time.monotonic() - sent
    for position, result in enumerate(results):
        if result is None and position not in failed:
            failed[position] = ("bad_answer", f"{provider} answered no item for this input")
    return {"results": results, "failed": failed, "cold": cold, "pid": pid, "version": version,
            "latency_s": time.monotonic() - started, "compute_s": compute_s}


class _Held:
    """A chunk's hold on its provider's worker, held again after a request that outran ``request_timeout_s`` (the
    pool replaces that worker and ends the session's lease): the chunk's other inputs go on without a retry."""

    def __init__(self, open_session: Callable[[], Any]) -> None:
        self.open_session = open_session
        self.stack = ExitStack()
        self.current: Any = None

    def __enter__(self) -> _Held:
        return self

    def __exit__(self, *exc: Any) -> bool:
        return self.stack.__exit__(*exc)  # an error the chunk raises goes through pool_session: its artifact

    def session(self) -> Any:
        if self.current is None:
            self.current = self.stack.enter_context(self.open_session())
        return self.current

    def predict(self, payload: dict[str, Any]) -> Any:
        try:
            return self.session().predict(payload)
        except WorkerRequestError as error:
            if error.reason == "request_timeout":
                self.current = None
                self.stack.close()
            raise


# A request that fails with one of these is split: the chunk's inputs go again one by one, so only the input the
# model refuses, or the one that outruns the timeout, fails (a single input that timed out is not sent again: it
# would only time out again, and cost another worker).
ISOLATED = frozenset({"request_failed", "request_timeout"})
# After this many inputs in a row outran the timeout alone, the rest of their chunk is not sent: a model that hangs
# on every input would otherwise cost a whole request_timeout_s and a worker per input (64 x 600 s for one chunk).
TIMEOUTS_IN_A_ROW = 2


def _request(session: Any, options: dict[str, Any], texts: list[str], offset: int,
             failed: dict[int, tuple[str, str]]) -> list[dict[str, Any] | None]:
    """One request's items; when the model refuses the request or it times out, each input alone, to find the one
    it refuses or that outruns the timeout. One by one, not halves: each timeout costs a whole request_timeout_s
    and a worker, and halving would pay one per level."""
    try:
        return per_input(session.predict({**options, "inputs": texts}), len(texts))
    except WorkerRequestError as error:
        if error.reason not in ISOLATED:
            raise
        if len(texts) == 1:
            failed[offset] = (error.reason, str(error))
            return [None]
    results: list[dict[str, Any] | None] = []
    in_a_row = 0  # inputs just before this one that each outran the timeout alone
    for position, text in enumerate(texts):
        at = offset + position
        if in_a_row >= TIMEOUTS_IN_A_ROW:
            failed[at] = ("request_timeout", f"not sent: the {in_a_row} inputs before it in its chunk each outran the "
                          "provider's request_timeout_s alone, so its model is taken to hang on every input (see "
                          "the transcript); it is tried again when the screen runs again")
            results.append(None)
            continue
        results += _request(session, options, [text], at, failed)
        in_a_row = in_a_row + 1 if at in failed and failed[at][0] == "request_timeout" else 0
    return results


# -- running chunks ------------------------------------------------------------------
Submit = Callable[..., Any]


CLUSTER_WINDOW = 32  # chunks in flight under Dask or Ray when max_workers does not say how many threads it has


@contextmanager
def _chunk_runner(max_workers: int | None, replicas: int) -> Iterator[tuple[Submit, int]]:
    """How to submit a chunk, and how many may be in flight.

    On this host: a thread pool of ``max_workers`` (default the provider's
    replicas + 1: one computing per replica, one more holding its place in
    line, so the UI shows as many runs Running as can really run), with twice
    that many chunks in flight. Under the flow's own Dask or Ray task runner,
    the cluster spreads them: as many in flight as ``max_workers`` x 2, or 32.
    """
    context = FlowRunContext.get()
    runner = context.task_runner if context is not None else None
    if runner is not None and not isinstance(runner, ThreadPoolTaskRunner):
        yield runner.submit, 2 * max_workers if max_workers else CLUSTER_WINDOW
        return
    threads = max_workers or replicas + 1
    with ThreadPoolTaskRunner(max_workers=threads) as own:
        yield own.submit, 2 * threads


class _Progress:
    """The campaign's progress as Prefect shows it: the progress artifact (its description says what the pool's
    requests wait for: the line in order, with their classes), and a line in the run's log."""

    def __init__(self, provider: str, description: str, manifests: str | None = None) -> None:
        self.description, self.manifests = description, manifests
        self.tally = Progress()
        self.id = create_progress_artifact(0.0, key=artifact_key("screen-progress", provider), description=description)
        self.logger = get_run_logger()
        self.last = self.last_line = time.monotonic()

    def update(self, entry: FileProgress, *, seen: int, done: int, failed: int, fraction_read: float) -> None:
        self.tally.update(entry, seen=seen, done=done, failed=failed, fraction_read=fraction_read)
        self.show()

    def show(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self.last >= PROGRESS_EVERY_S:
            waiting = queue_summary(self.manifests)
            description = self.description + (f"\n\nwaiting in the pool, in order:\n\n{waiting}" if waiting else "")
            update_progress_artifact(self.id, self.tally.percent(), description=description)
            self.last = now
        if force or now - self.last_line >= LOG_EVERY_S:
            self.logger.info("%s", self.tally.line())
            self.last_line = now


class _FileRun:
    """One input file through the provider: a bounded window of chunk futures, settled as they finish."""

    # Inputs in flight at once, whatever the window of chunks: with chunks grown to TaskSizer.MAX_INPUTS,
    # two computing (max_replicas 2) and one waiting for a replica. Each costs the flow about 600 bytes.
    MAX_IN_FLIGHT = 3 * TaskSizer.MAX_INPUTS

    def __init__(self, source: InputFile, campaign: Campaign, entry: FileProgress, *, provider: str, manifests: str,
                 options: dict[str, Any], submit: Submit, window: int, progress: _Progress,
                 limits: CampaignSettings, priority: str = "batch") -> None:
        self.source, self.campaign, self.entry, self.priority = source, campaign, entry, priority
        self.provider, self.manifests, self.options = provider, manifests, options
        self.max_attachment_bytes = limits.max_attachment_bytes
        self.submit, self.window, self.progress = submit, window, progress
        self.done: queue.SimpleQueue = queue.SimpleQueue()
        self.in_flight: dict[Any, Chunk] = {}
        self.inputs_in_flight = 0
        self.settled = 0
        self.unwritable: ResidentPoolError | None = None  # the store or the output stopped taking writes

    def run(self) -> None:
        try:
            block = []
            for record in self.source.records(regions=True):
                if isinstance(record, Region):  # a FASTA stretch, looked up whole (after the records before it)
                    chunks = [*self.campaign.add(block), *self.campaign.add_region(record)]
                    block = []
                else:
                    block.append(record)
                    if len(block) < BLOCK:
                        continue
                    chunks, block = self.campaign.add(block), []
                for chunk in chunks:
                    self.launch(chunk)
                self.report()
                while self.settle(block=False):
                    pass
                self.hold_back()
            for chunk in [*self.campaign.add(block), *self.campaign.flush()]:
                self.launch(chunk)
            self.report()
        finally:
            while self.in_flight:  # what was computed is stored, even when reading the file failed
                try:
                    self.settle(block=True)
                except ResidentPoolError as error:
                    if error.reason not in UNWRITABLE:
                        raise
            if self.unwritable is not None:
                raise self.unwritable

    def hold_back(self) -> None:
        """Read no further while too many inputs wait to be written behind the first one still waiting."""
        while self.campaign.backlog > self.campaign.BACKLOG:
            if self.in_flight:
                self.settle(block=True)
                continue
            chunks = self.campaign.flush()  # what waits, waits on inputs not yet sent
            if not chunks:
                return
            for chunk in chunks:
                self.launch(chunk)

    def launch(self, chunk: Chunk) -> None:
        while self.in_flight and (len(self.in_flight) >= self.window
                                  or self.inputs_in_flight + len(chunk) > self.MAX_IN_FLIGHT):
            self.settle(block=True)
        # Texts: Prefect walks every element of a task's parameters, twice per run (16 ms per thousand texts,
        # measured); texts hold no futures to find.
        future = self.submit(predict_chunk, {"provider": self.provider, "manifests": self.manifests,
                                             "texts": Texts(chunk.texts), "options": self.options, "label": chunk.label,
                                             "max_attachment_bytes": self.max_attachment_bytes,
                                             "chunk_size": self.campaign.chunk_size, "priority": self.priority})
        self.in_flight[future] = chunk
        self.inputs_in_flight += len(chunk)
        future.add_done_callback(self.done.put)

    def settle(self, block: bool) -> bool:
        """Take one finished chunk's outcome into the campaign; False when none has finished."""
        try:
            future = self.done.get(block=block)
        except queue.Empty:
            return False
        chunk, campaign = self.in_flight.pop(future), self.campaign
        self.inputs_in_flight -= len(chunk)
        try:
            self._take(future, chunk, campaign)
        except ResidentPoolError as error:
            if error.reason not in UNWRITABLE:
                raise
            if self.unwritable is None:
                self.unwritable = error
                raise
            return True  # kept in the store where it has room (a full output's disk), else computed next run
        self.settled += len(chunk)
        self.report()
        return True

    def _take(self, future: Any, chunk: Chunk, campaign: Campaign) -> None:
        """A finished chunk's outcome into the campaign: its results, or its failure for each of its inputs."""
        try:
            answer = future.result()
        except ResidentPoolError as error:
            campaign.fail(chunk, error.reason, str(error))
        except Exception as error:  # noqa: BLE001 - any other failure is still recorded per input, never lost
            campaign.fail(chunk, type(error).__name__, str(error))
        else:
            served = answer.pop("version", None)
            if served is not None and served != campaign.version:
                campaign.fail(chunk, "version_changed", f"{self.provider} changed version during the campaign "
                                                        f"({campaign.version} planned, {served} served); run again")
            else:
                campaign.finish(chunk, answer.pop("results"), answer.pop("failed"), answer)

    def counts(self) -> dict[str, int]:
        """Inputs read, inputs with their outcome (from the store, repeats, bad ones, chunks settled), failed."""
        counts = self.campaign.counts
        seen = counts["inputs"]
        done = seen - counts["computed"] - len(self.campaign.pending) + self.settled
        return {"seen": seen, "done": done, "failed": counts["bad_input"] + self.campaign.failed_computing}

    def report(self) -> None:
        self.progress.update(self.entry, **self.counts(), fraction_read=self.source.fraction_read())


def input_rule(source: InputFile, inputs: Inputs, kind: str) -> Callable[[Record], tuple[str, str | None]]:
    """The provider's input rule for one file's records: each text as sent, or why it is refused, naming the
    file, line and id."""
    check = inputs.check

    def rule(record: Record) -> tuple[str, str | None]:
        text, problem = check(record.text, kind)
        return text, None if problem is None else f"{source.path}:{record.line}: {record.id}: {problem}"

    return rule


def _screen_file(source: InputFile, output: Path, entry: FileProgress, *, store: ResultStore, version: str,
                 chunk_size: int, fmt: str, report: bool, title: str,
                 rule: Callable[[Record], tuple[str, str | None]] | None = None,
                 coincide_cosine: float = DISTINCT_COSINE, **run: Any) -> dict[str, Any]:
    """One input file through the provider; returns its line of the summary."""
    started = time.monotonic()
    progress: _Progress = run["progress"]
    progress.tally.begin(entry)
    sample = VectorSample(coincide_cosine=coincide_cosine) if report else None
    campaign = Campaign(store, version, run["options"], chunk_size, output,
                        max_result_bytes=run["limits"].max_result_bytes, fmt=fmt, sample=sample, rule=rule)
    file_run = _FileRun(source, campaign, entry, **run)
    try:
        file_run.run()
        written = campaign.write(fmt)
    except BaseException as error:  # the file ends short: its progress says what was done, never 100%
        counts = file_run.counts()
        why = error.reason if isinstance(error, ResidentPoolError) else type(error).__name__
        progress.tally.stop(entry, why, seen=counts["seen"], done=counts["done"], failed=counts["failed"])
        raise
    else:
        counts = file_run.counts()
        progress.tally.finish(entry, seen=counts["seen"], done=counts["seen"], failed=counts["failed"])
    finally:
        campaign.close()
        progress.show(force=True)
    summary = summarize(campaign.counts, written, campaign.chunk_stats, time.monotonic() - started)
    line = {"file": str(source.path), "output": str(output), **summary, "report": None}
    if report:
        shown = {"input": str(source.path), "output": str(output), "host": socket.gethostname(),
                 **{k: summary[k] for k in ("inputs", "ok", "failed", "computed", "from_store", "duplicates",
                                            "chunks", "cold_starts", "throughput_inputs_per_s", "wall_s")},
                 "failure reasons": _reasons(summary["failure_reasons"])}
        try:
            line["report"] = str(write_report(report_path(output), title=f"{title}: {source.path.name}",
                                              summary=shown, timeline=entry.timeline.points, sample=sample,
                                              failures=summary["failures"]))
        except OSError as exc:
            if exc.errno not in NO_ROOM:
                raise
            raise ResidentPoolError(f"{report_path(output)}: {(exc.strerror or str(exc)).lower()} while writing the "
                                    f"report (the output {output} is complete); free space on its disk and run the "
                                    "campaign again: it is written again from the store in seconds",
                                    reason="disk_full", details={"path": str(report_path(output))}) from None
    return line


def _reasons(reasons: dict[str, int]) -> str:
    """``bad_input: 3, request_failed: 1``, most first; "none" when nothing failed."""
    ordered = sorted(reasons.items(), key=lambda item: (-item[1], item[0]))
    return ", ".join(f"{reason}: {count:,}" for reason, count in ordered) or "none"


# -- the flow ---------------------------------------------------------------------------
def _input_files(input: str, output: str | None, provider: str, fmt: str, column: str | None,
                 id_column: str | None, limits: CampaignSettings) -> tuple[list[tuple[InputFile, Path]], list[str]]:
    """The files to screen with their outputs, and the files refused (one sentence each)."""
    path = Path(input).expanduser()
    if path.is_dir():
        outbox = Path(output).expanduser() if output else path / "screened"
        if outbox.resolve() == path.resolve():
            raise InputError(f"{outbox}: the outputs cannot go into the inbox itself (the next run would screen "
                             "them); give another --output folder")
        # Every entry named as an input, links and special files included: opening refuses those by name
        # (an inbox others write into may hold a planted link), and the summary lists them.
        candidates = sorted(p for p in path.iterdir() if not p.name.startswith(".") and _is_input_name(p)
                            and not _is_folder(p))
        targets = [(p, outbox / output_name(p, provider, fmt)) for p in candidates]
    else:
        # Beside its input, as an inbox's go to <inbox>/screened: two inputs of one name never share an output,
        # and where the run was started from does not matter.
        default = path.parent / output_name(path, provider, fmt)
        targets = [(path, Path(output).expanduser() if output else default)]
    files, refused = [], []
    for candidate, target in targets:
        if not candidate.name.isprintable():
            refused.append(f"{candidate.parent}/{candidate.name!r}: a file name with control characters; rename it")
            continue
        if target.resolve() == candidate.resolve():
            raise InputError(f"{target}: the output would replace its own input; give another --output")
        try:
            source = InputFile(candidate, column=column, id_column=id_column, max_record_bytes=limits.max_record_bytes,
                               max_input_bytes=limits.max_input_bytes, max_input_records=limits.max_input_records)
            source.check()
        except InputError as error:
            refused.append(str(error))
            continue
        files.append((source, target))
    return files, refused


def _is_folder(path: Path) -> bool:
    """A folder itself (not a link to one), or an entry gone since it was listed: neither is an input."""
    try:
        return stat.S_ISDIR(path.lstat().st_mode)
    except FileNotFoundError:
        return True


def _is_input_name(path: Path) -> bool:
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] == ".gz":
        suffixes.pop()
    return bool(suffixes) and suffixes[-1] in FORMATS


def _check_roots(input: str, output: str | None, config: Settings) -> str:
    """The paths this run was given, within the folders the worker host allows (resident_pool.prefect.roots);
    returns the input with its folders' links resolved, as checked, so that a link swapped in on the way after
    the check is not followed. An input file that is itself a link stays one, and is refused when opened."""
    path = Path(input).expanduser()
    pinned = path.resolve() if path.is_dir() else path.parent.resolve() / path.name
    check_path(pinned, "input", config)
    check_path(output or (pinned / "screened" if pinned.is_dir() else pinned.parent), "output", config)
    return str(pinned)


def _load_provider(manifests: str, provider: str) -> Manifest:
    return load_manifest(manifest_path(manifests, provider))


@flow(name="screen", task_runner=ThreadPoolTaskRunner(), log_prints=True)
def screen(
    input: str = DEFAULT_INPUT,
    provider: str = "minilm",
    chunk_size: int = 64,
    output: str | None = None,
    format: Literal["jsonl", "parquet"] = "jsonl",
    column: str | None = None,
    id_column: str | None = None,
    fail_on_input_errors: bool = False,
    max_workers: int | None = None,
    encoding: Encoding = "float32-base64",
    report: bool = True,
    priority: Priority = "batch",
    kind: Literal["protein", "text"] | None = None,
):
    """Screen every input of a FASTA, CSV, TSV or JSONL file (or of every such file in a folder).

    Args:
        input: An input file on the worker's host (FASTA, CSV, TSV or JSONL, optionally .gz), or a folder of
            them (an inbox: every input file in it, one output each). A deployment's run reads only under the
            worker's RESIDENT_POOL_INPUT_ROOT (`make stack-up`: .stack/inbox, where it copies the demo file): copy
            a file there first, then give its path.
        provider: The provider that answers each input.
        chunk_size: Inputs per task run (one request to the model).
        output: The output file; default `<input>.<provider>.<format>` beside the input. For a folder: the output
            folder, default `<folder>/screened`.
        format: The output's format: JSON Lines (one record per input) or Parquet (embeddings as float32 lists).
        column: The CSV, TSV or JSONL field holding each input's text (default: sequence, text, input or seq).
        id_column: The field holding each input's id (default: id, name, accession or entry).
        fail_on_input_errors: End Failed when any input failed (by default the run completes and warns).
        max_workers: Chunk tasks at once (default: the provider's max_replicas + 1).
        encoding: How each vector comes back from minilm: float32-base64 (compact), array (an attachment)
            or json (numbers as text). Part of every stored result's key; other providers ignore it.
        report: Write an HTML report beside each output: progress, throughput and failures over time, and a
            map of the answers' vectors.
        priority: The class its chunks wait in for a worker; a campaign is batch, so a person's ad hoc run
            (interactive) goes first, and ageing keeps the campaign from starving.
        kind: How each input is read, where the provider takes it: protein (residue letters, by the provider's
            [inputs] rule) or text. Default: as the file says (FASTA and a sequence column hold proteins, a text
            column text), else the provider's first kind. An input the rule refuses fails alone, named.
    """
    started = time.monotonic()
    logger = get_run_logger()
    output, column, id_column = output or None, column or None, id_column or None  # a form's empty field: unset
    if output is not None:  # relative to where the run runs (`make run` gives out/...): named whole from here on
        output = os.path.abspath(os.path.expanduser(output))
    config, where = host_settings()
    manifests_dir = str(default_manifests(None, config, where))  # the worker host's configuration, never a parameter
    try:  # everything that can be wrong before any work: one sentence on the run, no traceback
        input = _check_roots(input, output, config)
        settings = CampaignSettings.of(config, where)
        if chunk_size < 1 or (max_workers is not None and max_workers < 1):
            raise InputError(f"chunk_size ({chunk_size}) and max_workers ({max_workers}) must be at least 1")
        manifest = _load_provider(manifests_dir, provider)
        files, refused = _input_files(input, output, provider, format, column, id_column, settings)
        if len(refused) == 1 and not files and not Path(input).is_dir():
            raise InputError(refused[0])
        store = ResultStore.for_provider(provider, settings.results_dir)
    except ResidentPoolError as error:
        logger.error("%s", error)
        return Failed(message=str(error))
    options = {"encoding": encoding} if encoding and encoding != "json" else {}
    kind = kind or None  # a form's empty field: unset
    version = provider_version(manifest)
    summaries = []
    progress = _Progress(provider, f"{provider}: {input}", manifests_dir)
    entries = [progress.tally.add_file(str(source.path), source.record_count(), source.size())
               for source, _ in files]
    with store, _chunk_runner(max_workers, manifest.lifecycle.max_replicas) as (submit, window):
        for (source, target), entry in zip(files, entries, strict=True):
            try:
                read_as = manifest.inputs.kind_for(kind or source.kind)
                summaries.append(_screen_file(source, target, entry, provider=provider, manifests=manifests_dir,
                                              version=version, store=store,
                                              options={**options, **kind_option(manifest.inputs, read_as)},
                                              chunk_size=chunk_size, fmt=format, submit=submit, window=window,
                                              progress=progress, limits=settings, report=report,
                                              title=f"{provider} screening", priority=priority,
                                              coincide_cosine=manifest.answers.distinct_cosine,
                                              rule=input_rule(source, manifest.inputs, read_as)))
            except InputError as error:
                refused.append(str(error))
            except ResidentPoolError as error:
                if error.reason not in UNWRITABLE:
                    raise
                # The store's or the output's disk is full: every later file would stop the same way.
                logger.error("%s", error)
                return Failed(message=str(error))
    if not files:
        progress.show(force=True)  # nothing to screen is done at once; a file's end says so for it
    for problem in refused:
        logger.error("%s", problem)
    return _final_state(summaries, refused, provider=provider, input=input, version=version, chunk_size=chunk_size,
                        wall_s=time.monotonic() - started, fail_on_input_errors=fail_on_input_errors)


def _final_state(summaries: list[dict[str, Any]], refused: list[str], *, provider: str, input: str, version: str,
                 chunk_size: int, wall_s: float, fail_on_input_errors: bool):
    ok = sum(s["ok"] for s in summaries)
    failed = sum(s["failed"] for s in summaries)
    computed = sum(s["computed"] for s in summaries)
    inputs = sum(s["inputs"] for s in summaries)
    total = {"provider": provider, "version": version, "chunk_size": chunk_size, "inputs": inputs, "ok": ok,
             "failed": failed, "missing": sum(s["missing"] for s in summaries), "computed": computed,
             "from_store": sum(s["from_store"] for s in summaries),
             "duplicates": sum(s["duplicates"] for s in summaries),
             "chunks": sum(s["chunks"] for s in summaries),
             "cold_starts": sum(s["cold_starts"] for s in summaries),
             "throughput_inputs_per_s": round(inputs / wall_s, 1) if wall_s > 0 else None,
             "wall_s": round(wall_s, 2), "host": socket.gethostname(), "files": summaries, "refused": refused}
    if len(summaries) == 1:
        one = summaries[0]
        total.update({k: one[k] for k in ("output", "report", "failure_reasons", "warm_median_chunk_latency_ms",
                                          "workers")})
    failed_at = _artifacts(total, input)
    logger = get_run_logger()
    message = f"{ok} ok, {failed} failed"
    details = f"{inputs} inputs in {len(summaries)} file(s): {computed} computed, {total['from_store']} from the " \
              f"store, {total['duplicates']} duplicates; {total['throughput_inputs_per_s']} inputs/s"
    print(f"screened with {provider}: {message}; {details}"
          + "".join(f"; output {s['output']}" for s in summaries))
    if not summaries and not refused:
        # Said loudly: a scheduled screen of an inbox nobody filled should not look like a night's work.
        logger.warning("%s: no input files to screen (names ending %s, optionally .gz); nothing was done", input,
                       ", ".join(sorted(FORMATS)))
        return Completed(message=f"no input files in {input}", data=total)
    if summaries and not inputs:
        logger.warning("%s: the input file(s) hold no inputs; nothing was computed", input)
    if failed:
        reasons: dict[str, int] = {}
        for summary in summaries:
            for reason, count in summary["failure_reasons"].items():
                reasons[reason] = reasons.get(reason, 0) + count
        logger.warning("%d of %d input(s) failed (%s); the failed-inputs artifact lists them, and each output holds "
                       "every one with its reason: %s", failed, inputs, _reasons(reasons),
                       ", ".join(s["output"] for s in summaries if s["failed"]))
    never = None if ok else _never_started(summaries)
    if never is not None:  # a broken model, not bad inputs: red in the UI and in cron, with the reason why
        reason, error = never
        logger.error("%s never started, so no input was screened: %s", provider, error)
        return Failed(message=f"{message}: {provider} never started: {error}",
                      data=CampaignFailed(f"{message}: {provider} never started: {error}", reason=reason,
                                          details={"summary": total}))
    if refused:
        return Failed(message=f"{message}; {len(refused)} file(s) refused: {refused[0]}",
                      data=CampaignFailed(f"{message}; refused: " + "; ".join(refused), reason="bad_input_file",
                                          details={"summary": total}))
    if failed and fail_on_input_errors:
        return Failed(message=f"{message} (fail_on_input_errors)",
                      data=CampaignFailed(f"{message}: the campaign was asked to fail on failed inputs",
                                          details={"summary": total}))
    if failed:  # completed, and named so: a bare "Completed" reads as every input answered
        where = failed_at or f"the {artifact_key('screen-failed', provider)} artifact"
        return Completed(name=COMPLETED_WITH_FAILURES, message=f"{message}; failed inputs: {where}", data=total)
    return Completed(message=message, data=total)


def _never_started(summaries: list[dict[str, Any]]) -> tuple[str, str] | None:
    """(reason, error) when the provider could not be started for any input: the start failure itself where one is
    listed (a breaker's refusal quotes it too), else the first such failure; None otherwise."""
    found = [f for s in summaries for f in s["failures"] if f["reason"] in NOT_STARTED]
    if not found:
        return None
    first = next((f for f in found if f["reason"] == "start_failed"), found[0])
    return first["reason"], first["error"]


def _artifacts(total: dict[str, Any], input: str) -> str | None:
    """The summary, the failed inputs (when any) and where the outputs are, each under a stable key; returns the
    UI address of the failed inputs' artifact (None when nothing failed, or no UI address is known).

    Markdown, each a short table with its long text (paths, errors, reasons) under it: the UI cuts a long table
    cell off at the column's width, and an error or a path cut short is no use."""
    provider, host = total["provider"], total["host"]
    create_markdown_artifact(key=artifact_key("screen-summary", provider), markdown=_summary(total, input),
                             description=escape_markdown(f"screening campaign: {provider} over {input}: {total['ok']} "
                                                         f"ok, {total['failed']} failed"))
    failures = [{"file": s["file"], **failure} for s in total["files"] for failure in s["failures"]]
    link = None
    if failures:
        shown = f"the first {len(failures)} of {total['failed']:,}" if len(failures) < total["failed"] else \
            f"all {total['failed']:,}"
        made = create_markdown_artifact(key=artifact_key("screen-failed", provider),
                                        markdown=_failed(provider, failures, shown, len(total["files"]) > 1),
                                        description=escape_markdown(f"{provider}: failed inputs, {shown}; every one "
                                                                    "is in its output, with its reason and error"))
        link = _artifact_url(made)
    if total["files"]:
        create_markdown_artifact(key=artifact_key("screen-output", provider), markdown=_outputs(total),
                                 description=escape_markdown(f"{provider}: where the outputs are (on {host})"))
    return link


def _artifact_url(artifact_id: Any) -> str | None:
    """Where the UI shows an artifact: PREFECT_UI_URL's /artifacts/artifact/<id> (None without a UI address)."""
    base = PREFECT_UI_URL.value()
    return f"{base.rstrip('/')}/artifacts/artifact/{artifact_id}" if base and artifact_id else None


def _summary(total: dict[str, Any], input: str) -> str:
    """The summary: one short row of counts per file, then each file's paths and failure reasons in full."""
    lines = [f"## {escape_markdown(total['provider'])} over {escape_markdown(input)}: {total['ok']:,} ok, "
             f"{total['failed']:,} failed", "",
             "| file | inputs | ok | failed | computed | from store | duplicates | inputs/s |",
             "|---|---|---|---|---|---|---|---|"]
    for s in total["files"]:
        lines.append(f"| {escape_markdown(Path(s['file']).name)} | {s['inputs']:,} | {s['ok']:,} | {s['failed']:,} | "
                     f"{s['computed']:,} | {s['from_store']:,} | {s['duplicates']:,} | "
                     f"{s['throughput_inputs_per_s']} |")
    lines += ["| (a file refused) | 0 | 0 | 0 | 0 | 0 | 0 | |"] * len(total["refused"])
    for s in total["files"]:
        lines += ["", f"### {escape_markdown(Path(s['file']).name)}", "",
                  f"- input: {escape_markdown(s['file'])}", f"- output: {escape_markdown(s['output'])}",
                  f"- report: {escape_markdown(s['report'] or 'none')}",
                  f"- failure reasons: {escape_markdown(_reasons(s['failure_reasons']))}",
                  f"- {s['throughput_inputs_per_s']} inputs/s over {s['wall_s']} s, on host "
                  f"{escape_markdown(total['host'])}"]
    if total["refused"]:
        lines += ["", "### Files refused", "", *(f"- {escape_markdown(problem)}" for problem in total["refused"])]
    return "\n".join(lines)


def _failed(provider: str, failures: list[dict[str, Any]], shown: str, files: bool) -> str:
    """The failed inputs: a short table (index, id, reason), then each one's whole error under it."""
    head = ("| file | index | id | reason |", "|---|---|---|---|") if files else ("| index | id | reason |",
                                                                               "|---|---|---|")
    lines = [f"## {escape_markdown(provider)}: failed inputs, {shown}", "",
             "Every one is in its output with its reason and error; why each failed is under the table.", "", *head]
    for row in failures:
        cells = [escape_markdown(Path(row["file"]).name)] if files else []
        cells += [str(row["index"]), escape_markdown(row["id"]), escape_markdown(row["reason"])]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "### Why each failed", ""]
    lines += [f"- **{row['index']}** ({escape_markdown(row['id'])}, {escape_markdown(row['reason'])}): "
              f"{escape_markdown(row['error'])}" for row in failures]
    return "\n".join(lines)


def _outputs(total: dict[str, Any]) -> str:
    """Each output with its host, its rows and its report: readable wherever the artifact is read."""
    host = escape_markdown(total["host"])
    lines = [f"## {escape_markdown(total['provider'])}: outputs on host `{host}`", ""]
    for s in total["files"]:
        # Paths on the host, not file:// links: a link opens the reader's own disk, where nothing is.
        report = escape_markdown(s["report"]) if s["report"] else "none"
        lines += [f"- {escape_markdown(s['file'])}: {s['inputs']:,} records, {s['ok']:,} ok, {s['failed']:,} failed",
                  f"    - output: {escape_markdown(s['output'])}", f"    - report: {report}"]
    lines += ["", f"The paths are on `{host}`, where the flow ran; the report opens in a browser there, or copied "
                  "anywhere (one file, nothing fetched)."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", default=DEFAULT_INPUT, help="an input file, or a folder of them (an inbox)")
    parser.add_argument("--provider", default="minilm")
    parser.add_argument("--chunk-size", type=int, default=64)
    parser.add_argument("--output", help="output file (default: <input>.<provider>.<format> beside the input; for a "
                        "folder input: the output folder, default <folder>/screened)")
    parser.add_argument("--format", choices=["jsonl", "parquet"], default="jsonl")
    parser.add_argument("--column", help="the CSV/TSV/JSONL field holding the text (default: sequence, text, ...)")
    parser.add_argument("--id-column", help="the field holding each input's id (default: id, name, ...)")
    parser.add_argument("--fail-on-input-errors", action="store_true",
                        help="end Failed (exit 1) when any input failed")
    parser.add_argument("--max-workers", type=int, help="chunk tasks at once (default: max_replicas + 1)")
    parser.add_argument("--encoding", choices=["float32-base64", "array", "json"], default="float32-base64",
                        help="how minilm sends each vector back")
    parser.add_argument("--no-report", action="store_true", help="write no HTML report beside the output")
    parser.add_argument("--kind", choices=["protein", "text"],
                        help="read each input as this kind (default: as the file says, else the provider's first)")
    parser.add_argument("--manifests", default=str(host_settings()[0].manifests or ROOT / "manifests"),
                        help="the providers' folder (this process's RESIDENT_POOL_MANIFESTS, for the flow it runs)")
    args = parser.parse_args(argv)
    # The flow reads the providers' folder from its host's configuration; here, the operator's own command is it.
    os.environ["RESIDENT_POOL_MANIFESTS"] = str(Path(args.manifests).expanduser().resolve())
    if not Path(args.input).is_dir():  # a file that is not an input file: one sentence, no traceback, no flow run
        try:
            settings = CampaignSettings.of(*host_settings())
            InputFile(args.input, column=args.column, id_column=args.id_column,
                      max_record_bytes=settings.max_record_bytes).check()
        except InputError as error:
            print(f"error: {error}", file=sys.stderr)
            return 2
    state = screen(input=args.input, provider=args.provider, chunk_size=args.chunk_size, output=args.output,
                   format=args.format, column=args.column, id_column=args.id_column,
                   fail_on_input_errors=args.fail_on_input_errors, max_workers=args.max_workers,
                   encoding=args.encoding, report=not args.no_report, kind=args.kind, return_state=True)
    result = state.result(raise_on_failure=False)
    summary = result.details.get("summary") if isinstance(result, CampaignFailed) else result
    if isinstance(summary, dict):
        print(json.dumps({k: v for k, v in summary.items() if k not in ("workers", "files")}, indent=2))
    if not state.is_completed():
        print(f"error: {state.message}", file=sys.stderr)
        return 1
    return 0 if summary.get("missing") == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
