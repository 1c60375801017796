"""python -m optlesskit_opt.worker_launch <opts> -- <script> <args>: run the script under a kernel route.

Importing it does nothing (the probe imports it to learn the kit engages this way); only __main__ runs.
"""

import os
import runpy
import sys


def main():
    args = sys.argv[1:]
    split = args.index("--")
    options, script = args[:split], args[split + 1 :]
    route = options[options.index("--route") + 1]
    from optlesskit_opt import _hook

    _hook.arm("worker_launch")
    os.environ["LAUNCHKIT_ROUTE"] = route
    import toymodel  # patched before the worker script imports it

    toymodel.PATCHED_BY = f"optlesskit_opt:{route}"
    sys.argv = script
    runpy.run_path(script[0], run_name="__main__")


if __name__ == "__main__":
    main()
