"""``python -m bench.serve``: see bench/serve/run.py."""

import sys

from bench.serve.run import main

if __name__ == "__main__":
    sys.exit(main())
