"""The screening campaign: every input through a resident provider, in chunks of Prefect task runs.

    python flows/screen.py [--input FILE_OR_INBOX] [--provider minilm] [--chunk-size 64]
                           [--output PATH] [--format jsonl|parquet] [--column NAME] [--id-column NAME]
                           [--fail-on-input-errors]

Inputs are read lazily; each input's result is stored under sha256(provider
version, options, text) in the user's result store, so a re-run, a reordered
file, a file with sequences appended, or a duplicate sequence computes only
what no earlier run computed. Results are appended to ``<output>.partial`` as
chunks finish; the output itself (one record per input, in input order) is
written at the end. Given a folder (an inbox), every input file in it is
screened, one output per file.
"""

from __future__ import annotations

import argparse
import json
import queue
import stat
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

from prefect import flow, get_run_logger, task
from prefect.artifacts import (
    create_link_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)
from prefect.cache_policies import NO_CACHE
from prefect.context import FlowRunContext
from prefect.states import Completed, Failed
from prefect.task_runners import ThreadPoolTaskRunner
from prefect.tasks import exponential_backoff
from prefect.utilities.annotations import quote

from resident_pool.campaigns.campaign import (
    BLOCK,
    Campaign,
    CampaignSettings,
    Chunk,
    TaskSizer,
    output_name,
    summarize,
)
from resident_pool.campaigns.inputs import FORMATS, InputFile, Region
from resident_pool.campaigns.results import ResultStore, provider_version
from resident_pool.client import default_manifests
from resident_pool.errors import CampaignFailed, InputError, ResidentPoolError, WorkerRequestError
from resident_pool.prefect import artifact_key, pool_session, retry_pool_failures
from resident_pool.prefect.roots import check_path
from resident_pool.providers.manifest import Manifest, load_manifest, manifest_path
from resident_pool.settings import settings as pool_settings

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_INPUT = str(ROOT / "data" / "uniprot-500.fasta")
PROGRESS_EVERY_S = 2.0  # a progress update is an API call: a million-input campaign must not make thousands


@task(
    name="predict-chunk",
    task_run_name="predict-chunk[{first}-{last}]",
    retries=3,
    # 1, 2, 4 s (each +-50%): a worker that died of OOM gets time to be replaced, and retries do not align.
    retry_delay_seconds=exponential_backoff(backoff_factor=1),
    retry_jitter_factor=0.5,
    retry_condition_fn=retry_pool_failures,
    # The result store keeps every answer; Prefect's own copy under ~/.prefect/storage would only grow.
    persist_result=False,
    cache_policy=NO_CACHE,
)
def predict_chunk(provider: str, manifests: str, texts: list[str], options: dict[str, Any], first: int,
                  last: int, max_attachment_bytes: int | None = None, chunk_size: int | None = None) -> dict[str, Any]:
    """One chunk on one held worker, in requests of ``chunk_size`` inputs; an input the model refuses fails alone."""
    started = time.monotonic()
    size = chunk_size or max(len(texts), 1)
    results: list[dict[str, Any] | None] = []
    failed: dict[int, tuple[str, str]] = {}
    compute_s = 0.0  # the model's time, as the requests took it: what sizes the next chunks (TaskSizer)
    with pool_session(provider, manifests, max_attachment_bytes=max_attachment_bytes) as session:
        cold, pid = session.cold, session.pid
        version = session.lease.get("version")
        for at in range(0, len(texts), size):
            sent = time.monotonic()
            results += _request(provider, session, options, texts[at:at + size], at, failed)
            compute_s += time.monotonic() - sent
    for position, result in enumerate(results):
        if result is None and position not in failed:
            failed[position] = ("bad_answer", f"{provider} answered no item for this input")
    return {"results": results, "failed": failed, "cold": cold, "pid": pid, "version": version,
            "latency_s": time.monotonic() - started, "compute_s": compute_s}


def _request(provider: str, session: Any, options: dict[str, Any], texts: list[str], offset: int,
             failed: dict[int, tuple[str, str]]) -> list[dict[str, Any] | None]:
    """One request's items; when the model refuses the request, each input alone, to find the one it refuses."""
    try:
        return _items(provider, session.predict({**options, "inputs": texts}), len(texts))
    except WorkerRequestError as error:
        if error.reason != "request_failed":
            raise
    results: list[dict[str, Any] | None] = []
    for position, text in enumerate(texts):
        try:
            results.append(_items(provider, session.predict({**options, "inputs": [text]}), 1)[0])
        except WorkerRequestError as refused:
            if refused.reason != "request_failed":
                raise
            results.append(None)
            failed[offset + position] = ("request_failed", str(refused))
    return results


