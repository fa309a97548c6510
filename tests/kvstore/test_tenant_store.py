"""The daemon's side of tenants: the tag a key carries is parsed for accounting (bytes and blocks per
tenant, per tier, found again after a restart from the disk tier's keys) and the top tier's optional
per-tenant quota spills a tenant's own oldest blocks, never another tenant's."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvstore.block import encode_block
from kvstore.keys import TENANT_MAGIC, Namespace, chain_keys, tenant_tag
from kvstore.server.metrics import METRIC_TENANTS, StoreMetrics
from kvstore.store.tenants import DEFAULT, OTHER, SHARED, name_of_salt, tenant_of
from kvstore.store.tier_bookkeeping import LevelOptions
from kvstore.store.tiered_store import TieredStore
from tiers.cpu import CpuTier
from tiers.disk import DiskTier

BLOCK = 64 * 1024
NS = Namespace.from_model({"n_layer": 2}, "sha256:t", "float32", page_size=4)


def _keys(salt: str, n: int, seed: int = 0) -> list[bytes]:
    ids = [seed * 1000 + i for i in range(4 * n)]
    return chain_keys(NS.with_tenant(salt) if salt else NS, ids)


def _v(key: bytes, size: int = BLOCK) -> bytes:
    head = len(encode_block(key, np.zeros(0, np.uint8)))
    return encode_block(key, np.full(size - head, key[-1], np.uint8))


def _store(tmp: Path, cpu_blocks: int, quota_blocks: int = 0, disk_blocks: int = 64) -> TieredStore:
    return TieredStore([(CpuTier(cpu_blocks * BLOCK), LevelOptions()),
                        (DiskTier(tmp / "disk", disk_blocks * BLOCK), LevelOptions())],
                       tenant_quota_bytes=quota_blocks * BLOCK)


def _tenants(store: TieredStore, tier: str) -> dict[str, tuple[int, int]]:
    return {t.tenant: (t.used_bytes, t.blocks) for t in store.stats().tenants if t.tier == tier}


def test_a_key_names_its_tenant() -> None:
    a = _keys("tenant-a", 1)[0]
    assert len(a) == 24 and tenant_of(a) == tenant_tag("tenant-a").hex() == name_of_salt("tenant-a")
    assert tenant_of(_keys("", 1)[0]) == DEFAULT == name_of_salt("") and tenant_of(b"opaque") == DEFAULT
    shared = chain_keys(NS.with_tenant("tenant-a"), list(range(4)), shared_pages=1)[0]
    assert tenant_of(shared) == SHARED
    assert tenant_of(b"t\x01" + bytes(5)) == DEFAULT  # the magic alone, at the wrong length: opaque


def test_usage_per_tenant_in_every_tier_and_after_a_restart(tmp_path: Path) -> None:
    a, b, plain = _keys("tenant-a", 6), _keys("tenant-b", 2), _keys("", 1)
    ta, tb = name_of_salt("tenant-a"), name_of_salt("tenant-b")
    with _store(tmp_path, cpu_blocks=4) as s:
        for k in a + b + plain:
            assert s.put(k, _v(k))
        s.flush()
        cpu, disk = _tenants(s, "cpu"), _tenants(s, "disk")
        # 9 blocks, 4 fit the cpu tier (LRU: the newest); the rest spilled to disk, each still charged to its tenant
        assert cpu == {tb: (2 * BLOCK, 2), ta: (BLOCK, 1), DEFAULT: (BLOCK, 1)}
        assert disk == {ta: (5 * BLOCK, 5)}
        for tier in s.stats().tiers:
            assert sum(u for u, _ in _tenants(s, tier.name).values()) == tier.used_bytes
        assert s.delete(b[0])
        assert _tenants(s, "cpu")[tb] == (BLOCK, 1)
    with _store(tmp_path, cpu_blocks=4) as s:  # restarted: the disk tier's keys still say whose they are
        assert _tenants(s, "disk") == {ta: (5 * BLOCK, 5)}


def test_a_tenant_at_its_quota_spills_its_own_oldest_blocks(tmp_path: Path) -> None:
    a, b = _keys("tenant-a", 7, seed=1), _keys("tenant-b", 3, seed=2)
    with _store(tmp_path, cpu_blocks=8, quota_blocks=4) as s:
        for k in b + a:  # b's blocks are the oldest in the top tier: plain LRU would evict them first
            s.put(k, _v(k))
        s.flush()
        res = s.lookup(b + a)
        assert res.tiers == ["cpu"] * 3 + ["disk"] * 3 + ["cpu"] * 4  # a: only its 4 newest stay on top
        top = s.stats().tiers[0]
        assert top.quota_spills == 3 and top.evictions == 3
        rows = {t.tenant: t for t in s.stats().tenants if t.tier == "cpu"}
        assert rows[name_of_salt("tenant-a")].quota_spills == 3 and rows[name_of_salt("tenant-b")].quota_spills == 0
        assert rows[name_of_salt("tenant-a")].used_bytes == 4 * BLOCK
        # a hit below the top promotes the block: the tenant's quota holds on that path too
        assert s.get(a[0]) is not None
        s.flush()
        assert s.lookup(b).tiers == ["cpu"] * 3 and _tenants(s, "cpu")[name_of_salt("tenant-a")][1] == 4
        assert s.lookup(a[:1]).tiers == ["cpu"]


def test_without_a_quota_the_flood_evicts_the_other_tenant(tmp_path: Path) -> None:
    """The guard above is what keeps b on top: the same puts with no quota push b's blocks out."""
    a, b = _keys("tenant-a", 7, seed=1), _keys("tenant-b", 3, seed=2)
    with _store(tmp_path, cpu_blocks=8) as s:
        for k in b + a:
            s.put(k, _v(k))
        s.flush()
        assert s.lookup(b).tiers[:2] == ["disk", "disk"] and s.stats().tiers[0].quota_spills == 0


