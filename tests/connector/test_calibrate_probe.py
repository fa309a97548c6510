"""The start-up daemon probe (connector/probe.py): the fit on synthetic timings, the cache size from
sysfs, the batch plan, and, against an in-process daemon, that every timed read is of a block no
earlier read touched, more distinct bytes than the cache in all (the old probe re-read 16 blocks)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from connector.calibrate import probe_daemon
from connector.loader import Loader
from connector.probe import (
    LLC_FALLBACK_BYTES,
    ProbeError,
    fit_line,
    llc_bytes,
    parse_cache_size,
    plan_batches,
    probe_set_bytes,
)
from tests.fixtures_engine import make_engine
from tests.fixtures_kvstore import connect, inprocess_daemon

pytestmark = pytest.mark.timeout(120)
MiB = 2**20


def test_the_fit_recovers_per_call_cost_and_bandwidth_from_noisy_timings() -> None:
    rng = np.random.default_rng(0)
    sizes = [s * 8 * MiB for s in (1, 2, 3, 4)]
    pts = [(s, 2e-4 + s / 6e9 + abs(rng.normal(0, 2e-5))) for s in sizes for _ in range(2)]
    lat, slope = fit_line(pts)
    assert lat == pytest.approx(2e-4, rel=0.3)
    assert 1 / slope == pytest.approx(6e9, rel=0.05)


def test_the_fit_is_not_the_two_point_difference() -> None:
    """(t4 - t1) / 3 with a noisy t1 misreads the slope; the line through all sizes does not."""
    pts = [(1 * MiB, 0.5e-3), (2 * MiB, 0.2e-3 + 2 * MiB / 5e9), (3 * MiB, 0.2e-3 + 3 * MiB / 5e9),
           (4 * MiB, 0.2e-3 + 4 * MiB / 5e9)]
    two_point = (pts[-1][1] - pts[0][1]) / (pts[-1][0] - pts[0][0])
    _, slope = fit_line(pts)
    assert abs(1 / slope - 5e9) < abs(1 / two_point - 5e9)


def test_a_negative_intercept_refits_through_the_origin_and_one_size_is_refused() -> None:
    lat, slope = fit_line([(1e6, 1e-4), (2e6, 3e-4), (3e6, 5e-4)])  # intercept -1e-4
    assert lat == 0.0 and slope > 0
    with pytest.raises(ProbeError):
        fit_line([(1e6, 1e-4), (1e6, 2e-4)])


def test_cache_size_comes_from_the_highest_data_level(tmp_path: Path) -> None:
    for name, level, kind, size in (("index0", 1, "Data", "48K"), ("index1", 1, "Instruction", "64K"),
                                    ("index2", 2, "Unified", "2048K"), ("index3", 3, "Unified", "36M")):
        d = tmp_path / name
        d.mkdir()
        (d / "level").write_text(f"{level}\n")
        (d / "type").write_text(f"{kind}\n")
        (d / "size").write_text(f"{size}\n")
    assert llc_bytes(tmp_path) == 36 * MiB
    assert llc_bytes(tmp_path / "absent") == LLC_FALLBACK_BYTES
    assert parse_cache_size("491520K") == 480 * MiB
    with pytest.raises(ValueError):
        parse_cache_size("lots")


def test_the_set_exceeds_the_cache_within_its_bounds() -> None:
    assert probe_set_bytes(32 * MiB, 1 << 30, None) > 32 * MiB
    assert probe_set_bytes(480 * MiB, 1 << 30, 512 * MiB) == 256 * MiB  # half the tier's free room


def test_the_plan_reads_every_block_once_in_several_sizes() -> None:
    plan = plan_batches(200, max_batch=64, min_batch=4)
    ranges = [set(range(f, f + n)) for f, n in plan]
    assert sum(len(r) for r in ranges) == len(set().union(*ranges)) == 200  # each block read once, all of them
    assert sorted({n for _, n in plan}) == [10, 20, 30, 40]
    assert [n for _, n in plan][:4] == [10, 20, 30, 40] and [n for _, n in plan][4:] == [40, 30, 20, 10]
    capped = plan_batches(1000, max_batch=40, min_batch=4)  # batches bounded by the scratch pages: more rounds
    assert max(n for _, n in capped) == 40 and sum(n for _, n in capped) >= 1000


def test_the_probe_reads_distinct_blocks_beyond_the_cache(tiny) -> None:
    """Every timed load's keys are new to the probe and the set exceeds the (stated) cache: fails
    for the old probe, which loaded the same 16 keys three times at two sizes."""
    eng = make_engine(tiny, num_pages=64)
    page = eng.view.pool.bytes_per_page
    llc = 40 * page
    free = eng.pool.allocator.num_free()
    with inprocess_daemon() as d, connect(d) as c:
        loader = Loader(c, eng.view.pool, 32 * MiB)
        loaded: list[bytes] = []
        real_load = loader.load

        def spy(keys, pages, deadline_s, in_place=None):
            loaded.extend(keys)
            return real_load(keys, pages, deadline_s, in_place=in_place)

        loader.load = spy  # type: ignore[method-assign]
        res = probe_daemon(c, loader, eng.view, llc=llc)
        assert res is not None
        assert len(loaded) == len(set(loaded))  # no block read twice
        assert len(set(loaded)) * page > llc and res.exceeds_llc and res.set_bytes > llc
        assert len({n for n, _ in res.points}) >= 3 and res.bandwidth > 0 and res.latency_s >= 0
        assert eng.pool.allocator.num_free() == free  # its scratch pages were given back
        assert d.store.stats().tiers[0].blocks == 0  # its scratch blocks were deleted
