"""The echo provider: replies with its payload (and its pid), after an optional delay."""

import importlib.util
import os
import sys
import time


def main():
    spec = importlib.util.spec_from_file_location("worker_base", os.environ["RESIDENT_POOL_WORKER_BASE"])
    worker_base = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker_base)

    def on_predict(payload):
        if isinstance(payload, dict) and payload.get("sleep_s"):
            time.sleep(float(payload["sleep_s"]))
        return {"echo": payload, "pid": os.getpid()}

    worker_base.serve(slug=os.environ.get("ECHO_SLUG", "echo"), socket_path=sys.argv[1], on_predict=on_predict)


if __name__ == "__main__":
    main()
