"""``python -m bench.blend``: see bench/blend/run.py."""

from bench.blend.run import main

if __name__ == "__main__":
    main()
