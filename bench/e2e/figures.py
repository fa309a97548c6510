"""How bench.e2e turns timings into figures: pure functions, unit-tested on synthetic inputs
(tests/bench/e2e/test_figures.py).

repeated_median
    the median of >= ``min_reps`` samples (a headline is never one sample).
speedup
    baseline time / our time.
memcpy_floor_s
    the physics of the bytes a load moves: bytes / memcpy bandwidth measured in the same run.
copy_bandwidth
    bytes / the median of copies of them timed in the load's cache state (the floor of
    ``load_over_cold_memcpy_cpu``, beside the best-memcpy floor of ``load_over_floor_cpu``).
load_over_floor
    median measured load time / memcpy_floor_s of its bytes (1 = a load as fast as one memcpy).
ttft_floor_ratio
    the *old* ``floor_ratio_cpu``: warm TTFT / (memcpy floor + the suffix compute both sides pay).
    It stays near 1 whatever the load costs; kept as a secondary figure with that meaning.
hit_rate
    tokens served from the daemon / tokens that could have been.
bandwidth_for / throttle_for
    the tier speed at which the cost model predicts a load-then-compute of ``f`` times the
    recompute, and the loader throttle that makes a real tier of a known speed that slow.
grid_verdict / accuracy / regret
    one cost-model case judged on the measured times of both options; the share of decisive
    cases (options >= ``min_gap`` apart) decided right; Σ(chosen − best) / Σ best over all cases.
median_relative_error
    median |predicted − measured| / measured.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import NamedTuple


class FigureError(ValueError):
    """Timings that no figure can be computed from (too few, empty, zero or negative)."""


def _positive(xs: Sequence[float], what: str) -> Sequence[float]:
    if not xs:
        raise FigureError(f"{what}: no samples")
    if min(xs) <= 0:
        raise FigureError(f"{what}: a time is <= 0 ({min(xs)})")
    return xs


def repeated_median(seconds: Sequence[float], min_reps: int = 3) -> float:
    """Median of at least ``min_reps`` positive samples."""
    if len(seconds) < min_reps:
        raise FigureError(f"a median of >= {min_reps} runs was asked for, got {len(seconds)}")
    return statistics.median(_positive(seconds, "repeated_median"))


def speedup(baseline_s: float, ours_s: float) -> float:
    _positive([baseline_s, ours_s], "speedup")
    return baseline_s / ours_s


def memcpy_floor_s(nbytes: int, memcpy_bytes_per_s: float) -> float:
    if nbytes <= 0 or memcpy_bytes_per_s <= 0:
        raise FigureError(f"memcpy floor: bytes {nbytes} and bandwidth {memcpy_bytes_per_s} must be > 0")
    return nbytes / memcpy_bytes_per_s


def copy_bandwidth(nbytes: int, copy_s: Sequence[float]) -> float:
    """Bytes/s of copies of ``nbytes`` timed ``copy_s`` (their median: the cold-copy floor)."""
    if nbytes <= 0:
        raise FigureError(f"copy bandwidth: bytes {nbytes} must be > 0")
    return nbytes / statistics.median(_positive(copy_s, "copy_bandwidth"))


def load_over_floor(load_s: Sequence[float], nbytes: int, memcpy_bytes_per_s: float) -> float:
    """Median measured load time over the memcpy time of the same bytes."""
    return statistics.median(_positive(load_s, "load_over_floor")) / memcpy_floor_s(nbytes, memcpy_bytes_per_s)


def ttft_floor_ratio(warm_ttft_s: float, nbytes: int, memcpy_bytes_per_s: float, suffix_s: float) -> float:
    """Warm TTFT / (memcpy floor of the loaded bytes + the suffix compute): the old floor_ratio_cpu."""
    _positive([warm_ttft_s, suffix_s], "ttft_floor_ratio")
    return warm_ttft_s / (memcpy_floor_s(nbytes, memcpy_bytes_per_s) + suffix_s)


def hit_rate(hit_tokens: float, possible_tokens: float) -> float:
    if possible_tokens <= 0 or hit_tokens < 0:
        raise FigureError(f"hit rate: {hit_tokens} of {possible_tokens} tokens")
    return hit_tokens / possible_tokens


def bandwidth_for(f: float, recompute_s: float, suffix_s: float, latency_s: float, nbytes: int) -> float:
    """Bytes/s at which latency + nbytes / speed + suffix = f x recompute (all predicted)."""
    load_s = f * recompute_s - suffix_s - latency_s
    if f <= 0 or nbytes <= 0 or load_s <= 0:
        raise FigureError(f"no speed makes the load {f}x the recompute ({recompute_s:.3f}s; the suffix "
                          f"{suffix_s:.3f}s and latency {latency_s:.3f}s alone take longer)")
    return nbytes / load_s


def throttle_for(target_bps: float, tier_bps: float) -> float:
    """The loader throttle (bytes/s, a sleep of bytes / throttle added to each read) that slows a
    tier of ``tier_bps`` to ``target_bps``: 1/target = 1/tier + 1/throttle."""
    if target_bps <= 0 or tier_bps <= 0:
        raise FigureError(f"throttle: speeds must be > 0 (target {target_bps}, tier {tier_bps})")
    if target_bps >= tier_bps:
        raise FigureError(f"throttle: a tier of {tier_bps:.3g} B/s cannot be slowed to {target_bps:.3g} B/s")
    return 1.0 / (1.0 / target_bps - 1.0 / tier_bps)


class Verdict(NamedTuple):
    picked_load: bool
    best_is_load: bool
    chosen_s: float  # the measured time of the option the model picked
    best_s: float  # the measured time of the faster option
    gap: float  # |load − recompute| / the faster of the two
    correct: bool


def grid_verdict(picked_load: bool, load_s: float, recompute_s: float) -> Verdict:
    """Judge one decision on the measured TTFTs of both options."""
    _positive([load_s, recompute_s], "grid_verdict")
    best = min(load_s, recompute_s)
    best_is_load = load_s < recompute_s
    return Verdict(picked_load, best_is_load, load_s if picked_load else recompute_s, best,
                   abs(load_s - recompute_s) / best, picked_load == best_is_load)


def accuracy(verdicts: Sequence[Verdict], min_gap: float = 0.1) -> tuple[float, int]:
    """(share decided right, how many cases counted) over cases whose options differ by >= min_gap."""
    decisive = [v for v in verdicts if v.gap >= min_gap]
    if not decisive:
        raise FigureError(f"accuracy: no case has options >= {min_gap:.0%} apart")
    return sum(v.correct for v in decisive) / len(decisive), len(decisive)


def regret(verdicts: Sequence[Verdict]) -> float:
    """Time lost to the model's choices over the time of always choosing right, all cases."""
    if not verdicts:
        raise FigureError("regret: no cases")
    return sum(v.chosen_s - v.best_s for v in verdicts) / sum(v.best_s for v in verdicts)


def median_relative_error(predicted: Sequence[float], measured: Sequence[float]) -> float:
    if len(predicted) != len(measured):
        raise FigureError(f"{len(predicted)} predictions for {len(measured)} measurements")
    _positive(measured, "median_relative_error")
    return statistics.median(abs(p - m) / m for p, m in zip(predicted, measured, strict=True))


def percentile(xs: Sequence[float], q: float) -> float:
    """The q-th percentile (linear interpolation); NaN for no samples (an empty workload)."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    pos = (len(s) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)
