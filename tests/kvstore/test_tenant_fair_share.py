"""Fair share of the top tier between tenants (``tenant_fair_share``, LevelOptions.fair_share;
kvstore/store/tier_bookkeeping.py): with no per-tenant quota, when the top tier is full the victim
comes first from a tenant holding more than capacity / tenants there, so a heavy tenant's flood
cannot push a light tenant's working set out. Real tiers (cpu over disk), real keys."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvstore.block import encode_block
from kvstore.config.store_config import StoreConfig, TierConfig
from kvstore.keys import Namespace, chain_keys
from kvstore.store.tier_bookkeeping import LevelOptions
from kvstore.store.tier_factory import build_store
from kvstore.store.tiered_store import TieredStore
from tiers.cpu import CpuTier
from tiers.disk import DiskTier

BLOCK = 64 * 1024
NS = Namespace.from_model({"n_layer": 2}, "sha256:fs", "float32", page_size=4)


def _keys(tenant: str, n: int, seed: int) -> list[bytes]:
    return chain_keys(NS.in_tenant(tenant), [seed * 1000 + i for i in range(4 * n)])


def _v(key: bytes) -> bytes:
    head = len(encode_block(key, np.zeros(0, np.uint8)))
    return encode_block(key, np.full(BLOCK - head, 7, np.uint8))


def _store(tmp: Path, fair: bool, cpu_blocks: int = 8) -> TieredStore:
    return TieredStore([(CpuTier(cpu_blocks * BLOCK), LevelOptions(fair_share=fair)),
                        (DiskTier(tmp / "d", 256 * BLOCK), LevelOptions())])


def _flood(s: TieredStore, light: list[bytes], heavy: list[bytes]) -> None:
    for k in light:
        s.put(k, _v(k))
    for k in heavy:  # the heavy tenant writes five times the top tier, never rereading
        s.put(k, _v(k))
    s.flush()


@pytest.mark.parametrize("fair", [True, False], ids=["fair-share", "off"])
def test_a_light_tenants_working_set_survives_a_heavy_flood_only_with_fair_share(tmp_path: Path, fair: bool) -> None:
    light, heavy = _keys("light", 3, seed=1), _keys("heavy", 40, seed=2)
    with _store(tmp_path, fair) as s:
        _flood(s, light, heavy)
        where = s.lookup(light).tiers
        if fair:
            assert where == ["cpu"] * 3  # under its share (8 / 2 = 4 blocks): none of its blocks left the top
            assert sum(1 for t in s.lookup(heavy).tiers if t == "cpu") == 5  # the rest of the top is the heavy one's
        else:
            assert "cpu" not in where  # plain LRU: the flood pushed every one of them down
        assert all(t is not None for t in where)  # spilled, never lost
        assert [s.get(k) for k in light] == [_v(k) for k in light]


def test_a_tenant_over_its_share_loses_its_own_oldest_first(tmp_path: Path) -> None:
    a, b = _keys("a", 6, seed=3), _keys("b", 2, seed=4)
    with _store(tmp_path, True) as s:
        for k in b + a:  # the top is full: a holds 6 of 8 (share 4), b 2 (the least recently used)
            s.put(k, _v(k))
        s.flush()
        newcomer = _keys("c", 2, seed=5)
        for k in newcomer:  # a third tenant arrives: room is made from a (6 > 8 / 3), its oldest first
            s.put(k, _v(k))
        s.flush()
        assert s.lookup(b).tiers == ["cpu"] * 2 and s.lookup(newcomer).tiers == ["cpu"] * 2
        assert s.lookup(a[:2]).tiers == ["disk", "disk"] and s.lookup(a[2:]).tiers == ["cpu"] * 4


def test_within_their_shares_the_eviction_policy_chooses(tmp_path: Path) -> None:
    a, b = _keys("a", 4, seed=6), _keys("b", 4, seed=7)
    with _store(tmp_path, True) as s:
        for k in a + b:  # full, each tenant at its share (4 of 8)
            s.put(k, _v(k))
        s.flush()
        s.get(a[0])  # a's oldest is now recently used: LRU's victim is a[1]
        extra = _keys("b", 2, seed=8)
        s.put(extra[0], _v(extra[0]))  # nobody above its share: the policy (LRU) chooses, a[1]
        s.flush()
        assert s.lookup(a).tiers == ["cpu", "disk", "cpu", "cpu"]
        s.put(extra[1], _v(extra[1]))  # b now holds 5 > 4: its own oldest goes, not a's
        s.flush()
        assert s.lookup(a).tiers == ["cpu", "disk", "cpu", "cpu"] and s.lookup([b[0]]).tiers == ["disk"]
        assert s.lookup(b[1:] + extra).tiers == ["cpu"] * 5


def test_the_config_knob_turns_it_on_for_the_top_tier_only(tmp_path: Path) -> None:
    tiers = (TierConfig("cpu", 1 << 20), TierConfig("disk", 4 << 20, path=str(tmp_path / "disk")))
    for on in (True, False):
        with build_store(StoreConfig(tiers=tiers, tenant_fair_share=on)) as s:
            assert [lv.options.fair_share for lv in s.levels] == [on, False]
