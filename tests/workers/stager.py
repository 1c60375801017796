"""A worker with a load stage: ``load()`` runs in the zygote when the manifest names it, else here.

argv: <socket> <weights_root>. Each answer says who loaded its "model" and whether it was staged.
"""

import importlib.util
import os
import sys


def load(weights_root):
    """The load stage: what a real provider would read into host memory before the fork."""
    return {"loaded_by": os.getpid(), "weights_root": weights_root}


def main():
    spec = importlib.util.spec_from_file_location("worker_base", os.environ["RESIDENT_POOL_WORKER_BASE"])
    worker_base = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker_base)
    staged = worker_base.staged()
    model = staged if staged is not None else load(sys.argv[2])

    def on_predict(payload):
        return {"model": model, "staged": staged is not None, "pid": os.getpid()}

    worker_base.serve(slug="stager", socket_path=sys.argv[1], on_predict=on_predict)


if __name__ == "__main__":
    main()
