"""A provider's worker script as the original design's providers write it (standard library only)."""

import importlib.util
import os
import sys
import time


def _load_by_path(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main():
    socket_path = sys.argv[1]
    if "--await-orphan" in sys.argv:
        # Hand-run and orphaned before the base is even imported: its parent is gone already.
        while os.getppid() != 1:
            time.sleep(0.01)
    wb = _load_by_path("_tu_worker_base", os.environ["TOOLUNIVERSE_REMOTE_WORKER_BASE"])
    P = wb.protocol()
    releases = []
    real_release = wb.release_cublas_workspaces

    def counting_release():
        releases.append(1)
        return real_release()

    wb.release_cublas_workspaces = counting_release

    def on_predict(req):
        # The request dict itself: its fields are the input.
        sequence = req["sequence"]
        if req.get("fail"):
            raise ValueError(f"cannot fold {sequence!r}")
        if req.get("exit") is not None:
            raise SystemExit(req["exit"])
        answer = {"length": len(sequence), "reversed": sequence[::-1], "keys": sorted(req), "pid": os.getpid()}
        if req.get("report"):
            answer["report"] = ready()
        return answer

    def ready():
        kits = {name.split(".")[0]: getattr(module, "STATUS", None) for name, module in list(sys.modules.items())
                if name.endswith("_opt._autoload")}
        return {
            "releases": len(releases),
            "ops": [P.OP_PING, P.OP_PREDICT, P.OP_SHUTDOWN],
            "names": {"PROTOCOL_ENV": wb.PROTOCOL_ENV, "ORPHAN_GRACE_ENV": wb.ORPHAN_GRACE_ENV,
                      "NO_CUBLAS_RELEASE_ENV": wb.NO_CUBLAS_RELEASE_ENV,
                      "DEFAULT_ORPHAN_GRACE_S": wb.DEFAULT_ORPHAN_GRACE_S},
            "bootstrap_serves": callable(getattr(wb.bootstrap(__file__), "serve", None)),
            "kits": kits,
            "argv": sys.argv,
            "env": {k: v for k, v in os.environ.items() if k.startswith(("MODEL_OPT", "TOOLUNIVERSE_", "STACKLESS",
                                                                         "RESOLVING", "LAUNCHING", "PROXIED"))},
            "resident_pool_importable": importlib.util.find_spec("resident_pool") is not None,
        }

    wb.serve(slug=os.path.basename(os.path.dirname(os.path.abspath(__file__))), socket_path=socket_path,
             on_predict=on_predict, ready=ready)


if __name__ == "__main__":
    main()
