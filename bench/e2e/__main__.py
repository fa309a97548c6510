"""``python -m bench.e2e``: see bench/e2e/run.py."""

import sys

from bench.e2e.run import main

if __name__ == "__main__":
    sys.exit(main())
