"""bench/advise/real_share.py: the measured side of real_runs counts what the advisor's curve predicts."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from bench.advise.real import RealSpec, schedule
from bench.advise.real_share import compare, token_share, trace_hits
from bench.advise.workloads import UNIT, Workload, replay
from kvstore.ops.mrc import lru_curve, references
from kvstore.ops.trace import MISS, RECORD_DTYPE, Trace, TraceTier, read_trace
from kvstore.store.observers import OP_GET, OP_LOOKUP, OP_PUT


def _trace(rows: list[tuple[int, int, int, int]]) -> Trace:
    recs = np.zeros(len(rows), dtype=RECORD_DTYPE)
    for i, (key, size, op, tier) in enumerate(rows):
        recs[i] = (key, size, op, tier, 0, float(i))
    return Trace((TraceTier("cpu", 1000), TraceTier("disk", 5000)), True, recs)


def test_trace_hits_counts_the_advisors_demands() -> None:
    t = _trace([
        (1, 0, OP_LOOKUP, MISS),  # not a reference
        (1, 100, OP_PUT, MISS),   # recomputed: a demand, a miss
        (1, 0, OP_LOOKUP, 0),     # not a reference
        (1, 100, OP_GET, 0),      # a demand the top tier served
        (2, 0, OP_GET, MISS),     # a demand, a miss ...
        (2, 50, OP_PUT, MISS),    # ... and its put is that demand again, not a second
        (2, 50, OP_PUT, 0),       # a put of a held block: no demand
        (3, 70, OP_PUT, MISS),    # a demand, a miss
        (3, 70, OP_GET, 1),       # a demand the disk tier served: a miss of the top tier
    ])  # fmt: skip
    assert trace_hits(t) == (1, 5)
    assert trace_hits(t, level=1) == (2, 5)


def test_measured_equals_the_curve_at_the_traced_size(tmp_path: Path) -> None:
    """A real TieredStore traced at one size: its hits, counted as trace_hits does, are what the
    advisor's curve says for that size (the two sides of real_runs are one quantity)."""
    rng = np.random.default_rng(0)
    pages = rng.zipf(1.3, size=600) % 60
    w = Workload("t", [[(int(p), UNIT * (1 + int(p) % 3))] for p in pages])
    cap = w.working_set_bytes // 3
    r = replay(w, [cap], trace_to=tmp_path / "t.kvtrace")
    trace = read_trace(tmp_path / "t.kvtrace")
    hits, demands = trace_hits(trace)
    assert demands == r.demands and hits == r.hits[0]
    assert hits / demands == pytest.approx(float(lru_curve(references(trace)).hit_ratio(cap)))
    assert 0.1 < hits / demands < 0.9  # a size on the slope, where a wrong count would show


def test_compare_errors_and_the_naive_baseline() -> None:
    measured = {"half": {"hits": 25, "demands": 100, "token_share": 0.10},
                "recommended": {"hits": 40, "demands": 80, "token_share": 0.25}}  # fmt: skip
    out = compare({"half": 0.30, "recommended": 0.45}, measured, {"half": 5, "recommended": 10}, 0.5, naive=0.5)
    half, rec = out["real_runs"]["half"], out["real_runs"]["recommended"]
    assert half == {"bytes": 5, "predicted_share": 0.3, "measured_share": 0.25, "abs_error": 0.05, "hits": 25,
                    "demands": 100, "predicted_token_share": 0.15, "measured_token_share": 0.1,
                    "token_abs_error": 0.05}  # fmt: skip
    assert rec["measured_share"] == 0.5 and rec["abs_error"] == 0.05
    assert out["real_max_abs_error"] == 0.05
    assert out["real_token_max_abs_error"] == pytest.approx(0.05)
    assert out["real_naive_max_abs_error"] == 0.25  # |0.5 - 0.25|


def test_token_share_and_schedule() -> None:
    assert token_share({"radix": 10, "cpu": 30}, "cpu", 120) == 0.25
    assert token_share({"radix": 10}, "cpu", 120) == 0.0
    spec = RealSpec(users=5, requests=50)
    s = schedule(spec)
    assert s == schedule(spec) and len(s) == 50 and set(s) <= set(range(5))
    assert s.count(0) > s.count(4)  # Zipf: the first user speaks most
