"""At interpreter start (the .pth): police the namespace; with the mode variable set, engage."""

import os
import sys

ENV = "STACKLESS_OPT"
stray = sorted(name for name in os.environ if name.startswith(ENV + "_"))
if stray:
    sys.stderr.write(f"[stackless-opt] NOT ACTIVE: reason=undeclared variable(s) {', '.join(stray)}\n")
    sys.stderr.flush()
    os._exit(3)

MODE = os.environ.get(ENV)
STATUS = None
if MODE:
    STATUS = "PARTIAL" if "MODEL_OPT_LEVERS_OFF" in os.environ else "ACTIVE"
    sys.stderr.write(f"[stackless-opt] {STATUS}: mode={MODE}\n")
