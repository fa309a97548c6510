"""``python -m bench.advise``: see bench/advise/run.py."""

from bench.advise.run import main

if __name__ == "__main__":
    raise SystemExit(main())
