"""Calling code written to the original design's supervisor."""

import sys
import threading

from resident_pool.supervisor import ResidentWorker


def command_for(script, python=sys.executable, remove=()):
    """A build_command: the model environment's interpreter runs the worker script; ``remove`` names go."""

    def build(worker):
        extra = {name: None for name in remove}
        extra["ORIGINAL_CALLER"] = "1"
        return [python, script, worker.socket_path], extra

    return build


def fold_all(worker, sequences):
    """Several threads, one worker: each queues on its lock and reads the result from the reply."""
    results = {}
    errors = []

    def fold(sequence):
        try:
            with worker.lock:
                reply = worker.request({"op": "predict", "sequence": sequence})
                results[sequence] = reply["result"]
        except Exception as exc:  # recorded for the caller to see
            errors.append(exc)

    threads = [threading.Thread(target=fold, args=(s,)) for s in sequences]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    return results, errors


def worker_for(script, python=sys.executable, remove=(), **kwargs):
    return ResidentWorker("origin", command_for(script, python, remove), **kwargs)
