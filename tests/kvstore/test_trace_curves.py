"""The dashboard's miss-ratio curve comes from the last trace the daemon wrote."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kvstore.ops.dashboard import Dashboard
from kvstore.ops.mrc import lru_curve, references
from kvstore.ops.trace import TraceControl, read_trace
from kvstore.ops.trace_curves import LatestCurves
from kvstore.store.tier_bookkeeping import LevelOptions
from kvstore.store.tiered_store import TieredStore
from tests.kvstore.support import blk
from tiers.cpu import CpuTier


def _traced(tmp_path: Path) -> tuple[TieredStore, Path]:
    """A cyclic pattern over 12 blocks on a tier that holds about 8 of them: LRU hits nothing
    at its size, everything at 12 blocks and above."""
    one = len(blk(b"k-00"))
    store = TieredStore([(CpuTier(8 * one + one // 2, pinned=False), LevelOptions())])
    control = TraceControl(store, tmp_path)
    out = tmp_path / "cyc.kvtrace"
    control.start(str(out))
    keys = [b"k-%02d" % i for i in range(12)]
    for _ in range(4):
        for k in keys:
            if store.get(k) is None:
                store.put(k, blk(k))
    control.stop()
    return store, out


def test_latest_curve_is_the_top_tiers_lru_curve(tmp_path: Path) -> None:
    store, out = _traced(tmp_path)
    try:
        latest = LatestCurves()
        assert latest() == []  # nothing before a trace
        latest.update(out).join(30)
        (c,) = latest()
        c.check()
        want = lru_curve(references(read_trace(out))).hit_ratio(np.array(c.capacity_bytes))
        assert c.tier == "cpu" and np.allclose(c.hit_ratio, want) and "exact" in c.note
        cap = store.levels[0].capacity
        at = dict(zip(c.capacity_bytes, c.hit_ratio, strict=True))
        assert max(h for b, h in at.items() if b <= cap) == 0.0  # cyclic over a too-small LRU: no hits
        assert max(c.hit_ratio) > 0.5  # enough capacity: every read after the first round hits
        board = Dashboard(store, curves=latest).snapshot()
        assert board["curve_error"] == "" and board["curves"][0]["hit_ratio"] == list(c.hit_ratio)
    finally:
        store.close()


def test_unreadable_trace_keeps_the_previous_curve(tmp_path: Path) -> None:
    store, out = _traced(tmp_path)
    store.close()
    latest = LatestCurves()
    latest.update(out).join(30)
    before = latest()
    bad = tmp_path / "bad.kvtrace"
    bad.write_bytes(b"not a trace")
    latest.update(bad).join(30)
    assert latest() == before and len(before) == 1
