"""The sizing advisor's bench, ``python -m bench.advise --out F.json [--quick]``: run.py (its miss-ratio
curves against a replay through the real TieredStore; the JSON) and workloads.py (the synthetic cyclic,
Zipfian and chat workloads, and the replay).
"""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.advise`` (bench/advise/run.py), imported when called so that importing one part
    of the bench does not load all of it."""
    from bench.advise.run import main as run

    return run(argv)
