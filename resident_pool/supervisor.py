"""``resident_pool.supervisor``, the name the spec gives; the module lives in ``resident_pool.providers.supervisor``."""

import sys

from .providers import supervisor as _module

sys.modules[__name__] = _module
