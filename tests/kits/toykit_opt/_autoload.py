"""Runs at interpreter start (from the .pth): police the namespace, then patch on import."""

import importlib.util
import os
import sys

ENV = "TOYKIT_OPT_MODE"  # the mode variable, found by the probe on ._autoload
KNOWN = {ENV, "TOYKIT_OPT_TRACE"}
stray = sorted(name for name in os.environ if name.startswith("TOYKIT_OPT_") and name not in KNOWN)
if stray:
    sys.stderr.write(f"toykit_opt: REFUSED: undeclared variables {', '.join(stray)}\n")
    sys.stderr.flush()
    os._exit(3)

MODE = os.environ.get(ENV)


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
            module.PATCHED_BY = f"toykit_opt:{MODE}"  # a patch that leaves the numbers as they were
            sys.stderr.write(f"toykit_opt: ACTIVE (patched toymodel, mode {MODE})\n")
            sys.stderr.flush()

        spec.loader.exec_module = exec_module
        return spec


if MODE:
    sys.meta_path.insert(0, _Patcher())
