"""``portlayer.loaded`` is portlayer.runtime.loaded (its stage's home); this name stays for existing code."""

import sys

from portlayer.runtime import loaded as _module

sys.modules[__name__] = _module
