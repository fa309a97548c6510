"""When requests are sent and in which order the modes run: seeded Poisson arrivals and the
per-run rotation of the modes (pure functions; tests/bench/serve/test_schedule.py).

A point's arrivals are a Poisson process conditioned on its count: exactly ``round(qps * span)``
sends in each span (the warm-up, the measured window), at seeded uniform random times, which is
how a Poisson process's arrivals lie once their number is known (its gaps are still ~exponential,
bursts and lulls included). So a point is the same sequence of sends in every mode of a run, and
the rate a knee is reported at is the rate the window was sent at: left to chance, a 60 s window
of "0.5 req/s" sent anywhere from 0.38 to 0.58/s in one quick run, and the knee took that noise.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def poisson_offsets(qps: float, duration_s: float, seed: int, warmup_s: float = 0.0) -> list[float]:
    """Send times in [0, warmup_s + duration_s), sorted: ``round(qps * warmup_s)`` of them in the
    warm-up and ``round(qps * duration_s)`` in the window after it, each span's at uniform random
    times (a Poisson process of rate ``qps`` given its count; seeded)."""
    if qps <= 0 or duration_s <= 0 or warmup_s < 0:
        raise ValueError(f"qps and duration must be > 0 and the warm-up >= 0 (got {qps}, {duration_s}, {warmup_s})")
    rng = np.random.default_rng(seed)
    out: list[float] = []
    for start, span in ((0.0, warmup_s), (warmup_s, duration_s)):
        out += sorted(start + float(t) for t in rng.uniform(0.0, span, size=round(qps * span)))
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