def _items(provider: str, answer: Any, expected: int) -> list[dict[str, Any] | None]:
    """The answer's per-input items; one that is not ``{"items": [one object per input]}`` answers none.

    An array ``<name>s`` beside the items with one row per input (minilm's ``embeddings`` under
    ``encoding = "array"``) gives each item its row as ``<name>``, unless the item has that field.
    """
    items = answer.get("items") if isinstance(answer, dict) else None
    if not isinstance(items, list) or len(items) != expected:
        return [None] * expected
    items = [item if isinstance(item, dict) else None for item in items]
    for name, value in answer.items():
        rows = _rows(value, expected) if name.endswith("s") and len(name) > 1 and name != "items" else None
        for item, row in zip(items, rows or (), strict=False):
            if item is not None:
                item.setdefault(name[:-1], row)
    return items


def _rows(value: Any, expected: int) -> list[Any] | None:
    """An array's rows when it has ``expected`` of them (numpy arrays, or arrays.Array without numpy)."""
    shape = getattr(value, "shape", None)
    if not isinstance(shape, tuple) or not shape or shape[0] != expected or not hasattr(value, "tolist"):
        return None
    return list(value) if hasattr(value, "__getitem__") else value.tolist()


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
    """The progress artifact: finished inputs over inputs seen, scaled by how far the file is read."""

    def __init__(self, provider: str, description: str) -> None:
        self.id = create_progress_artifact(0.0, key=artifact_key("screen-progress", provider), description=description)
        self.last = time.monotonic()

    def update(self, percent: float, force: bool = False) -> None:
        if force or time.monotonic() - self.last >= PROGRESS_EVERY_S:
            update_progress_artifact(self.id, min(100.0, max(0.0, percent)))
            self.last = time.monotonic()


class _FileRun:
    """One input file through the provider: a bounded window of chunk futures, settled as they finish."""

    # Inputs in flight at once, whatever the window of chunks: with chunks grown to TaskSizer.MAX_INPUTS,
    # two computing (max_replicas 2) and one waiting for a replica. Each costs the flow about 600 bytes.
    MAX_IN_FLIGHT = 3 * TaskSizer.MAX_INPUTS

    def __init__(self, source: InputFile, campaign: Campaign, *, provider: str, manifests: str,
                 options: dict[str, Any], submit: Submit, window: int, progress: _Progress,
                 limits: CampaignSettings) -> None:
        self.source, self.campaign = source, campaign
        self.provider, self.manifests, self.options = provider, manifests, options
        self.max_attachment_bytes = limits.max_attachment_bytes
        self.submit, self.window, self.progress = submit, window, progress
        self.done: queue.SimpleQueue = queue.SimpleQueue()
        self.in_flight: dict[Any, Chunk] = {}
        self.inputs_in_flight = 0
        self.settled = 0
        self.size = max(source.size(), 1)

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
                while self.settle(block=False):
                    pass
                self.hold_back()
            for chunk in [*self.campaign.add(block), *self.campaign.flush()]:
                self.launch(chunk)
        finally:
            while self.in_flight:  # what was computed is stored, even when reading the file failed
                self.settle(block=True)

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
        # quote: Prefect walks every element of a task's parameters, twice per run (16 ms per thousand texts,
        # measured); texts hold no futures to find.
        future = self.submit(predict_chunk, {"provider": self.provider, "manifests": self.manifests,
                                             "texts": quote(chunk.texts), "options": self.options, "first": chunk.first,
                                             "last": chunk.last, "max_attachment_bytes": self.max_attachment_bytes,
                                             "chunk_size": self.campaign.chunk_size})
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
        self.settled += len(chunk)
        seen = campaign.counts["inputs"]
        finished = seen - campaign.counts["computed"] - len(campaign.pending) + self.settled
        read = min(1.0, self.source.bytes_read() / self.size)
        self.progress.update(100.0 * read * finished / max(seen, 1))
        return True


def _screen_file(source: InputFile, output: Path, *, store: ResultStore, version: str, chunk_size: int, fmt: str,
                 **run: Any) -> dict[str, Any]:
    """One input file through the provider; returns its line of the summary."""
    started = time.monotonic()
    campaign = Campaign(store, version, run["options"], chunk_size, output,
                        max_result_bytes=run["limits"].max_result_bytes, fmt=fmt)
    try:
        _FileRun(source, campaign, **run).run()
        written = campaign.write(fmt)
    finally:
        campaign.close()
    run["progress"].update(100.0, force=True)
    summary = summarize(campaign.counts, written, campaign.chunk_stats, time.monotonic() - started)
    return {"file": str(source.path), "output": str(output), **summary}


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


