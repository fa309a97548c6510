"""How bench.tiers and bench.tiers.daemon turn timings into figures: pure functions, unit-tested
on synthetic inputs (tests/bench/tiers/test_figures.py).

Every sample is the wall time of one pass over the same bytes, so a rate is ``bytes / time``.

gbps
    bytes / median(pass times) / 1e9.
ratio_of_medians
    ours GB/s / baseline GB/s over the same bytes = median(baseline times) / median(our times).
    Above 1 means we are faster than the baseline (against a thin wrapper's own library, a sign of
    a handicapped baseline, not of a fast wrapper).
paired_ratio
    median over repetitions of baseline time / our time of the *same* repetition (the two sides
    of one repetition ran interleaved, so the machine's load hit both): steadier than the ratio of
    medians on a shared machine.
best_baseline
    the fastest (lowest-median) of several baselines over the same bytes, so a headline is
    compared with the strongest thing a user of that library could do.
scaling_ratio
    median aggregate GB/s with N clients / median aggregate GB/s with 1 client.
cold_verified
    whether a "cold" measurement was really cold: after the drop at most ``max_resident`` of the
    file's pages were in the page cache, and the cold pass was slower than the warm pass.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence


class FigureError(ValueError):
    """Timings that no figure can be computed from (empty, zero or mismatched)."""


def _median_positive(seconds: Sequence[float], what: str) -> float:
    if not seconds:
        raise FigureError(f"{what}: no samples")
    if min(seconds) <= 0:
        raise FigureError(f"{what}: a pass time is <= 0 ({min(seconds)})")
    return statistics.median(seconds)


def gbps(nbytes: int, seconds: Sequence[float]) -> float:
    """GB/s (1e9 bytes per second) of ``nbytes`` moved per pass, from the median pass time."""
    if nbytes <= 0:
        raise FigureError(f"gbps: bytes per pass must be > 0, got {nbytes}")
    return nbytes / _median_positive(seconds, "gbps") / 1e9


def ratio_of_medians(ours_s: Sequence[float], baseline_s: Sequence[float]) -> float:
    """Our throughput over the baseline's, both over the same bytes per pass."""
    return _median_positive(baseline_s, "baseline") / _median_positive(ours_s, "ours")


def paired_ratio(ours_s: Sequence[float], baseline_s: Sequence[float]) -> float:
    """Median of baseline_i / ours_i over repetitions i (one repetition = both sides interleaved)."""
    if len(ours_s) != len(baseline_s):
        raise FigureError(f"paired_ratio: {len(ours_s)} passes of ours vs {len(baseline_s)} of the baseline")
    _median_positive(ours_s, "ours")
    _median_positive(baseline_s, "baseline")
    return statistics.median(b / o for o, b in zip(ours_s, baseline_s, strict=True))


def best_baseline(candidates: dict[str, Sequence[float]]) -> tuple[str, Sequence[float]]:
    """(name, times) of the baseline with the lowest median pass time."""
    if not candidates:
        raise FigureError("best_baseline: no baselines")
    name = min(candidates, key=lambda n: _median_positive(candidates[n], n))
    return name, candidates[name]


def scaling_ratio(one_gbps: Sequence[float], many_gbps: Sequence[float]) -> float:
    """Median aggregate rate with many clients over the median with one."""
    for what, xs in (("one client", one_gbps), ("many clients", many_gbps)):
        _median_positive(xs, what)
    return statistics.median(many_gbps) / statistics.median(one_gbps)


def cold_verified(cold_s: Sequence[float], warm_s: Sequence[float], resident_after_drop: Sequence[float],
                  max_resident: float = 0.05) -> bool:
    """The drop left at most ``max_resident`` of the pages cached (every time) and cold was slower."""
    if not resident_after_drop:
        raise FigureError("cold_verified: no residency samples")
    dropped = max(resident_after_drop) <= max_resident
    return dropped and _median_positive(cold_s, "cold") > _median_positive(warm_s, "warm")


def meets(value: float, target: float) -> bool:
    """Whether a higher-is-better figure reaches its target."""
    return value >= target
