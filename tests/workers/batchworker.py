"""A purpose-built batching worker for tests and the bench: ``serve(on_predict_batch=...)`` over dict payloads.

Loads worker_base by path, as a real provider does. One model call, for the payloads it is given:

- records itself, one JSON line per call (``tags``, ``size``, ``work``), in the file
  ``BATCHWORKER_CALLS`` names, before it does anything else;
- holds while an item's ``hold`` file does not exist (at most 30 s); sleeps ``--cost-ms`` plus ``--per-item-ms``
  per input (a model whose call costs a fixed overhead plus a little per input; an item stands for ``count``
  inputs, 1 by default: one client's request of many);
- raises ValueError naming the input when an item says ``poison`` (one bad input fails the whole call), and
  SystemExit with an item's ``exit`` code;
- answers ValueError for an item that says ``fail_alone`` (that request fails alone);
- answers every other item ``{"tag", "batch", "pid"}``, plus, for an item with an ``array``, that array and
  its elements in reverse order (``reversed``).

Options: ``--serial`` serves the same model one request per call (``on_predict``), for the bench's baseline;
``--size-of`` measures a request's work as its ``work`` field; ``--by-argument N W`` gives serve()
``max_batch_size=N, max_wait_ms=W`` (else the pool's variables, or the defaults, hold).
"""

import importlib.util
import json
import os
import sys
import time


def load(name, variable):
    spec = importlib.util.spec_from_file_location(name, os.environ[variable])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main():
    socket_path = sys.argv[1]
    options = sys.argv[2:]
    worker_base = load("worker_base", "RESIDENT_POOL_WORKER_BASE")
    cost_s = float(options[options.index("--cost-ms") + 1]) / 1000 if "--cost-ms" in options else 0.0
    per_item_s = float(options[options.index("--per-item-ms") + 1]) / 1000 if "--per-item-ms" in options else 0.0
    calls_file = os.environ.get("BATCHWORKER_CALLS")
    counts = {"calls": 0, "resets": 0, "releases": 0}
    real_release = worker_base.release_cublas_workspaces

    def counting_release():
        counts["releases"] += 1
        return real_release()

    worker_base.release_cublas_workspaces = counting_release

    def on_reset():
        counts["resets"] += 1

    def model(payloads):
        counts["calls"] += 1
        if calls_file:
            with open(calls_file, "a") as calls:
                calls.write(json.dumps({"tags": [p.get("tag") for p in payloads], "size": len(payloads),
                                        "work": sum(p.get("work", 1) for p in payloads)}) + "\n")
        for payload in payloads:
            if "hold" in payload:
                deadline = time.monotonic() + 30
                while not os.path.exists(payload["hold"]) and time.monotonic() < deadline:
                    time.sleep(0.005)
        if cost_s or per_item_s:
            time.sleep(cost_s + per_item_s * sum(payload.get("count", 1) for payload in payloads))
        for payload in payloads:
            if "exit" in payload:
                raise SystemExit(payload["exit"])
        poisoned = [payload.get("tag") for payload in payloads if payload.get("poison")]
        if poisoned:
            raise ValueError(f"poisoned input {poisoned[0]}")
        return [answer(payload, len(payloads)) for payload in payloads]

    def answer(payload, batch):
        if payload.get("fail_alone"):
            return ValueError(f"input {payload.get('tag')} cannot be embedded")
        result = {"tag": payload.get("tag"), "batch": batch, "pid": os.getpid()}
        if "array" in payload:
            result["array"] = payload["array"]
            result["reversed"] = payload["array"][::-1].copy()
        return result

    def ready():
        return dict(counts)

    common = {"slug": "batchworker", "socket_path": socket_path, "ready": ready, "on_reset": on_reset}
    if "--serial" in options:
        worker_base.serve(on_predict=lambda payload: model([payload])[0], **common)
        return
    shape = {}
    if "--size-of" in options:
        shape["size_of"] = lambda payload: payload.get("work", 1)
    if "--by-argument" in options:
        at = options.index("--by-argument")
        shape.update(max_batch_size=int(options[at + 1]), max_wait_ms=float(options[at + 2]))
    worker_base.serve(on_predict_batch=model, **common, **shape)


if __name__ == "__main__":
    main()