def test_a_block_larger_than_the_quota_goes_straight_below(tmp_path: Path) -> None:
    (k,) = _keys("tenant-a", 1)
    with TieredStore([(CpuTier(8 * BLOCK), LevelOptions()), (DiskTier(tmp_path / "d", 64 * BLOCK), LevelOptions())],
                     tenant_quota_bytes=BLOCK) as s:
        assert s.put(k, _v(k, 2 * BLOCK))
        s.flush()
        assert s.lookup([k]).tiers == ["disk"] and s.stats().tiers[0].quota_spills == 1
        assert s.get(k) == _v(k, 2 * BLOCK)  # served from below; never promoted over the quota
        s.flush()
        assert s.lookup([k]).tiers == ["disk"] and s.stats().tiers[0].quota_spills == 1


def test_metrics_label_a_bounded_number_of_tenants(tmp_path: Path) -> None:
    from prometheus_client import generate_latest

    with TieredStore([(CpuTier(64 * BLOCK), LevelOptions())]) as s:
        keys = [k for i in range(40) for k in _keys(f"t{i}", 1, seed=i)]
        for k in keys:
            s.put(k, _v(k))
        m = StoreMetrics()
        m.bind(s)
        text = generate_latest(m.registry).decode()
    series = [line for line in text.splitlines() if line.startswith("tierkv_tenant_used_bytes{")]
    assert len(series) == METRIC_TENANTS and any(f'tenant="{OTHER}"' in line for line in series)
    assert sum(float(line.split()[-1]) for line in series) == 40 * BLOCK


def test_a_level_refuses_a_negative_quota() -> None:
    from kvstore.store.tier_bookkeeping import Level

    with pytest.raises(ValueError):
        Level(CpuTier(BLOCK), LevelOptions(), quota=-1)


def test_a_second_store_on_a_shared_tier_serves_a_tenants_blocks(redis_url: str) -> None:
    """Another node (a fresh store whose only tier is the same Redis) finds the tenant's block under
    its tag, in Redis itself: its lookup and its get agree (the get once skipped a shared top tier)."""
    import uuid

    import redis as redis_py

    from tiers.redis import RedisTier

    prefix = f"ten-{uuid.uuid4().hex[:8]}:".encode()
    salt = f"tenant-{uuid.uuid4().hex[:6]}"
    (k,) = _keys(salt, 1)
    shared = LevelOptions(shared=True, write_through=True)
    with TieredStore([(RedisTier(redis_url, 64 * BLOCK, prefix=prefix), shared)]) as first:
        assert first.put(k, _v(k))
    r = redis_py.Redis.from_url(redis_url)
    try:
        assert r.exists(prefix + k) and k.startswith(TENANT_MAGIC + tenant_tag(salt))  # the tag is in the server's key
    finally:
        r.close()
    with TieredStore([(RedisTier(redis_url, 64 * BLOCK, prefix=prefix), shared)]) as second:
        assert second.lookup([k]).tiers == ["redis"]
        assert second.get(k) == _v(k)
        assert second.stats().tiers[0].promotions == 0  # not copied into the very tier it came from
        second.delete(k)
