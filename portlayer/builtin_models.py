"""``portlayer.builtin_models`` is portlayer.flatten.builtin_models (its stage's home); this name stays for existing code."""

import sys

from portlayer.flatten import builtin_models as _module

sys.modules[__name__] = _module
