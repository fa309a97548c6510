"""The CacheBlend bench, ``python -m bench.blend --out F.json [--quick]``: run.py (the quality curve by
ratio, the default ratio, TTFT), data.py (the cases), quality.py (blended against full prefill), figures.py;
compare.py (``python -m bench.blend.compare``: selection strategies side by side).
"""

from __future__ import annotations


def main(argv: list[str] | None = None) -> dict:
    """``python -m bench.blend`` (bench/blend/run.py), imported when called so that importing one part
    of the bench does not load all of it."""
    from bench.blend.run import main as run

    return run(argv)
