"""The kit's import hook: armed at interpreter start when LAUNCHKIT_OPT_MODE is set (the .pth), or by
worker_launch. Armed twice it refuses, as a real kit's hook does (boltz2's exits 3 when boltz imports)."""

import os
import sys

ARMED_BY = []


def arm(by):
    ARMED_BY.append(by)
    if len(ARMED_BY) > 1:
        sys.stderr.write(f"launchkit_opt: REFUSED: import hook armed twice ({' and '.join(ARMED_BY)})\n")
        sys.stderr.flush()
        os._exit(3)


if os.environ.get("LAUNCHKIT_OPT_MODE"):
    arm("LAUNCHKIT_OPT_MODE")
