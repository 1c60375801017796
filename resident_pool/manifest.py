"""``resident_pool.manifest``, the name the spec gives; the module lives in ``resident_pool.providers.manifest``."""

import sys

from .providers import manifest as _module

sys.modules[__name__] = _module
