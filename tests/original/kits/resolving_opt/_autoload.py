import os
import sys

from .modes import ENV

stray = sorted(name for name in os.environ if name.startswith(ENV + "_"))
if stray:
    sys.stderr.write(f"[resolving-opt] NOT ACTIVE: reason=undeclared variable(s) {', '.join(stray)}\n")
    sys.stderr.flush()
    os._exit(3)

MODE = os.environ.get(ENV)
STATUS = None
if MODE:
    STATUS = "PARTIAL" if "MODEL_OPT_LEVERS_OFF" in os.environ else "ACTIVE"
    sys.stderr.write(f"[resolving-opt] {STATUS}: mode={MODE} levers_off={os.environ.get('MODEL_OPT_LEVERS_OFF')!r}\n")
