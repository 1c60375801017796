"""An ad hoc prediction, for a run started from the Prefect UI: pick a provider, give inputs (or none).

With no inputs the provider's ``[smoke]`` payload is sent, so a bare run from
the UI shows what the provider answers. The answer is shown on the run's page
as a markdown artifact (a flow's return value is not displayed in the UI).
"""

from __future__ import annotations

import json
import math
import os
import socket
from typing import Any

from prefect import flow, task
from prefect.artifacts import create_markdown_artifact
from prefect.states import Failed

from resident_pool import arrays
from resident_pool.client import default_manifests
from resident_pool.errors import ManifestError
from resident_pool.prefect import Priority, artifact_key, pool_session, retry_pool_failures
from resident_pool.providers.manifest import load_manifest, manifest_path

SHOWN_INPUTS = 20  # answers shown in the artifact; the flow's result keeps them all
SHOWN_CHARS = 4000  # per answer: an embedding's 384 floats fit, a structure file does not
SHOWN_VALUES = 8  # of an array in an answer: its dtype and shape say the rest


@task(name="predict", retries=1, retry_condition_fn=retry_pool_failures)
def predict_inputs(provider: str, inputs: list[Any], manifests: str | None, priority: str = "interactive"
                   ) -> dict[str, Any]:
    with pool_session(provider, manifests, priority=priority) as session:
        results = [session.predict(item) for item in inputs]
        return {"results": results, "worker_pid": session.pid, "cold": session.cold, "replica": session.replica}


def _inputs_or_smoke(provider: str, inputs: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    path = manifest_path(default_manifests(), provider)  # a whole name, never a path: it names the artifact too
    if inputs:
        return inputs
    manifest = load_manifest(path)
    if not manifest.smoke.payload:
        raise ManifestError(f"{provider}: no inputs were given and its manifest has no [smoke] payload to send; "
                            "give inputs", slug=provider)
    return [manifest.smoke.payload]


def _shown(value: Any) -> Any:
    """An array in an answer as a line of text (its dtype, shape and first values); bytes by their size."""
    if isinstance(value, bytes | bytearray | memoryview):
        return f"<{len(value)} bytes>"
    shape = getattr(value, "shape", None)
    if isinstance(shape, tuple) and hasattr(value, "tolist"):
        flat = value.reshape(-1) if hasattr(value, "reshape") else None
        first = flat[:SHOWN_VALUES].tolist() if flat is not None else []
        more = ", ..." if math.prod(shape) > len(first) else ""
        values = f": {', '.join(map(str, first))}{more}" if first else ""
        return f"<{value.dtype} array, shape {list(shape)}{values}>"
    return arrays.plain(value)  # a numpy scalar as its number; anything else is refused by name


def _markdown(provider: str, inputs: list[Any], answer: dict[str, Any]) -> str:
    warmth = "cold start" if answer["cold"] else "warm"
    lines = [f"## {provider}: {len(inputs)} prediction(s)", "",
             f"worker pid {answer['worker_pid']} (replica {answer['replica']}, {warmth}) on {answer['host']}", ""]
    for number, (payload, result) in enumerate(zip(inputs, answer["results"], strict=True)):
        if number == SHOWN_INPUTS:
            lines.append(f"... and {len(inputs) - SHOWN_INPUTS} more in the flow run's result")
            break
        text = json.dumps(result, indent=1, default=_shown)
        if len(text) > SHOWN_CHARS:
            text = text[:SHOWN_CHARS] + f"\n... ({len(text)} characters in all)"
        lines += [f"### input {number}", "", "```json", json.dumps(payload, default=_shown)[:SHOWN_CHARS], "```", "",
                  "answer:", "", "```json", text, "```", ""]
    return "\n".join(lines)


@flow(name="predict", persist_result=True, log_prints=True)
def predict(provider: str = "echo", inputs: list[dict[str, Any]] | None = None, priority: Priority = "interactive"):
    """Send each input (one payload per item) to ``provider``; none: its ``[smoke]`` payload.

    The providers are those of ``$RESIDENT_POOL_MANIFESTS`` (in the worker's own environment).
    ``priority``: the class it waits in for a worker; a person at the UI is ``interactive`` (the host admission
    service may cap a class a user may not claim).
    """
    try:
        inputs = _inputs_or_smoke(provider, inputs)
    except ManifestError as error:  # one sentence on the run page, not a traceback
        return Failed(message=str(error))
    answer = predict_inputs(provider, inputs, None, priority)
    answer.update({"flow_run_pid": os.getpid(), "host": socket.gethostname()})
    create_markdown_artifact(markdown=_markdown(provider, inputs, answer), key=artifact_key("predict", provider),
                             description=f"{provider}: {len(inputs)} prediction(s)")
    print(f"{provider}: {len(inputs)} prediction(s) by worker pid {answer['worker_pid']} "
          f"({'cold start' if answer['cold'] else 'warm'}) on {answer['host']}")
    return answer


if __name__ == "__main__":
    predict()
