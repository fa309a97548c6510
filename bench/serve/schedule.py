"""When requests are sent and in which order the modes run: seeded Poisson arrivals and the
per-run rotation of the modes (pure functions; tests/bench/serve/test_schedule.py).

Arrivals are a Poisson process: exponential gaps of mean ``1 / qps`` from a seeded generator, so
a point is the same sequence of sends in every mode and every run that uses the same seed, and
the number of sends over ``duration_s`` is ``qps * duration_s`` in expectation (not exactly: a
point's completed/s is compared with the rate it was *offered*, measured from its own arrivals).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def poisson_offsets(qps: float, duration_s: float, seed: int) -> list[float]:
    """Send times in [0, duration_s) of a Poisson process of rate ``qps`` (seeded)."""
    if qps <= 0 or duration_s <= 0:
        raise ValueError(f"qps and duration must be > 0 (got {qps}, {duration_s})")
    rng = np.random.default_rng(seed)
    out: list[float] = []
    t = float(rng.exponential(1 / qps))
    while t < duration_s:
        out.append(t)
        t += float(rng.exponential(1 / qps))
    return out


def poisson_count(qps: float, n: int, seed: int) -> list[float]:
    """The first ``n`` send times of a Poisson process of rate ``qps`` (seeded), the first at 0."""
    if qps <= 0 or n <= 0:
        raise ValueError(f"qps and n must be > 0 (got {qps}, {n})")
    gaps = np.random.default_rng(seed).exponential(1 / qps, size=n - 1)
    return [0.0, *np.cumsum(gaps).tolist()]


def rotated(modes: Sequence[str], run: int) -> list[str]:
    """The modes in run ``run``'s order: the list turned left by ``run`` places, so that over as
    many runs as modes each mode runs once in each position (none always after the same one)."""
    if not modes:
        return []
    k = run % len(modes)
    return [*modes[k:], *modes[:k]]
