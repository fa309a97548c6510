"""How many document tokens to recompute: r = max(r_min, the r whose recompute hides the load).

CacheBlend pipelines loading layer l+1's chunk KV with recomputing layer l, so recomputing
more tokens is free until it takes as long as the load. Given the connector's cost-model
estimates — seconds to load ``n`` bytes of chunk KV, and seconds to recompute ``n`` tokens —
``choose`` returns the smallest r in [r_min, 1] whose recompute time covers the load time.
Estimates may be plain numbers (seconds in total / seconds per token) or callables.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

Estimate = float | Callable[[int], float]


def _eval(est: Estimate, n: int, per_unit: bool) -> float:
    if callable(est):
        return float(est(n))
    return float(est) * n if per_unit else float(est)


@dataclass(frozen=True)
class RecomputeRatio:
    """The recompute ratio of a blend: at least ``r_min``, more while the extra recompute hides under the load."""

    r_min: float = 0.15
    load_time_s: Estimate | None = None  # bytes -> s (a number: seconds for the whole load)
    recompute_time_s: Estimate | None = None  # tokens -> s (a number: seconds per token)

    def __post_init__(self) -> None:
        if not 0.0 <= self.r_min <= 1.0:
            raise ValueError(f"r_min must be in [0, 1], got {self.r_min}")

    def hiding_ratio(self, num_doc_tokens: int, chunk_bytes: int) -> float:
        """Smallest r whose recompute time of r * num_doc_tokens covers the chunk load time."""
        if self.load_time_s is None or self.recompute_time_s is None or num_doc_tokens <= 0:
            return 0.0
        load = _eval(self.load_time_s, chunk_bytes, per_unit=False)
        if load <= 0:
            return 0.0
        if _eval(self.recompute_time_s, num_doc_tokens, per_unit=True) <= load:
            return 1.0
        lo, hi = 0, num_doc_tokens  # recompute(hi) > load >= ... bisect the token count
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if _eval(self.recompute_time_s, mid, per_unit=True) >= load:
                hi = mid
            else:
                lo = mid
        return hi / num_doc_tokens

    def choose(self, num_doc_tokens: int, chunk_bytes: int) -> float:
        return min(1.0, max(self.r_min, self.hiding_ratio(num_doc_tokens, chunk_bytes)))
