"""The tiers bench, ``python -m bench.tiers --out F.json [--quick]``: run.py (every tier against the same
library called directly, and the JSON), passes.py (timed passes over the blocks), baselines.py (the direct
clients), disk.py (lmdb warm and cold) with page_cache.py (dropping and reading around the page cache),
daemon.py (the daemon against redis-py, 4-client scaling; ``python -m bench.tiers.daemon``), figures.py.
"""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.tiers`` (bench/tiers/run.py), imported when called so that importing one part
    of the bench does not load all of it."""
    from bench.tiers.run import main as run

    return run(argv)
