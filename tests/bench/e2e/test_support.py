"""bench.e2e's shared parts: the memcpy floor on the load's threads, one start-up probe per daemon,
and the disk cooler evicting before the disk daemon's points only."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from bench.e2e.cold import DiskCooler
from bench.e2e.support import Bench, ThreadedCopy, memcpy_bandwidth
from bench.tiers.page_cache import resident_fraction
from connector.cost_model import PrefillModel
from connector.wiring import detach_tierkv
from tests.fixtures_kvstore import daemon

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("threads", [1, 3])
def test_the_threaded_copy_copies_every_byte(threads: int) -> None:
    src = np.arange(1_000_003, dtype=np.uint8)
    dst = np.zeros_like(src)
    copy = ThreadedCopy(threads)
    try:
        copy(dst, src)
    finally:
        copy.close()
    assert np.array_equal(dst, src) and copy.threads == threads
    assert memcpy_bandwidth(2) > 0


def test_each_daemon_is_probed_once_and_every_connector_seeded_with_it(tiny, tmp_path: Path) -> None:
    b = Bench(tiny, 1, PrefillModel(0.005, 1e-3, 0.0))
    with daemon(tmp_path, "--cpu", "64MiB") as d:
        eng0 = b.engine(64)
        probe = b.attach(eng0, d.address).probe_result
        assert probe is not None and b.probes[d.address] is probe
        detach_tierkv(eng0)
        eng = b.engine(64)
        second = b.attach(eng, d.address)
        try:
            assert second.probe_result is None  # it did not probe again ...
            t = second.cost.tier(probe.tier)  # ... yet knows the first probe's figure
            assert (t.latency_s, t.bandwidth) == (pytest.approx(probe.latency_s), pytest.approx(probe.bandwidth))
        finally:
            detach_tierkv(eng)


def test_the_cooler_evicts_before_the_disk_daemons_points_only(tmp_path: Path) -> None:
    lmdb = tmp_path / "lmdb"
    lmdb.mkdir()
    data = lmdb / "data.mdb"
    data.write_bytes(os.urandom(4 << 20))
    data.read_bytes()
    cooler = DiskCooler("disk:1", lmdb, os.getpid())
    cooler.before("cpu:2")
    assert cooler.results == [] and resident_fraction(data) > 0.9
    cooler.before("disk:1")
    s = cooler.summary()
    assert s["disk_cold_points"] == 1 and s["disk_cold_verified"] and s["disk_resident_after_max"] <= 0.05
    assert "posix_fadvise" in s["disk_cold_method"]
