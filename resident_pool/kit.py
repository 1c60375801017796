"""``resident_pool.kit``, the name the spec gives; the module lives in ``resident_pool.providers.kit``."""

import sys

from .providers import kit as _module

sys.modules[__name__] = _module
