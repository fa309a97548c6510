"""/dashboard: one self-refreshing HTML page on the daemon's HTTP (metrics) port, and its JSON.

``GET /dashboard`` is a static page (kvstore/ops/dashboard_page.py, no build step) whose inline script
polls ``GET /dashboard.json`` and draws: each tier's usage against capacity, hit ratio, read and
write bandwidth, spill and promotion rates (differences of the store's counters between two
polls), why read lookups missed (kvstore/store/miss_reasons.py: recently evicted by tier, or absent) and the
latest miss-ratio curve when one is available.

Read-only and secret-free: the JSON carries counters, sizes and tier names only (no last-error
text, which may quote a server address, and no config). The cost model's decisions are made in
the engine, not here: the page says so and points at the engine's /metrics.

Miss-ratio curves come through a hook: anything that can produce the latest curves (the trace
and advise tools) sets ``Dashboard.curves`` to a callable returning ``MissRatioCurve``s; the page
draws them when the callable returns some. A failing hook is reported on the page, never raised.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from kvstore.ops.dashboard_page import PAGE
from kvstore.store.tiered_store import TieredStore

log = logging.getLogger(__name__)

#: where cost-model decisions are visible (the daemon never sees them)
DECISIONS_AT = ("the engine's /metrics: tierkv_connector_decisions_total{tier,outcome} and "
                "tierkv_engine_prompt_pages_total{reason,tier}")


class MissRatioCurve(NamedTuple):
    """Hit ratio a tier would reach at each capacity (ascending), from a trace."""

    tier: str
    capacity_bytes: Sequence[int]  # non-decreasing
    hit_ratio: Sequence[float]
    note: str = ""  # how it was computed (e.g. exact, or sampled with its error)

    def check(self) -> None:
        if len(self.capacity_bytes) != len(self.hit_ratio) or not self.capacity_bytes:
            raise ValueError(f"curve of {self.tier}: {len(self.capacity_bytes)} sizes, {len(self.hit_ratio)} ratios")
        if any(b < a for a, b in zip(self.capacity_bytes, self.capacity_bytes[1:], strict=False)):
            raise ValueError(f"curve of {self.tier}: capacities must ascend")
        if any(not 0.0 <= h <= 1.0 for h in self.hit_ratio):
            raise ValueError(f"curve of {self.tier}: hit ratios must be in [0, 1]")


CurveSource = Callable[[], Sequence[MissRatioCurve]]

# a route: path -> () -> (content type, body)
Route = Callable[[], tuple[str, bytes]]


class Dashboard:
    def __init__(self, store: TieredStore, curves: CurveSource | None = None) -> None:
        self.store = store
        self.curves = curves  # set by whoever can produce miss-ratio curves (trace/advise)

    def routes(self) -> dict[str, Route]:
        return {"/dashboard": lambda: ("text/html; charset=utf-8", PAGE.encode()),
                "/dashboard.json": lambda: ("application/json", json.dumps(self.snapshot()).encode())}

    def snapshot(self) -> dict[str, Any]:
        st = self.store.stats()
        lk = self.store.lookup_counts()
        tiers = [{"name": t.name, "used_bytes": t.used_bytes, "capacity_bytes": t.capacity_bytes, "blocks": t.blocks,
                  "available": t.available, "hits": t.hits, "misses": t.misses, "evictions": t.evictions,
                  "spills": t.spills, "promotions": t.promotions, "dropped": t.dropped, "errors": t.errors,
                  "read_bytes": t.read_bytes, "write_bytes": t.write_bytes} for t in st.tiers]
        curves, curve_error = self._curves()
        return {"time": time.time(), "tiers": tiers,
                "spill_queue": {"blocks": st.pending_blocks, "bytes": st.pending_bytes},
                "lookups": {"keys": lk.keys, "hits": lk.hits, "evicted": lk.evicted, "absent": lk.absent},
                "curves": curves, "curve_error": curve_error, "decisions_at": DECISIONS_AT}

    def _curves(self) -> tuple[list[dict[str, Any]], str]:
        if self.curves is None:
            return [], ""
        try:
            out = []
            for c in self.curves():
                c.check()
                out.append({"tier": c.tier, "capacity_bytes": [int(x) for x in c.capacity_bytes],
                            "hit_ratio": [float(x) for x in c.hit_ratio], "note": c.note})
            return out, ""
        except Exception as e:  # noqa: BLE001 - a broken hook must not break the page
            log.warning("dashboard: the miss-ratio curve hook failed: %s", e)
            return [], f"{type(e).__name__}: {e}"
