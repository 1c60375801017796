"""The call-path bench's array provider: echoes, reads or copies the array it is given.

Payload {"x": array, "mode": "echo" | "read" | "copy"}: "echo" returns the
array it received (the worker passes the received descriptor on), "read" reads
every byte of it in place (a sum over its 8-byte words) and returns the sum,
"copy" returns a new array of the same bytes (what a model's fresh output costs), built
with worker_base.empty_like where its reply goes, as a provider's worker would.
"""

import importlib.util
import os
import sys

import numpy


def checksum(array):
    """Read every byte: a sum over 8-byte words (bytes when the size is not a multiple of 8)."""
    flat = array.reshape(-1).view(numpy.uint8)
    words = flat[: len(flat) // 8 * 8].view(numpy.uint64)
    return int(words.sum(dtype=numpy.uint64)) + int(flat[len(words) * 8:].sum())


def main():
    spec = importlib.util.spec_from_file_location("worker_base", os.environ["RESIDENT_POOL_WORKER_BASE"])
    worker_base = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker_base)

    def on_predict(payload):
        x, mode = payload.get("x"), payload.get("mode", "echo")
        if mode == "read":
            return {"sum": checksum(x), "nbytes": int(x.nbytes)}
        if mode == "copy":
            out = worker_base.empty_like(x)
            numpy.copyto(out, x)
            return {"x": out}
        return {"x": x}

    worker_base.serve(slug="arrays", socket_path=sys.argv[1], on_predict=on_predict)


if __name__ == "__main__":
    main()
