"""An ad hoc prediction, for a run started from the Prefect UI: pick a provider, type sequences (or a payload).

Sequences go to the provider as ``{"inputs": [...]}`` (the shape the campaign
sends), and each gets its own answer. A provider that takes another shape gets
``payload`` as it is; with neither, the provider's ``[smoke]`` payload is sent, so
a bare run shows what the provider answers. The answer is shown on the run's
page as a markdown artifact, a table per input (a flow's return value is not
displayed in the UI); the whole answer is the flow run's persisted result.

The providers are those of the worker host's own configuration
(``RESIDENT_POOL_MANIFESTS``), never a flow parameter.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import os
import socket
import time
from typing import Any, Literal

from prefect import flow, get_run_logger, runtime, task
from prefect.artifacts import create_markdown_artifact
from prefect.states import Completed, Failed

from resident_pool.campaigns.answers import per_input, with_refused
from resident_pool.client import default_manifests
from resident_pool.errors import ManifestError
from resident_pool.prefect import (
    COMPLETED_WITH_FAILURES,
    Priority,
    artifact_key,
    code_span,
    escape_markdown,
    host_settings,
    pool_session,
    retry_pool_failures,
)
from resident_pool.providers.input_rules import kind_option, rule_inputs
from resident_pool.providers.manifest import load_manifest, manifest_path
from resident_pool.validation.expected import smoke_set

DEFAULT_PROVIDER = "minilm"  # the demo model: a bare run from the UI embeds its example sequences
BATCH = 64  # sequences per request, as the campaign's chunks
SHOWN_INPUTS = 20  # inputs shown in the artifact; the flow's result keeps them all
SHOWN_VALUES = 6  # first values of a vector; its dimension and norm say the rest
SHOWN_CHARS = 200  # of a text field, or of a nested value written as JSON


@task(name="predict", retries=1, retry_condition_fn=retry_pool_failures, task_run_name="predict[{provider}]")
def predict_inputs(provider: str, payloads: list[Any], manifests: str, priority: str = "interactive"
                   ) -> dict[str, Any]:
    """Each payload in turn on one held worker; says in the run's log when it has answered."""
    with pool_session(provider, manifests, priority=priority) as session:
        started = time.monotonic()
        results = [session.predict(payload) for payload in payloads]
        seconds = time.monotonic() - started
        get_run_logger().info("%s: answered %d request(s) in %.2f s on replica %d (pid %d, %s)", provider,
                              len(payloads), seconds, session.replica, session.pid,
                              "cold start" if session.cold else "warm")
        return {"results": results, "worker_pid": session.pid, "cold": session.cold, "replica": session.replica,
                "answer_s": round(seconds, 3)}


class Asked:
    """What a run sends: its requests, what they are (for the log and the artifact), and, when they are inputs, each
    input in order with why it was refused where it was (refused ones are not sent; each fails alone)."""

    def __init__(self, requests: list[Any], what: str, inputs: list[Any] | None = None,
                 kept: list[int] | None = None, refused: dict[int, str] | None = None) -> None:
        self.requests, self.what = requests, what
        self.inputs, self.kept, self.refused = inputs or [], kept or [], refused or {}

    def shown(self) -> list[Any]:
        """Each input as it was sent (a protein as its rule read it), or as given where it was refused."""
        sent, kept = iter(text for request in self.requests for text in request["inputs"]), set(self.kept)
        return [next(sent) if position in kept else value for position, value in enumerate(self.inputs)]


def _requests(provider: str, sequences: list[str] | None, payload: dict[str, Any] | None,
              kind: str | None = None) -> Asked:
    """The requests to send: each sequence (or a payload's "inputs") ruled by the provider's [inputs] as a campaign
    rules a file's, 64 to a request; a payload of another shape as it is; with neither, its [smoke] example."""
    # A whole name, never a path: it names the manifest folder and the artifact.
    manifest = load_manifest(manifest_path(default_manifests(None, *host_settings()), provider))
    example = json.dumps(manifest.smoke.payload) if manifest.smoke.payload else "{...}"
    if sequences and payload:
        raise ManifestError(f"{provider}: give sequences or a payload, not both")
    extra: dict[str, Any] = {}
    if payload and manifest.takes_inputs() and isinstance(payload.get("inputs"), list):
        extra = {key: value for key, value in payload.items() if key not in ("inputs", "kind")}
        sequences, kind = payload["inputs"], kind or payload.get("kind")
    if sequences:
        if not manifest.takes_inputs():
            raise ManifestError(f"{provider} does not take sequences (its requests look like {example}); leave "
                                "sequences empty and give a payload", slug=provider)
        read_as = manifest.inputs.kind_for(kind)
        if kind and kind != read_as:
            raise ManifestError(f"{provider} takes {' and '.join(manifest.inputs.kinds)} inputs, not {kind}",
                                slug=provider)
        texts, kept, refused = rule_inputs(manifest.inputs, list(sequences), read_as)
        shared = {**extra, **kind_option(manifest.inputs, read_as)}
        requests = [{**shared, "inputs": texts[at:at + BATCH]} for at in range(0, len(texts), BATCH)]
        return Asked(requests, "sequences", list(sequences), kept, refused)
    if payload:
        return Asked([payload], "payload")
    if not manifest.smoke.payload and manifest.smoke.inputs is None:
        raise ManifestError(f"{provider}: no sequences or payload were given and its manifest has no [smoke] payload "
                            "to send; give sequences or a payload", slug=provider)
    return Asked([smoke_set(manifest).payload], "its [smoke] example")


