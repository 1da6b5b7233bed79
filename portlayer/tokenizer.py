"""``portlayer.tokenizer`` is portlayer.flatten.tokenizer (its stage's home); this name stays for existing code."""

import sys

from portlayer.flatten import tokenizer as _module

sys.modules[__name__] = _module
