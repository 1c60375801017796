"""A test worker for arrays beside the line: standard library only, numpy used when importable.

Per-request behaviour from the payload's ``action``; loads worker_base by path,
as a real provider does (run with ``python -S`` it has no numpy).
"""

import hashlib
import importlib.util
import os
import sys
import threading
import time


def load(name, variable):
    spec = importlib.util.spec_from_file_location(name, os.environ[variable])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main():
    socket_path = sys.argv[1]
    worker_base = load("worker_base", "RESIDENT_POOL_WORKER_BASE")
    Array = worker_base.load_arrays().Array

    def raw(value):
        """The bytes of an array of either kind, read in place."""
        if isinstance(value, bytes):
            return memoryview(value)
        if isinstance(value, Array):
            return value.data
        return memoryview(value).cast("B")

    kept = {}

    def on_predict(payload):
        action = payload.get("action", "echo")
        value = payload.get("value")
        if action == "keep":  # hold on to what was received, past the request
            kept["value"] = value
            return {"sha256": hashlib.sha256(raw(value)).hexdigest()}
        if action == "kept":  # what the array held since still reads
            return {"sha256": hashlib.sha256(raw(kept["value"])).hexdigest()}
        if action == "slow":  # read the array, wait, read it again
            first = hashlib.sha256(raw(value)).hexdigest()
            time.sleep(payload["sleep_s"])
            return {"same": hashlib.sha256(raw(value)).hexdigest() == first}
        if action == "build":  # an answer built where its reply goes (numpy, or torch when asked)
            dtype = payload.get("dtype", "uint8")
            if payload.get("torch"):
                import torch

                dtype = getattr(torch, dtype)
            out = worker_base.empty(payload["shape"], dtype)
            out.fill(payload["fill"]) if hasattr(out, "fill") else out.fill_(payload["fill"])
            return {"value": out, "type": type(out).__module__.split(".")[0]}
        if action == "scribble":  # answer, then keep changing the answer's memory from another thread
            out = worker_base.empty(payload["shape"], "uint8")
            out.fill(1)

            def scribble():
                deadline = time.monotonic() + payload["for_s"]
                while time.monotonic() < deadline:
                    out.fill(2)
                    out.fill(3)

            threading.Thread(target=scribble, daemon=True).start()
            return {"value": out}
        if action == "echo":
            return {"value": value, "pid": os.getpid()}
        if action == "describe":
            return {"type": type(value).__name__, "numpy": "numpy" in sys.modules,
                    "sha256": hashlib.sha256(raw(value)).hexdigest()}
        if action == "make":  # a fresh array filled with the bytes given
            pattern = bytes.fromhex(payload["hex"])
            data = (pattern * (payload["nbytes"] // len(pattern) + 1))[: payload["nbytes"]]
            if payload["dtype"] == "bytes":
                return {"value": data}
            made = Array(data, payload["dtype"], payload["shape"])
            if "numpy" in sys.modules:
                import numpy

                made = numpy.array(made)  # a copy the worker owns, not a view of `data`
            return {"value": made, "pid": os.getpid()}
        if action == "view":  # hand back a view of the received array (numpy workers only)
            import numpy

            how = payload["how"]
            if how == "byteswapped":  # the same bytes read big-endian: other values
                out = value.view(value.dtype.newbyteorder(">"))
            elif how == "big-endian copy":  # the same values, stored big-endian
                out = value.astype(value.dtype.newbyteorder(">"))
            elif how == "misaligned":  # int16 read from byte 1 of a received uint8 buffer (a packed format)
                out = value[1:].view(numpy.int16)
            else:
                raise ValueError(f"unknown view {how!r}")
            return {"value": out, "sum": float(out.astype("float64").sum()), "first": out[:4].tolist()}
        if action == "die":  # read the mapped buffer, then die holding it
            hashlib.sha256(raw(value)).hexdigest()
            os._exit(9)
        raise ValueError(f"unknown action {action!r}")

    worker_base.serve(slug=os.environ.get("TESTWORKER_SLUG", "arrays"), socket_path=socket_path,
                      on_predict=on_predict)


if __name__ == "__main__":
    main()
