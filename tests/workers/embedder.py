"""A fast stand-in for an embedding model: {"inputs": [str]} -> {"items": [...]}.

"RAISE" in an input makes the request fail (the model refusing an input);
"DIE-ONCE" kills the worker the first time it is seen ($EMBEDDER_MARKER records it).
"""

import importlib.util
import os
import sys


def main():
    spec = importlib.util.spec_from_file_location("worker_base", os.environ["RESIDENT_POOL_WORKER_BASE"])
    worker_base = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker_base)
    marker = os.environ.get("EMBEDDER_MARKER", "")

    def on_predict(payload):
        inputs = payload["inputs"]
        if any("RAISE" in text for text in inputs):
            raise ValueError("input contains RAISE")
        if marker and any("DIE-ONCE" in text for text in inputs) and not os.path.exists(marker):
            open(marker, "w").close()
            os._exit(9)
        items = [{"embedding": [len(text), sum(map(ord, text)) % 997], "tokens": len(text)} for text in inputs]
        return {"items": items, "pid": os.getpid()}

    worker_base.serve(slug="embedder", socket_path=sys.argv[1], on_predict=on_predict)


if __name__ == "__main__":
    main()