# -- the answer, readable ----------------------------------------------------------------
def describe(value: Any) -> str:
    """One cell: a vector as its dimension, norm and first values; text cut short; anything else as JSON."""
    vector = _vector(value)
    if vector is not None:
        kind, values = vector
        norm = math.sqrt(sum(v * v for v in values))
        first = ", ".join(f"{v:.4g}" for v in values[:SHOWN_VALUES])
        more = ", ..." if len(values) > SHOWN_VALUES else ""
        return f"{kind} of {len(values)}, norm {norm:.4g}: {first}{more}"
    if isinstance(value, bytes | bytearray | memoryview):
        return f"{len(value)} bytes"
    shape = getattr(value, "shape", None)
    if isinstance(shape, tuple) and hasattr(value, "dtype"):
        flat = value.reshape(-1)[:SHOWN_VALUES].tolist() if hasattr(value, "reshape") else []
        first = ": " + ", ".join(map(str, flat)) + (", ..." if math.prod(shape) > len(flat) else "") if flat else ""
        return f"{value.dtype} array, shape {list(shape)}{first}"
    if isinstance(value, str):
        return value if len(value) <= SHOWN_CHARS else value[:SHOWN_CHARS] + f"... ({len(value)} characters)"
    if value is None or isinstance(value, bool | int | float):
        return json.dumps(value)
    text = json.dumps(value, default=str)
    return text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS] + f"... ({len(text)} characters)"


def _vector(value: Any) -> tuple[str, list[float]] | None:
    """A list, array or base64 float32 text of at least two numbers, as (what it is, its values)."""
    shape = getattr(value, "shape", None)
    if isinstance(shape, tuple) and len(shape) == 1 and shape[0] >= 2 and hasattr(value, "tolist"):
        values = value.tolist()
        if all(isinstance(v, int | float) for v in values):
            return f"{getattr(value, 'dtype', 'array')} vector", [float(v) for v in values]
    if isinstance(value, list) and len(value) >= 2 and all(
            isinstance(v, int | float) and not isinstance(v, bool) for v in value):
        return "vector", [float(v) for v in value]
    return None


def _decoded(name: str, value: Any) -> Any:
    """A ``*_f32`` field (minilm's base64 encoding) as its numbers."""
    if name.endswith("_f32") and isinstance(value, str):
        try:
            raw = base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError):
            return value
        if len(raw) % 4 == 0:
            import array

            values = array.array("f")
            values.frombytes(raw)
            return values.tolist()
    return value


def _table(fields: dict[str, Any]) -> list[str]:
    rows = [f"| {escape_markdown(str(name))} | {escape_markdown(describe(_decoded(str(name), value)))} |"
            for name, value in fields.items()]
    return ["| field | value |", "|---|---|", *rows] if rows else ["(no fields)"]


def _heading(number: int, sequence: str | None) -> str:
    if sequence is None:
        return f"### answer {number}"
    shown = sequence if len(sequence) <= 60 else sequence[:60] + "..."
    return f"### {number}. {escape_markdown(shown)} ({len(sequence)} characters)"


