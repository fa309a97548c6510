"""Hit ratios of a whole tier chain, by a miniature simulation of what TieredStore does.

Why a simulation below the top: the chain is neither inclusive nor exclusive. A block enters
the top tier only (a put, or the promotion of a lower hit, which leaves the lower copy in place);
the top's LRU victims land one level down, where a block already there is only touched; a lower
level's victims land one level further down, or are dropped off the last one. So a lower tier's
content depends on the tiers above it, and a lower hit leaves a duplicate behind: no single stack
of distances describes it. The top tier alone is a plain LRU over every reference (mrc.py); for
the levels below, this module replays the reference stream through the same rules at each size
asked, on the SHARDS sample when the trace is large (capacities scaled by the rate: Waldspurger
et al., "miniature simulations", ATC '17). LRU only: other eviction policies are estimated as LRU.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from kvstore.mrc import References


class _Chain:
    def __init__(self, capacities: Sequence[float], promote: bool) -> None:
        self.caps = list(capacities)
        self.promote = promote
        self.levels: list[OrderedDict[int, int]] = [OrderedDict() for _ in capacities]
        self.used = [0.0] * len(capacities)

    def insert(self, i: int, key: int, size: int) -> None:
        """Put ``key`` into level i, moving its LRU victims down (TieredStore._insert_top / Spiller._land)."""
        while i < len(self.levels) and size > self.caps[i]:
            i += 1  # too large for this level: it goes on below
        if i >= len(self.levels):
            return
        lv = self.levels[i]
        if key in lv:  # already there (inclusive chain): touched, nothing written
            lv.move_to_end(key)
            return
        victims = []
        while lv and self.used[i] + size > self.caps[i]:
            vkey, vsize = lv.popitem(last=False)
            self.used[i] -= vsize
            victims.append((vkey, vsize))
        lv[key] = size
        self.used[i] += size
        for vkey, vsize in victims:
            self.insert(i + 1, vkey, vsize)

    def access(self, key: int, size: int) -> int | None:
        """One reference: the level that held it (touched, promoted), or None (put at the top)."""
        for i, lv in enumerate(self.levels):
            if key in lv:
                lv.move_to_end(key)
                if i > 0 and self.promote and key not in self.levels[0]:
                    self.insert(0, key, lv[key])
                return i
        self.insert(0, key, size)
        return None


def chain_hits(refs: References, capacities: Sequence[float], promote: bool = True, rate: float = 1.0) -> np.ndarray:
    """Hit ratio of each level (share of the demands it served) for a chain of ``capacities``.

    ``refs`` a uniform hash sample at ``rate`` (``References.sample(rate, hot=False)``): the
    capacities are scaled by it, as a miniature simulation does."""
    chain = _Chain([c * rate for c in capacities], promote)
    hits = np.zeros(len(capacities))
    for k, s, d in zip(refs.keys.tolist(), refs.sizes.tolist(), refs.demand.tolist(), strict=True):
        level = chain.access(k, s)
        if d and level is not None:
            hits[level] += 1
    return hits / max(int(refs.demand.sum()), 1)
