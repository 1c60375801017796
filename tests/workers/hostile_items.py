"""A provider's worker for campaigns whose answers are each legal alone and wrong for the output: a NaN from the
model (fp16 overflow), or an embedding of another size for one input."""
import base64
import importlib.util
import os
import struct
import sys

spec = importlib.util.spec_from_file_location("worker_base", os.environ["RESIDENT_POOL_WORKER_BASE"])
worker_base = importlib.util.module_from_spec(spec)
spec.loader.exec_module(worker_base)
import numpy  # noqa: E402


def on_predict(payload):
    items = []
    for text in payload["inputs"]:
        if os.path.basename(os.path.dirname(os.path.abspath(__file__))) == "nans":
            values = numpy.array([1.0, float("nan") if "W" in text else 2.0], dtype=numpy.float32)
            items.append({"length": len(text), "scores": values})
        else:
            dims = 3 if "W" in text else 4
            items.append({"length": len(text),
                          "embedding_f32": base64.b64encode(struct.pack(f"<{dims}f", *range(dims))).decode()})
    return {"items": items}


worker_base.serve(slug=os.path.basename(os.path.dirname(os.path.abspath(__file__))), socket_path=sys.argv[1],
                  on_predict=on_predict)
