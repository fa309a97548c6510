"""The end-to-end bench, ``python -m bench.e2e --out F.json [--quick]``: run.py (the sections and the
JSON), support.py (the Bench: model, engines, daemons, timed runs), headline.py (TTFT by tier, replicas),
grid.py (the cost model around its crossover), workloads.py (chat and document QA), figures.py.
"""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.e2e`` (bench/e2e/run.py), imported when called so that importing one part
    of the bench does not load all of it."""
    from bench.e2e.run import main as run

    return run(argv)
