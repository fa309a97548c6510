"""``kvstore advise TRACE``: how big each tier should be, from a trace the daemon recorded.

For each tier of the traced chain (fastest first) it computes the hit-ratio curve (mrc.py for the
top tier, mrc_chain.py for the tiers below it, each with the tiers above at their traced sizes),
the smallest size that reaches ``--target-hit-rate``, and what that gain is worth in prefill
time: every extra hit saves recomputing a page (page bytes / KV bytes per token x prefill seconds
per token) and costs loading it from that tier (page bytes / the tier's bandwidth; the per-load
latency is paid once per request, not per page, and is left out). The figures come from
``--cost FILE`` (JSON, any subset of CostFigures' fields) with the defaults below: the cost
model's seeds (connector/cost_model.py DEFAULT_TIERS) and SmolLM2-135M on our 2-core CPU
machines (46 KB of KV per token, ~225 tokens/s of prefill). On a GPU prefill is 100x faster:
pass your engine's calibrated figures (its log prints them at start).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np

from connector.cost_model import DEFAULT_TIERS
from kvstore.ops.mrc import Curve, References, lru_curve, references, sampling_rate
from kvstore.ops.mrc_chain import level_model
from kvstore.ops.trace import Trace, TraceError

GRID_POINTS = 16


@dataclass(frozen=True)
class CostFigures:
    kv_bytes_per_token: float = 46_080.0  # SmolLM2-135M, fp32: 30 layers x 2 x 3 heads x 64 x 4 bytes
    prefill_s_per_token: float = 1 / 225  # SmolLM2-135M prefill, 2 CPU threads
    tiers: Mapping[str, tuple[float, float]] = field(default_factory=lambda: dict(DEFAULT_TIERS))  # latency s, B/s

    def __post_init__(self) -> None:
        if self.kv_bytes_per_token <= 0 or self.prefill_s_per_token <= 0:
            raise TraceError("cost figures: kv_bytes_per_token and prefill_s_per_token must be > 0")
        for name, lat_bw in self.tiers.items():
            if len(lat_bw) != 2 or lat_bw[1] <= 0:
                raise TraceError(f"cost figures: tier {name!r} needs [latency_s, bytes_per_s > 0]")

    @staticmethod
    def load(path: str | Path) -> CostFigures:
        try:
            raw = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            raise TraceError(f"cannot read cost figures {path}: {e}") from None
        known = {f.name for f in fields(CostFigures)}
        if not isinstance(raw, dict) or set(raw) - known:
            raise TraceError(f"cost figures {path}: expected a JSON object with keys from {sorted(known)}")
        tiers = dict(DEFAULT_TIERS, **{k: tuple(v) for k, v in raw.pop("tiers", {}).items()})
        return CostFigures(**raw, tiers=tiers)

    def saved_s_per_page(self, tier: str, page_bytes: float) -> float:
        """Prefill time a hit in ``tier`` saves on one page of ``page_bytes``, net of loading it."""
        _, bw = self.tiers.get(tier, self.tiers.get(tier.rstrip("0123456789"), (0.0, 1e8)))
        return page_bytes / self.kv_bytes_per_token * self.prefill_s_per_token - page_bytes / bw


@dataclass(frozen=True)
class TierAdvice:
    name: str
    configured_bytes: int
    hit_ratio_now: float  # cumulative: served by this tier or one above, at the traced sizes
    recommended_bytes: int | None  # None: the target is out of this tier's reach
    hit_ratio_recommended: float
    saved_s_per_1000_reads: float  # prefill seconds saved by the recommended size, net of loads
    curve: list[tuple[int, float]]  # (bytes, cumulative hit ratio)


@dataclass(frozen=True)
class Advice:
    target: float
    references: int
    demands: int
    duration_s: float
    rate: float  # 1.0 = exact stack distances; < 1: SHARDS sampling rate
    sampling_error: float  # stated absolute error of the hit ratios (0 when exact)
    max_hit_ratio: float  # an unbounded cache: the rest are first reads
    mean_page_bytes: float
    tiers: list[TierAdvice]
    notes: list[str]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _smallest(fn: Any, lo: float, hi: float, target: float, steps: int = 8) -> float:
    """Smallest x in [lo, hi] with fn(x) >= target, by bisection (fn(hi) >= target)."""
    for _ in range(steps):
        mid = (lo + hi) / 2
        if fn(mid) >= target:
            hi = mid
        else:
            lo = mid
    return hi


def advise(trace: Trace, target: float = 0.8, cost: CostFigures | None = None, exact_limit: int = 300_000,
           max_samples: int = 200_000) -> Advice:
    """Curves, recommendations and prefill savings for every tier of the traced chain."""
    if not 0 < target <= 1:
        raise TraceError(f"--target-hit-rate must be in (0, 1], got {target}")
    cost = cost or CostFigures()
    refs = references(trace)
    if not refs.total_demands:
        raise TraceError("the trace holds no gets and no new puts: nothing to size (was traffic running?)")
    rate = sampling_rate(len(refs), exact_limit, max_samples)
    sample = refs.sample(rate, hot=False) if rate < 1 else refs  # a miniature simulation needs one rate
    top = lru_curve(refs, rate)
    sizes: dict[int, int] = dict(zip(refs.keys.tolist(), refs.sizes.tolist(), strict=True))
    working_set = float(sum(sizes.values()))
    page = float(refs.sizes[refs.demand].mean())
    notes = [f"tier {t.name} evicts by {t.eviction}: its curve is LRU's, an estimate"
             for t in trace.tiers if t.eviction.lower() != "lru"]  # fmt: skip
    if not trace.promote_on_hit:
        notes.append("the daemon does not promote lower hits: the curves below the top assume it does (an estimate)")
    if rate < 1 and len(trace.tiers) > 1:
        notes.append(f"tiers below the top: simulated on a uniform sample at rate {rate:.3g}, their error is not stated")
    if trace.overwritten:
        notes.append(f"the ring overwrote {trace.overwritten} older records: the curve covers the latest window")
    tiers = [_top_advice(trace.tiers[0].name, trace.tiers[0].capacity_bytes, top, target, working_set, cost, page)]
    upper = [trace.tiers[0].capacity_bytes]
    for t in trace.tiers[1:]:
        tiers.append(_lower_advice(t.name, t.capacity_bytes, sample, upper, rate, target, working_set, cost, page))
        upper.append(t.capacity_bytes)
    return Advice(target, len(refs), int(refs.total_demands), trace.duration_s, rate, top.error, top.max_hit_ratio,
                  page, tiers, notes)  # fmt: skip


def _top_advice(name: str, configured: int, curve: Curve, target: float, working_set: float, cost: CostFigures,
                page: float) -> TierAdvice:  # fmt: skip
    rec = curve.capacity_for(target)
    now = float(curve.hit_ratio(configured))
    then = float(curve.hit_ratio(rec)) if rec is not None else now
    grid = np.linspace(0, max(working_set, configured, rec or 0) * 1.05, GRID_POINTS * 2)
    saved = 1000 * (then - now) * cost.saved_s_per_page(name, page)
    points = [(int(c), float(h)) for c, h in zip(grid, curve.hit_ratio(grid), strict=True)]
    return TierAdvice(name, configured, now, None if rec is None else math.ceil(rec), then, saved, points)


def _lower_advice(name: str, configured: int, refs: References, upper: list[int], rate: float, target: float,
                  working_set: float, cost: CostFigures, page: float) -> TierAdvice:  # fmt: skip
    hi = max(working_set, float(configured))

    hit = level_model(refs, upper, rate).hit_ratio
    grid = np.linspace(0, hi * 1.05, GRID_POINTS)
    values = [hit(c) for c in grid]
    now = hit(configured)
    rec: float | None
    if values[0] >= target:
        rec = 0.0  # the tiers above already reach it
    elif max(values) < target:
        rec = None
    else:
        i = next(i for i, v in enumerate(values) if v >= target)
        rec = float(math.ceil(_smallest(hit, float(grid[i - 1]), float(grid[i]), target)))
    then = hit(rec) if rec is not None else now
    saved = 1000 * (then - now) * cost.saved_s_per_page(name, page)
    points = [(int(c), v) for c, v in zip(grid, values, strict=True)]
    return TierAdvice(name, configured, now, None if rec is None else int(rec), then, saved, points)
