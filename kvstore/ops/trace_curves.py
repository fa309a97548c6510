"""The dashboard's miss-ratio curve: the top tier's LRU curve from the last trace the daemon wrote.

When ``kvstore trace stop`` writes a trace, ``LatestCurves.update`` computes the top tier's curve
from that file (kvstore/ops/mrc.py: exact stack distances, SHARDS-sampled past ``exact_limit``
references) on a background thread, so the RPC returns at once; the dashboard then reads the
result through ``__call__`` (its ``curves`` hook). Lower tiers need the chain simulation of
``kvstore advise`` (slow on large traces), so the page shows the top tier and names the command
for the rest. A trace that cannot be read leaves the previous curve and is logged.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import numpy as np

from kvstore.ops.dashboard import MissRatioCurve
from kvstore.ops.mrc import lru_curve, references, sampling_rate
from kvstore.ops.trace import read_trace

log = logging.getLogger(__name__)

POINTS = 32  # capacities on the curve: 1/16x to 4x the tier's configured size, log-spaced


class LatestCurves:
    def __init__(self, exact_limit: int = 300_000, max_samples: int = 300_000) -> None:
        self.exact_limit, self.max_samples = exact_limit, max_samples
        self._lock = threading.Lock()
        self._curves: list[MissRatioCurve] = []
        self._thread: threading.Thread | None = None

    def __call__(self) -> list[MissRatioCurve]:
        with self._lock:
            return list(self._curves)

    def update(self, path: str | Path) -> threading.Thread:
        """Compute the curve of the trace at ``path`` in the background (the thread is returned)."""
        t = threading.Thread(target=self._compute, args=(Path(path),), name="kvstore-trace-curve", daemon=True)
        self._thread = t
        t.start()
        return t

    def _compute(self, path: Path) -> None:
        try:
            curves = curves_of(path, self.exact_limit, self.max_samples)
        except Exception as e:  # noqa: BLE001 - a bad trace must not take the daemon down
            log.warning("no miss-ratio curve from %s: %s", path, e)
            return
        with self._lock:
            self._curves = curves


def curves_of(path: Path, exact_limit: int = 300_000, max_samples: int = 300_000) -> list[MissRatioCurve]:
    trace = read_trace(path)
    if not trace.tiers:
        return []
    refs = references(trace)
    if not refs.total_demands:
        return []
    rate = sampling_rate(len(refs), exact_limit, max_samples)
    curve = lru_curve(refs, rate)
    top = trace.tiers[0]
    caps = np.unique(np.geomspace(max(top.capacity_bytes / 16, 1), top.capacity_bytes * 4, POINTS).astype(np.int64))
    note = (f"LRU, {int(refs.total_demands)} reads of {path.name}; "
            + ("exact" if rate >= 1 else f"sampled at {rate:.3g}, error ±{curve.error:.3f}")
            + "; lower tiers: kvstore advise")  # fmt: skip
    return [MissRatioCurve(top.name, [int(c) for c in caps], [float(h) for h in curve.hit_ratio(caps)], note)]
