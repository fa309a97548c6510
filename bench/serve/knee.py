"""Capacity as capacity: the pass rule of one load point and the search for the knee (pure;
tests/bench/serve/test_knee.py).

A point offered at ``offered_qps`` passes only if it completed at least ``COMPLETED_SHARE`` of what
was sent per second (less one request over the window: ``passes``) (a server that falls behind answers later and later: its completed/s stays
below the offered rate however its TTFT looks) and its TTFT p90 is within the SLO. The knee is
found by walking a grid upward to the first failing point, then bisecting between the last
passing and the first failing point: the capacity is the highest rate that passed, with the
bracket it lies in (``capped``: the top of the grid passed, so the knee is at least that).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

COMPLETED_SHARE = 0.9  # completed/s must be >= 90% of the rate sent ...
SLACK_REQUESTS = 1  # ... less one request over the window: counts are whole requests


def passes(point: Mapping[str, Any], slo_s: float, share: float = COMPLETED_SHARE,
           slack: int = SLACK_REQUESTS) -> bool:
    """completed/s >= ``share`` x sent/s - ``slack`` requests over the window (``duration_s``; no
    slack without it) and TTFT p90 <= SLO (NaN fails both).

    Why the slack: the window's completions are those that finished in it, so the requests sent
    in its last seconds (still answering at its end) are traded against the warm-up's that
    finished in its first: two Poisson counts of rate x latency each. At 0.125 req/s over 60 s
    (8 sent) one answer that crossed the end is 12%, and a server answering every request in
    1.5 s failed the 90% rule on it alone (bench.serve --quick, radix at 0.125 req/s: 7 of 8).
    At rates where 10% is many requests one request changes nothing; a server that falls behind
    also fails the TTFT SLO as its queue grows."""
    done, sent, p90 = point["completed_per_s"], point["sent_per_s"], point["ttft_p90_s"]
    if any(math.isnan(x) for x in (done, sent, p90)) or sent <= 0:
        return False
    window = point.get("duration_s") or math.inf
    return done >= share * sent - slack / window and p90 <= slo_s


@dataclass
class Knee:
    qps: float  # the highest rate that passed (0: none did)
    lo: float  # the bracket: lo passed (or 0), hi failed (inf when capped)
    hi: float
    capped: bool
    tried: list[tuple[float, bool, str]] = field(default_factory=list)  # (qps, passed, "grid" | "bisect")


def find_knee(measure: Callable[[float, str], bool], grid: Sequence[float], bisect_steps: int) -> Knee:
    """Walk ``grid`` (ascending) until a point fails, then bisect ``bisect_steps`` times between the
    last rate that passed (0 if none) and the first that failed. ``measure(qps, phase)`` runs one
    point and says whether it passed."""
    if not grid or list(grid) != sorted(grid) or grid[0] <= 0:
        raise ValueError(f"the grid must be ascending and > 0: {grid}")
    knee = Knee(0.0, 0.0, math.inf, False)
    for q in grid:
        ok = measure(q, "grid")
        knee.tried.append((q, ok, "grid"))
        if not ok:
            knee.hi = q
            break
        knee.lo = knee.qps = q
    else:
        knee.capped = True
        return knee
    for _ in range(bisect_steps):
        mid = (knee.lo + knee.hi) / 2
        ok = measure(mid, "bisect")
        knee.tried.append((mid, ok, "bisect"))
        if ok:
            knee.lo = knee.qps = mid
        else:
            knee.hi = mid
    return knee
