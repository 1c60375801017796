"""A worker over toymodel that reports whether a kit patched it."""

import importlib.util
import os
import sys

import toymodel


def main():
    spec = importlib.util.spec_from_file_location("worker_base", os.environ["RESIDENT_POOL_WORKER_BASE"])
    worker_base = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker_base)
    watched = ("MODEL_OPT", "TOY", "LAUNCHKIT", "OMP_", "PYTORCH_", "SECRET", "TOYWEIGHTS")

    def ready():
        return {
            "patched": toymodel.PATCHED_BY,
            "argv": sys.argv,
            "env": {name: value for name, value in os.environ.items() if name.startswith(watched)},
        }

    worker_base.serve(slug=os.path.basename(os.path.dirname(sys.argv[0])) or "toy", socket_path=sys.argv[1],
                      on_predict=lambda payload: {"value": toymodel.predict(payload["x"])}, ready=ready)


if __name__ == "__main__":
    main()
