"""The screening campaign: every input through a resident provider, chunked into Prefect tasks.

    python flows/screen.py [--input data/uniprot-500.fasta] [--provider minilm] [--chunk-size 64]

Results are appended to the output file as chunks finish; a re-run recomputes
nothing that finished (tasks are cached by chunk content, provider and pins);
every input ends with one record: a result, or a failure with its reason.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from prefect import flow, task
from prefect.artifacts import create_progress_artifact, create_table_artifact, update_progress_artifact
from prefect.futures import as_completed
from prefect.task_runners import ThreadPoolTaskRunner

from resident_pool.campaign import (
    OutputFile,
    chunk_key,
    chunks,
    failure_records,
    read_inputs,
    summarize,
)
from resident_pool.client import default_manifests
from resident_pool.errors import ResidentPoolError, WorkerRequestError
from resident_pool.manifest import load_manifest
from resident_pool.prefect import failure_artifact_key, pool_session, retry_pool_failures

ROOT = Path(__file__).resolve().parents[1]


def _cache_key(context, parameters: dict[str, Any]) -> str:
    options = json.dumps(parameters["options"], sort_keys=True)
    return chunk_key(f"{parameters['provider']}{options}", parameters["fingerprint"], parameters["chunk"])


def _ok_record(item: dict[str, Any], result: dict[str, Any]) -> dict[str, Any]:
    return {"index": item["index"], "id": item["id"], "ok": True, **result}


@task(
    name="predict-chunk",
    retries=2,
    retry_delay_seconds=1,
    retry_condition_fn=retry_pool_failures,
    cache_key_fn=_cache_key,
    persist_result=True,
)
def predict_chunk(
    provider: str, manifests: str, fingerprint: str, chunk: list[dict[str, Any]], options: dict[str, Any]
) -> dict[str, Any]:
    """One chunk on one held worker; a model error on one input fails that input alone."""
    started = time.monotonic()
    with pool_session(provider, manifests) as session:
        cold, pid = session.cold, session.pid
        try:
            answer = session.predict({**options, "inputs": [item["text"] for item in chunk]})
            results = answer["items"]
            if len(results) != len(chunk):
                raise ValueError(f"{provider} answered {len(results)} items for {len(chunk)} inputs")
            records = [_ok_record(item, result) for item, result in zip(chunk, results, strict=True)]
        except WorkerRequestError as error:
            if error.reason != "request_failed":
                raise
            records = []
            for item in chunk:  # isolate the input the model refused
                try:
                    single = session.predict({**options, "inputs": [item["text"]]})
                    records.append(_ok_record(item, single["items"][0]))
                except WorkerRequestError as refused:
                    if refused.reason != "request_failed":
                        raise
                    records += failure_records([item], "request_failed", str(refused))
    return {"records": records, "cold": cold, "pid": pid, "latency_s": time.monotonic() - started, "n": len(chunk)}


def _default_output(input_path: str, provider: str) -> str:
    return str(ROOT / "out" / f"{Path(input_path).stem}.{provider}.jsonl")


@flow(name="screen", task_runner=ThreadPoolTaskRunner(max_workers=4), log_prints=True)
def screen(
    input: str = str(ROOT / "data" / "uniprot-500.fasta"),
    provider: str = "minilm",
    chunk_size: int = 64,
    output: str | None = None,
    manifests: str | None = None,
    encoding: str | None = "float32-base64",
) -> dict[str, Any]:
    """Screen every input of a FASTA, CSV or JSONL file through ``provider``.

    ``encoding`` is passed to the provider: minilm's "float32-base64" sends each
    embedding as base64 float32 (``embedding_f32``), which on a 2-core host
    moves a chunk of 64 faster than JSON float text; None asks for plain lists.
    """
    options = {"encoding": encoding} if encoding else {}
    started = time.monotonic()
    manifests_dir = str(default_manifests(manifests))
    manifest = load_manifest(Path(manifests_dir) / provider / "manifest.toml")
    items, early_failures = read_inputs(input)
    total = len(items) + len(early_failures)
    out = OutputFile(output or _default_output(input, provider))
    if early_failures:
        out.append(early_failures)
    batches = [[{"index": i.index, "id": i.id, "text": i.text} for i in chunk] for chunk in chunks(items, chunk_size)]
    progress = create_progress_artifact(0.0, key=f"screen-progress-{provider}",
                                        description=f"{provider}: {total} inputs from {input}")
    futures = {
        predict_chunk.submit(provider, manifests_dir, manifest.fingerprint(), batch, options): batch
        for batch in batches
    }
    done, stats = len(early_failures), []
    for future in as_completed(list(futures)):
        batch = futures[future]
        try:
            result = future.result()
            records = result["records"]
            stats.append({**{k: v for k, v in result.items() if k != "records"},
                          "cached": future.state.name == "Cached"})
        except ResidentPoolError as error:
            records = failure_records(batch, error.reason, str(error))
            stats.append({"failed": True, "n": len(batch)})
        except Exception as error:  # noqa: BLE001 - any other failure is still recorded per input, never lost
            records = failure_records(batch, type(error).__name__, str(error))
            stats.append({"failed": True, "n": len(batch)})
        out.append(records)
        done += len(batch)
        update_progress_artifact(progress, 100.0 * done / max(total, 1))
    final = out.compact(total)
    summary = summarize(final, stats, total, time.monotonic() - started)
    summary.update({"provider": provider, "chunk_size": chunk_size, "output": str(out.path)})
    create_table_artifact(
        key=f"screen-summary-{failure_artifact_key(provider).removeprefix('resident-pool-failure-')}",
        table=[{"measure": k, "value": json.dumps(v) if isinstance(v, dict | list) else v} for k, v in summary.items()],
        description=f"screening campaign summary: {provider} over {input}",
    )
    print(
        f"screened {summary['inputs']} inputs with {provider}: {summary['ok']} ok, {summary['failed']} failed; "
        f"{summary['cold_starts']} cold start(s), {summary['cached_chunks']}/{summary['chunks']} chunks from cache; "
        f"warm median {summary['warm_median_chunk_latency_ms']} ms per chunk of {chunk_size}; "
        f"{summary['throughput_inputs_per_s']} inputs/s; output {summary['output']}"
    )
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", default=str(ROOT / "data" / "uniprot-500.fasta"))
    parser.add_argument("--provider", default="minilm")
    parser.add_argument("--chunk-size", type=int, default=64)
    parser.add_argument("--output")
    parser.add_argument("--manifests", default=os.environ.get("RESIDENT_POOL_MANIFESTS", str(ROOT / "manifests")))
    args = parser.parse_args(argv)
    summary = screen(input=args.input, provider=args.provider, chunk_size=args.chunk_size, output=args.output,
                     manifests=args.manifests)
    print(json.dumps({k: v for k, v in summary.items() if k != "workers"}, indent=2))
    return 0 if summary["missing"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