def _check_roots(input: str, output: str | None, manifests: str | None) -> str:
    """The paths this run was given, within the folders the worker host allows (resident_pool.prefect.roots);
    returns the input with its folders' links resolved, as checked, so that a link swapped in on the way after
    the check is not followed. An input file that is itself a link stays one, and is refused when opened."""
    path = Path(input).expanduser()
    pinned = path.resolve() if path.is_dir() else path.parent.resolve() / path.name
    check_path(pinned, "input")
    check_path(output or (pinned / "screened" if pinned.is_dir() else pinned.parent), "output")
    if manifests is not None:
        check_path(manifests, "manifests")
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
    manifests: str | None = None,
    encoding: str | None = "float32-base64",
):
    """Screen every input of a FASTA, CSV, TSV or JSONL file (or of every such file in a folder).

    ``output``: the output file (default ``<input>.<provider>.<format>`` beside
    the input; for a folder: the output folder, default ``<folder>/screened``).
    ``column``/``id_column``: the CSV/TSV/JSONL fields holding the text and the
    id (matched ignoring case). ``max_workers``: chunk
    tasks at once (default: the provider's max_replicas + 1). ``encoding`` is
    passed to the provider: minilm's "float32-base64" sends each embedding as
    base64 float32, cheaper than JSON float text.
    """
    started = time.monotonic()
    logger = get_run_logger()
    try:  # everything that can be wrong before any work: one sentence on the run, no traceback
        input = _check_roots(input, output, manifests)
        manifests_dir = str(default_manifests(manifests))
        settings = CampaignSettings.from_env()
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
    options = {"encoding": encoding} if encoding else {}
    version = provider_version(manifest)
    summaries = []
    progress = _Progress(provider, f"{provider}: {input}")
    with store, _chunk_runner(max_workers, manifest.lifecycle.max_replicas) as (submit, window):
        for source, target in files:
            try:
                summaries.append(_screen_file(source, target, provider=provider, manifests=manifests_dir,
                                              version=version, store=store, options=options, chunk_size=chunk_size,
                                              fmt=format, submit=submit, window=window, progress=progress,
                                              limits=settings))
            except InputError as error:
                refused.append(str(error))
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
             "wall_s": round(wall_s, 2), "files": summaries, "refused": refused}
    if len(summaries) == 1:
        one = summaries[0]
        total.update({k: one[k] for k in ("output", "failure_reasons", "warm_median_chunk_latency_ms", "workers")})
    _artifacts(total, input)
    message = f"{ok} ok, {failed} failed"
    details = f"{inputs} inputs in {len(summaries)} file(s): {computed} computed, {total['from_store']} from the " \
              f"store, {total['duplicates']} duplicates; {total['throughput_inputs_per_s']} inputs/s"
    print(f"screened with {provider}: {message}; {details}"
          + "".join(f"; output {s['output']}" for s in summaries))
    if refused:
        return Failed(message=f"{message}; {len(refused)} file(s) refused: {refused[0]}",
                      data=CampaignFailed(f"{message}; refused: " + "; ".join(refused), reason="bad_input_file",
                                          details={"summary": total}))
    if failed and fail_on_input_errors:
        return Failed(message=f"{message} (fail_on_input_errors)",
                      data=CampaignFailed(f"{message}: the campaign was asked to fail on failed inputs",
                                          details={"summary": total}))
    return Completed(message=message, data=total)


def _artifacts(total: dict[str, Any], input: str) -> None:
    provider = total["provider"]
    rows = [{"file": s["file"], "inputs": s["inputs"], "ok": s["ok"], "failed": s["failed"],
             "computed": s["computed"], "from store": s["from_store"], "duplicates": s["duplicates"],
             "failure reasons": json.dumps(s["failure_reasons"]), "inputs/s": s["throughput_inputs_per_s"],
             "output": s["output"]} for s in total["files"]]
    rows += [{"file": problem, "inputs": 0, "ok": 0, "failed": 0, "computed": 0, "from store": 0, "duplicates": 0,
              "failure reasons": "file refused", "inputs/s": None, "output": ""} for problem in total["refused"]]
    create_table_artifact(key=artifact_key("screen-summary", provider), table=rows,
                          description=f"screening campaign: {provider} over {input}: {total['ok']} ok, "
                                      f"{total['failed']} failed")
    for summary in total["files"]:
        create_link_artifact(link=Path(summary["output"]).resolve().as_uri(), link_text=summary["output"],
                             description=f"{provider} output for {summary['file']}: {summary['ok']} ok, "
                                         f"{summary['failed']} failed")


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
    parser.add_argument("--manifests", default=str(pool_settings().manifests or ROOT / "manifests"))
    args = parser.parse_args(argv)
    if not Path(args.input).is_dir():  # a file that is not an input file: one sentence, no traceback, no flow run
        try:
            settings = CampaignSettings.from_env()
            InputFile(args.input, column=args.column, id_column=args.id_column,
                      max_record_bytes=settings.max_record_bytes).check()
        except InputError as error:
            print(f"error: {error}", file=sys.stderr)
            return 2
    state = screen(input=args.input, provider=args.provider, chunk_size=args.chunk_size, output=args.output,
                   format=args.format, column=args.column, id_column=args.id_column,
                   fail_on_input_errors=args.fail_on_input_errors, max_workers=args.max_workers,
                   manifests=args.manifests, return_state=True)
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
