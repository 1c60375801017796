"""``python -m launching_opt.worker_launch --route R --attach A -- <script> <args>``: run a script under a route."""

import os
import runpy
import sys


def main():
    args = sys.argv[1:]
    split = args.index("--")
    options, script = args[:split], args[split + 1:]
    if os.environ.get("LAUNCHING_OPT"):
        sys.stderr.write("[launching-opt] REFUSED: the mode variable would arm the hook a second time\n")
        sys.exit(3)
    os.environ["LAUNCHING_ROUTE"] = options[options.index("--route") + 1]
    sys.argv = script
    runpy.run_path(script[0], run_name="__main__")


if __name__ == "__main__":
    main()
