"""``python -m bench.tiers``: see bench/tiers/run.py."""

import sys

from bench.tiers.run import main

if __name__ == "__main__":
    sys.exit(main())