def markdown(provider: str, asked: Asked, answer: dict[str, Any]) -> str:
    """The answer as a table per input, under who answered it and how to fetch the whole of it."""
    warmth = "cold start" if answer["cold"] else "warm"
    requests, what = asked.requests, asked.what
    count = f"{len(asked.inputs)} sequence(s)" if what == "sequences" else what
    lines = [f"## {escape_markdown(provider)}: {count}", ""]
    if asked.refused:
        lines += [f"{len(asked.refused)} of {len(asked.inputs)} refused by {escape_markdown(provider)}'s input rule, "
                  "each alone; the rest were answered.", ""]
    if requests:
        lines += [f"Answered by replica {answer['replica']} (pid {answer['worker_pid']}, {warmth}) on host "
                  f"{code_span(answer['host'])} in {answer['answer_s']} s. The whole answer is this flow run's "
                  f"result: `prefect flow-run inspect {answer['flow_run_id']}` names where it is stored.", ""]
    if what == "sequences":
        shared: dict[str, Any] = {}
        for result in answer["results"]:
            if isinstance(result, dict):
                shared.update({k: v for k, v in result.items() if k != "items" and _vector(v) is None
                               and getattr(v, "shape", None) is None})
        if shared:
            lines += ["Per request:", "", *_table(shared), ""]
        for number, (value, item) in enumerate(zip(asked.shown(), answer["items"], strict=True), 1):
            if number > SHOWN_INPUTS:
                lines.append(f"... and {len(asked.inputs) - SHOWN_INPUTS} more in the flow run's result")
                break
            lines += [_heading(number, value if isinstance(value, str) else describe(value)), ""]
            fields = {k: v for k, v in item.items() if k != "input"}
            if item.get("ok") is False:
                lines.append(f"**refused** ({escape_markdown(str(item.get('reason')))}): "
                             f"{escape_markdown(str(item.get('error')))}")
            else:
                lines += _table(fields) if fields else ["(the answer holds no item for this input)"]
            lines.append("")
        return "\n".join(lines)
    lines += ["Sent: " + code_span(describe(requests[0])), ""]
    for number, result in enumerate(answer["results"], 1):
        lines += [_heading(number, None), ""]
        items = result.get("items") if isinstance(result, dict) else None
        if isinstance(items, list) and all(isinstance(item, dict) for item in items):
            rest = {k: v for k, v in result.items() if k != "items"}
            lines += [*_table(rest), ""] if rest else []
            for at, item in enumerate(items[:SHOWN_INPUTS], 1):
                lines += [f"item {at}:", "", *_table(item), ""]
        elif isinstance(result, dict):
            lines += [*_table(result), ""]
        else:
            lines += [escape_markdown(describe(result)), ""]
    return "\n".join(lines)


@flow(name="predict", persist_result=True, log_prints=True)
def predict(provider: str = DEFAULT_PROVIDER, sequences: list[str] | None = None,
            payload: dict[str, Any] | None = None, priority: Priority = "interactive",
            kind: Literal["protein", "text"] | None = None):
    """Ask one provider: each sequence gets its own answer; or send one payload; or, with neither, its example.

    Args:
        provider: Which model answers (the providers of the worker's host).
        sequences: Protein sequences or texts, one per item; each gets its own answer. Sent as
            {"inputs": [...]}, 64 to a request. One the provider's input rule refuses (a digit in a protein, a
            blank item) fails alone, named by its position; the others are answered.
        payload: For a provider that does not take sequences: the request itself, as JSON (its [smoke] payload is
            the example). Leave empty, with no sequences, to send that example.
        priority: The class it waits in for a worker; a person at the UI is interactive (the host admission
            service may cap a class a user may not claim).
        kind: How the sequences are read: protein (residue letters, by the provider's [inputs] rule) or text.
            Default: the provider's first kind.
    """
    logger = get_run_logger()
    try:
        asked = _requests(provider, sequences, payload, kind or None)
    except ManifestError as error:  # one sentence on the run page, not a traceback
        logger.error("%s", error)
        return Failed(message=str(error))
    for why in asked.refused.values():
        logger.warning("%s: %s", provider, why)
    if not asked.requests:
        message = f"every input was refused: {'; '.join(asked.refused.values())}"
        logger.error("%s: %s", provider, message)
        return Failed(message=message[:1000])
    logger.info("%s: sending %s in %d request(s)", provider,
                f"{sum(len(r['inputs']) for r in asked.requests)} sequence(s)" if asked.what == "sequences"
                else asked.what, len(asked.requests))
    answer = predict_inputs(provider, asked.requests, str(default_manifests(None, *host_settings())), priority)
    answer.update({"provider": provider, "flow_run_pid": os.getpid(), "host": socket.gethostname(),
                   "flow_run_id": str(runtime.flow_run.id)})
    if asked.what == "sequences":
        answered = [item for request, result in zip(asked.requests, answer["results"], strict=True)
                    for item in per_input(result, len(request["inputs"]))]
        items = with_refused(answered, asked.kept, asked.refused, len(asked.inputs))
        answer["items"] = [{"input": value, **(item or {})} for value, item in zip(asked.shown(), items, strict=True)]
    create_markdown_artifact(markdown=markdown(provider, asked, answer), key=artifact_key("predict", provider),
                             description=escape_markdown(f"{provider}: the answer to {asked.what}, a table per input"))
    if asked.refused:
        first = next(iter(asked.refused.values()))
        return Completed(name=COMPLETED_WITH_FAILURES, data=answer,
                         message=f"{len(asked.kept)} answered, {len(asked.refused)} refused: {first}"[:1000])
    return answer


if __name__ == "__main__":
    predict()
