"""``python -m portlayer`` (what ``torchrun --nproc-per-node N -m portlayer run ART`` starts on each rank)."""

import sys

from portlayer.cli import main

if __name__ == "__main__":
    sys.exit(main())
