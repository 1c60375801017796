"""A fast stand-in for an embedding model: {"inputs": [str]} -> {"items": [...]}.

"RAISE" in an input makes the request fail (the model refusing an input);
"DIE-ONCE" kills the worker the first time it is seen ($EMBEDDER_MARKER records it).
$EMBEDDER_COUNT names a file that gets one line per request: how many inputs it computed.
$EMBEDDER_DELAY_S makes each request take that long (a campaign slow enough to be killed halfway).
"""

import importlib.util
import os
import sys
import time


def main():
    spec = importlib.util.spec_from_file_location("worker_base", os.environ["RESIDENT_POOL_WORKER_BASE"])
    worker_base = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker_base)
    marker = os.environ.get("EMBEDDER_MARKER", "")
    count = os.environ.get("EMBEDDER_COUNT", "")
    delay = float(os.environ.get("EMBEDDER_DELAY_S") or 0)

    def on_predict(payload):
        inputs = payload["inputs"]
        if any("RAISE" in text for text in inputs):
            raise ValueError("input contains RAISE")
        if marker and any("DIE-ONCE" in text for text in inputs) and not os.path.exists(marker):
            open(marker, "w").close()
            os._exit(9)
        if delay:
            time.sleep(delay)
        items = [{"embedding": [len(text), sum(map(ord, text)) % 997], "tokens": len(text)} for text in inputs]
        if count:
            with open(count, "a") as log:
                log.write(f"{len(inputs)}\n")
        return {"items": items, "pid": os.getpid()}

    worker_base.serve(slug="embedder", socket_path=sys.argv[1], on_predict=on_predict)


if __name__ == "__main__":
    main()
