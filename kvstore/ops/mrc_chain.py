"""Hit ratios of the tiers below the top, by a miniature simulation of what TieredStore does.

Why a simulation below the top: the chain is neither inclusive nor exclusive. A block enters
the top tier only (a put, or the promotion of a lower hit, which leaves the lower copy in place);
the top's LRU victims land one level down, where a block already there is only touched; a lower
level's victims land one level further down, or are dropped off the last one. So a lower tier's
content depends on the tiers above it, and a lower hit leaves a duplicate behind: no single stack
of distances describes it.

What makes it cheap: with promotion on (the default), the top tier's content does not depend on
the tiers below (every access that misses it puts the block there: a promotion or the client's
put), and likewise each level depends only on the levels above. So level i is simulated over
the *stream level i-1 sends it*: a probe for each access that missed above (touch on a hit, no
copy on a miss) and a landing for each victim from above (touch if there, else insert and push
victims further down). One pass per level derives the stream for the next; a curve for level i
re-runs only level i, over a stream usually far shorter than the trace. On a large trace this
runs on the SHARDS sample with capacities scaled by the rate (Waldspurger et al., "miniature
simulations", ATC '17). LRU only: other eviction policies are estimated as LRU.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvstore.ops.mrc import References

PROBE, LAND = 0, 1


def top_stream(refs: References) -> list[tuple[int, int, int, bool]]:
    """The top level sees every reference as an access: a probe that, on a miss, also inserts."""
    return [(PROBE, k, s, d) for k, s, d in zip(refs.keys.tolist(), refs.sizes.tolist(), refs.demand.tolist(),
                                                strict=True)]  # fmt: skip


def run_level(events: list[tuple[int, int, int, bool]], capacity: float, top: bool,
              emit: bool = True) -> tuple[int, list[tuple[int, int, int, bool]]]:  # fmt: skip
    """Simulate one LRU level over its stream: (demand hits, the stream it sends below)."""
    lru: OrderedDict[int, int] = OrderedDict()
    used = 0.0
    hits = 0
    out: list[tuple[int, int, int, bool]] = []
    for op, k, s, d in events:
        if k in lru:
            lru.move_to_end(k)  # a hit, or a landing block already here: touched, nothing written
            hits += op == PROBE and d
            continue
        if op == PROBE:
            if emit:
                out.append((op, k, s, d))
            if not top:
                continue  # a miss below the top copies nothing here (the block goes to the top)
        if s > capacity:  # too large for this level: it goes on below
            if emit and (op == LAND or top):
                out.append((LAND, k, s, False))
            continue
        victims = []
        while lru and used + s > capacity:
            vk, vs = lru.popitem(last=False)
            used -= vs
            victims.append((LAND, vk, vs, False))
        lru[k] = s
        used += s
        if emit:
            out += victims
    return hits, out


def chain_hits(refs: References, capacities: Sequence[float], rate: float = 1.0) -> np.ndarray:
    """Hit ratio of each level (share of the demands it served) for a chain of ``capacities``.

    ``refs`` a uniform hash sample at ``rate`` (``References.sample(rate, hot=False)``): the
    capacities are scaled by it, as a miniature simulation does."""
    demands = max(int(refs.demand.sum()), 1)
    events = top_stream(refs)
    hits = np.zeros(len(capacities))
    for i, c in enumerate(capacities):
        h, events = run_level(events, c * rate, top=i == 0, emit=i < len(capacities) - 1)
        hits[i] = h
    return hits / demands


@dataclass(frozen=True)
class LevelModel:
    """One level under levels of fixed sizes: its stream from above is derived once, so each
    size asked re-runs this level alone."""

    events: list[tuple[int, int, int, bool]]
    above_hits: int  # demand hits of the levels above
    demands: int
    rate: float
    top: bool

    def hit_ratio(self, capacity: float) -> float:
        """Cumulative hit ratio (this level and those above) with this level at ``capacity``."""
        return (self.above_hits + run_level(self.events, capacity * self.rate, self.top, emit=False)[0]) / self.demands


def level_model(refs: References, upper: Sequence[float], rate: float = 1.0) -> LevelModel:
    """The level below levels of sizes ``upper`` (fastest first); ``refs`` sampled as for chain_hits."""
    events = top_stream(refs)
    above = 0
    for i, c in enumerate(upper):
        h, events = run_level(events, c * rate, top=i == 0)
        above += h
    return LevelModel(events, above, max(int(refs.demand.sum()), 1), rate, not upper)
