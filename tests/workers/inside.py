"""A worker for container tests: says what it sees from inside (its environment, which paths exist)."""

import importlib.util
import os
import signal
import sys
import time


def main():
    if "--ignore-term" in sys.argv:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    spec = importlib.util.spec_from_file_location("worker_base", os.environ["RESIDENT_POOL_WORKER_BASE"])
    worker_base = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker_base)

    def writable(path):
        try:
            with open(os.path.join(path, f".probe-{os.getpid()}"), "w") as handle:
                handle.write("x")
        except OSError:
            return False
        os.unlink(os.path.join(path, f".probe-{os.getpid()}"))
        return True

    def on_predict(payload):
        action = payload.get("action", "echo")
        if action == "env":
            return {"env": dict(os.environ), "pid": os.getpid()}
        if action == "exists":
            return {path: os.path.exists(path) for path in payload["paths"]}
        if action == "writable":
            return {path: writable(path) for path in payload["paths"]}
        if action == "sleep":
            time.sleep(float(payload["seconds"]))
        return {"echo": payload, "pid": os.getpid()}

    worker_base.serve(slug="inside", socket_path=sys.argv[1], on_predict=on_predict)


if __name__ == "__main__":
    main()
