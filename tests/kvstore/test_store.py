"""TieredStore over real tiers (cpu arena + lmdb disk): spill, promote, capacity, admission,
error skipping, and the index rebuilt from disk after a restart.

Values are encoded blocks (kvstore/block.py) of exactly BLOCK bytes: the store verifies every
block it reads below the top tier, as the daemon stores nothing else."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import numpy as np
import pytest

from kvstore.block import encode_block
from kvstore.store.tier_bookkeeping import LevelOptions
from kvstore.store.tiered_store import TieredStore
from tiers.cpu import CpuTier
from tiers.disk import DiskTier
from tiers.errors import BlockTooLarge

BLOCK = 64 * 1024


def _k(i: int) -> bytes:
    return i.to_bytes(16, "little")


def _v(i: int, size: int = BLOCK) -> bytes:
    """A block of ``size`` bytes in all (a 64-byte header for a 16-byte key, then the payload)."""
    payload = np.frombuffer((i.to_bytes(4, "little") * (size // 4))[: size - 64], dtype=np.uint8)
    blk = encode_block(_k(i), payload)
    assert len(blk) == size
    return blk


def _store(tmp: Path, cpu_blocks: int = 4, disk_blocks: int = 64, **kw: object) -> TieredStore:
    disk_opts = kw.pop("disk_opts", LevelOptions())
    return TieredStore(
        [(CpuTier(cpu_blocks * BLOCK), LevelOptions()), (DiskTier(tmp / "disk", disk_blocks * BLOCK), disk_opts)],
        **kw,  # type: ignore[arg-type]
    )


def test_put_get_and_idempotent(tmp_path: Path) -> None:
    with _store(tmp_path) as s:
        assert s.put(_k(1), _v(1)) is True
        assert s.put(_k(1), _v(1)) is False  # already held: nothing written
        assert s.get(_k(1)) == _v(1)
        assert s.get(_k(2)) is None
        st = s.stats().tiers[0]
        assert st.blocks == 1 and st.used_bytes == BLOCK and st.hits == 1 and st.misses == 1


def test_spill_to_disk_and_capacity(tmp_path: Path) -> None:
    with _store(tmp_path, cpu_blocks=4, disk_blocks=8) as s:
        for i in range(20):
            s.put(_k(i), _v(i))
            cpu, disk = s.stats().tiers
            assert cpu.used_bytes <= cpu.capacity_bytes
        # while spilling, every block not yet dropped stays readable
        s.flush()
        cpu, disk = s.stats().tiers
        assert cpu.blocks == 4 and disk.blocks == 8
        assert disk.used_bytes <= disk.capacity_bytes and sum(n for _, n in s.levels[1].tier.scan()) <= disk.capacity_bytes
        assert disk.spills == 16 and cpu.evictions == 16 and disk.evictions == 8 and disk.dropped == 8
        res = s.lookup([_k(i) for i in range(12, 20)])
        assert res.prefix_len == 8
        assert res.tiers == ["disk"] * 4 + ["cpu"] * 4
        assert s.lookup([_k(0), _k(19)]) == (0, [None, "cpu"], ["disk", None], None)  # k0 fell off disk lately
        assert s.get(_k(13)) == _v(13)


def test_promotion_on_hit(tmp_path: Path) -> None:
    with _store(tmp_path, cpu_blocks=2) as s:
        for i in range(4):
            s.put(_k(i), _v(i))
        s.flush()
        assert s.lookup([_k(0)]).tiers == ["disk"]
        assert s.get(_k(0)) == _v(0)
        assert s.lookup([_k(0)]).tiers == ["cpu"]
        disk = s.stats().tiers[1]
        assert disk.promotions == 1 and disk.hits == 1
    with _store(tmp_path / "b", cpu_blocks=2, promote_on_hit=False) as s:
        for i in range(4):
            s.put(_k(i), _v(i))
        s.flush()
        assert s.get(_k(0)) == _v(0)
        assert s.lookup([_k(0)]).tiers == ["disk"]


def test_admission_drops_cold_blocks(tmp_path: Path) -> None:
    with _store(tmp_path, cpu_blocks=2, disk_opts=LevelOptions(admit_min_hits=1)) as s:
        s.put(_k(0), _v(0))
        s.put(_k(1), _v(1))
        assert s.get(_k(0)) == _v(0)  # block 0 was hit once: admitted when it spills
        for i in range(2, 5):
            s.put(_k(i), _v(i))
        s.flush()
        assert s.lookup([_k(0), _k(1)]).tiers == ["disk", None]
        assert s.stats().tiers[1].dropped >= 1


def test_block_too_large_and_delete(tmp_path: Path) -> None:
    with _store(tmp_path, cpu_blocks=2, disk_blocks=4) as s:
        with pytest.raises(BlockTooLarge):
            s.put(_k(0), b"x" * (5 * BLOCK))
        big = _v(1, 3 * BLOCK)  # fits disk only: written below
        assert s.put(_k(1), big)
        s.flush()
        assert s.lookup([_k(1)]).tiers == ["disk"] and s.get(_k(1)) == big
        assert s.delete(_k(1)) and not s.delete(_k(1))
        assert s.get(_k(1)) is None and s.stats().tiers[1].used_bytes == 0


def test_disk_index_rebuilt_after_restart(tmp_path: Path) -> None:
    s = _store(tmp_path, cpu_blocks=2)
    for i in range(6):
        s.put(_k(i), _v(i))
    s.close()  # flushes: 4 on disk, 2 were only in cpu (lost, cpu is not persistent)
    with _store(tmp_path, cpu_blocks=2) as s2:
        disk = s2.stats().tiers[1]
        assert disk.blocks == 4 and disk.used_bytes == 4 * BLOCK
        assert s2.lookup([_k(i) for i in range(4)]).prefix_len == 4
        assert s2.get(_k(2)) == _v(2)


def test_failing_tier_is_skipped(tmp_path: Path) -> None:
    with _store(tmp_path, cpu_blocks=2, tier_retry_s=60.0) as s:
        for i in range(4):
            s.put(_k(i), _v(i))
        s.flush()
        s.levels[1].tier.close()  # the disk "dies": every call now raises TierError
        assert s.get(_k(0)) is None  # read falls through to a miss, no crash
        for i in range(4, 8):  # evictions from cpu now have nowhere to go: dropped, no crash
            assert s.put(_k(i), _v(i))
        s.flush()
        st = s.stats().tiers[1]
        assert st.errors >= 1 and not st.available and "closed" in st.last_error
        assert s.get(_k(7)) == _v(7)
        assert s.lookup([_k(0), _k(7)]).tiers == [None, "cpu"]


def test_failing_top_tier_writes_go_below(tmp_path: Path) -> None:
    with _store(tmp_path, tier_retry_s=60.0, detach_after=1) as s:  # detached by its first error
        s.levels[0].tier.close()
        assert s.put(_k(1), _v(1))
        s.flush()
        assert s.get(_k(1)) == _v(1)
        assert s.lookup([_k(1)]).tiers == ["disk"]
        assert s.stats().tiers[0].errors >= 1


def test_concurrent_put_get(tmp_path: Path) -> None:
    errors: list[BaseException] = []
    with _store(tmp_path, cpu_blocks=8, disk_blocks=400, spill_queue_bytes=4 * BLOCK) as s:

        def worker(base: int) -> None:
            try:
                for i in range(base, base + 60):
                    s.put(_k(i), _v(i))
                    got = s.get(_k(i - 3)) if i - 3 >= base else None
                    assert got is None or got == _v(i - 3)
            except BaseException as e:  # noqa: BLE001
                errors.append(e)

        threads = [threading.Thread(target=worker, args=(b * 1000,)) for b in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        s.flush()
        assert not errors
        for b in range(4):
            for i in range(b * 1000, b * 1000 + 60):
                assert s.get(_k(i)) == _v(i)
        cpu, disk = s.stats().tiers
        assert cpu.used_bytes <= cpu.capacity_bytes and disk.used_bytes <= disk.capacity_bytes
        assert os.path.exists(tmp_path / "disk")


def test_no_hit_count_leak_and_policies(tmp_path: Path) -> None:
    for policy in ("s3fifo", "arc"):
        opts = LevelOptions(eviction=policy)
        with TieredStore([(CpuTier(4 * BLOCK), opts), (DiskTier(tmp_path / policy, 8 * BLOCK), opts)]) as s:
            for i in range(40):
                s.put(_k(i), _v(i))
                s.get(_k(i))
            s.flush()
            cpu, disk = s.stats().tiers
            assert cpu.blocks == 4 and disk.blocks == 8
            assert len(s._hits) <= 12  # counts of blocks dropped off the chain are forgotten


def test_metrics_registry_per_store(tmp_path: Path) -> None:
    from prometheus_client import generate_latest

    from kvstore.server.metrics import StoreMetrics

    m1, m2 = StoreMetrics(), StoreMetrics()
    s1 = TieredStore([(CpuTier(4 * BLOCK), LevelOptions())], observer=m1)
    s2 = TieredStore([(CpuTier(8 * BLOCK), LevelOptions())], observer=m2)
    m1.bind(s1)
    m2.bind(s2)
    try:
        s1.put(_k(1), _v(1))
        s1.get(_k(1))
        t1, t2 = generate_latest(m1.registry).decode(), generate_latest(m2.registry).decode()
        assert f'tierkv_tier_capacity_bytes{{tier="cpu"}} {float(4 * BLOCK)}' in t1
        assert f'tierkv_tier_capacity_bytes{{tier="cpu"}} {float(8 * BLOCK)}' in t2
        assert 'tierkv_tier_hits_total{tier="cpu"} 1.0' in t1 and 'tierkv_tier_hits_total{tier="cpu"} 0.0' in t2
        assert 'tierkv_tier_read_seconds_count{tier="cpu"} 1.0' in t1
    finally:
        s1.close()
        s2.close()


def test_tier_counters_are_declared_once() -> None:
    """TierCounters is the one declaration: TierStats carries every counter, the Stats RPC's message
    has a field of each name, and /metrics exports each counter with its doc."""
    from dataclasses import fields

    from prometheus_client import generate_latest

    from kvstore.proto import kvstore_pb2 as pb
    from kvstore.server.metrics import StoreMetrics
    from kvstore.store.results import TierCounters, TierStats

    counters = [f.name for f in fields(TierCounters)]
    assert set(counters) < {f.name for f in fields(TierStats)} == set(pb.TierStats.DESCRIPTOR.fields_by_name)
    m = StoreMetrics()
    store = TieredStore([(CpuTier(4 * BLOCK), LevelOptions())], observer=m)
    m.bind(store)
    try:
        text = generate_latest(m.registry).decode()
        for f in fields(TierCounters):
            assert f"# HELP tierkv_tier_{f.name}_total {f.metadata['doc']}" in text
            assert f'tierkv_tier_{f.name}_total{{tier="cpu"}} 0.0' in text
    finally:
        store.close()


def test_arena_is_the_top_tiers(tmp_path: Path) -> None:
    """What the servicer, metrics and daemon read the arena through: the cpu tier's when it is on top
    (shared or private: ``share()`` says which), None when the top tier keeps no arena."""
    for shared in (None, False):
        top = CpuTier(4 * BLOCK, pinned=False, shared=shared)
        with TieredStore([(top, LevelOptions())]) as s:
            arena = s.arena()
            assert arena is not None and arena.page_kind == top.page_kind
            assert (arena.share() is None) == (shared is False or top.share() is None)
    with TieredStore([(DiskTier(str(tmp_path / "d"), 4 * BLOCK), LevelOptions())]) as s:
        assert s.arena() is None


def test_read_zero_copy_into_a_pool(tmp_path: Path) -> None:
    with _store(tmp_path, cpu_blocks=2) as s:
        for i in range(4):
            s.put(_k(i), _v(i))
        s.flush()
        pool = np.zeros((5, BLOCK), dtype=np.uint8)

        def into(i: int, mv: memoryview) -> bool:
            pool[i] = np.frombuffer(mv, dtype=np.uint8)
            return True

        assert [s.read(_k(i), lambda mv, i=i: into(i, mv)) for i in range(5)] == [True] * 4 + [None]
        assert all(pool[i].tobytes() == _v(i) for i in range(4))
        assert s.delete(_k(0)) and not s.delete(_k(9))


def test_block_lost_behind_the_stores_back_is_a_miss(tmp_path: Path) -> None:
    with _store(tmp_path, cpu_blocks=1) as s:
        s.put(_k(0), _v(0))
        s.put(_k(1), _v(1))
        s.flush()
        assert s.lookup([_k(0)]).tiers == ["disk"]
        s.levels[1].tier.delete(_k(0))  # e.g. wiped by an operator, or another node on a shared tier
        assert s.get(_k(0)) is None
        assert s.stats().tiers[1].blocks == 0  # index healed
        assert s.lookup([_k(0)]).tiers == [None]
