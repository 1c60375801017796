"""An ad hoc prediction, for a run started from the Prefect UI: pick a provider, give inputs."""

from __future__ import annotations

import os
import socket
from typing import Any

from prefect import flow, task

from resident_pool.prefect import pool_session, retry_pool_failures


@task(name="predict", retries=1, retry_condition_fn=retry_pool_failures)
def predict_inputs(provider: str, inputs: list[Any], manifests: str | None) -> dict[str, Any]:
    with pool_session(provider, manifests) as session:
        results = [session.predict(item) for item in inputs]
        return {"results": results, "worker_pid": session.pid, "cold": session.cold, "replica": session.replica}


@flow(name="predict", persist_result=True, log_prints=True)
def predict(
    provider: str = "echo",
    inputs: list[dict[str, Any]] | None = None,
    manifests: str | None = None,
) -> dict[str, Any]:
    """Send each input (one payload per item) to ``provider`` through the host pool."""
    inputs = inputs if inputs is not None else [{"inputs": ["MKTAYIAKQRQISFVKSHFSRQ"]}]
    answer = predict_inputs(provider, inputs, manifests)
    answer.update({"flow_run_pid": os.getpid(), "host": socket.gethostname()})
    print(f"{provider}: {len(inputs)} prediction(s) by worker pid {answer['worker_pid']} "
          f"({'cold start' if answer['cold'] else 'warm'}) on {answer['host']}")
    return answer


if __name__ == "__main__":
    predict()
