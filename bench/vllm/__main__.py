"""``python -m bench.vllm``: see bench/vllm/run.py."""

import sys

from bench.vllm.run import main

if __name__ == "__main__":
    sys.exit(main())
