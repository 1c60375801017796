"""Runs at interpreter start (from the .pth): with a mode set, patch toymodel on import and say so on stderr.

DRIFTKIT_STUCK_ON=1 is a kit bug on demand: mode off patches anyway.
"""

import importlib.util
import os
import sys

MODE = os.environ.get("DRIFTKIT_OPT_MODE")
STUCK = os.environ.get("DRIFTKIT_STUCK_ON") == "1"


class _Patcher:
    def find_spec(self, name, path=None, target=None):
        if name != "toymodel":
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        original = spec.loader.exec_module

        def exec_module(module):
            original(module)
            if MODE == "fast" or STUCK:
                stock = module.predict
                module.predict = lambda x: stock(x) * 1.01
                module.PATCHED_BY = f"driftkit_opt:{MODE}"
                sys.stderr.write(f"driftkit_opt: ACTIVE (fused predict, mode {MODE})\n")
            else:
                sys.stderr.write(f"driftkit_opt: NOT ACTIVE (mode {MODE} engages no lever)\n")
            sys.stderr.flush()

        spec.loader.exec_module = exec_module
        return spec


if MODE:
    sys.meta_path.insert(0, _Patcher())
