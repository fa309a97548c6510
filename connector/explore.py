"""When to load a little from a tier the cost model would bypass: exploration, bounded in count and time.

Why: a tier judged slower than recompute is never loaded, so never measured again, and a tier that
got faster (a link healed, a neighbour's bulk transfer ended) would stay bypassed for good. So a
bypassed tier is explored: a few pages loaded anyway (``EXPLORE_PAGES``), their time folded into
the model. Its cost lands on the request that draws it: bench.cluster's regret on a 100 Mbit/s
link was 5.7 % in one run from a single 16-page exploration (1.45 s against 0.63 s to recompute),
0 % in another. Counting bypasses alone ties that cost to the request rate: at 100 requests/s,
once in 32 bypasses is three explorations a second of a tier measured a moment ago.

``Explorer.wants(tier, measured)``: True while no load ever measured the tier (its model is the
start-up probe's, which a busy moment can make look far too slow); after that only once the tier
has gone ``every`` bypasses *and* ``after_s`` seconds without a measurement (a load of it, an
exploration included, starts both counts again, the time from the first bypass after it). Not
thread-safe: the lookup worker decides.
"""

from __future__ import annotations

import time
from collections.abc import Callable

EXPLORE_EVERY = 32  # bypasses of a measured tier before it is explored again ...
EXPLORE_AFTER_S = 30.0  # ... and at least this long since it was last measured


class Explorer:
    def __init__(self, every: int = EXPLORE_EVERY, after_s: float = EXPLORE_AFTER_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.every, self.after_s, self._clock = every, after_s, clock
        self._seen: dict[str, tuple[int, float, int]] = {}  # tier -> (measured count, since when, bypasses since)

    def wants(self, tier: str, measured: int) -> bool:
        """One more bypass of ``tier`` (whose model ``measured`` loads updated so far): explore it?"""
        if not measured:
            return True
        now = self._clock()
        count, since, bypasses = self._seen.get(tier, (-1, now, 0))
        if count != measured:  # measured since the last bypass: both counts start again
            since, bypasses = now, 0
        bypasses += 1
        explore = bypasses >= self.every and now - since >= self.after_s
        self._seen[tier] = (measured, now, 0) if explore else (measured, since, bypasses)
        return explore
