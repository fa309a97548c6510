"""One verification per read of a tier, and never a bad block carried down to be signed.

A shared tier (Redis here, S3 alike) is wrapped in a SignedTier whose MAC covers the key and
every byte: a read from it is checked by that MAC alone, not by ``block_fault`` over the same
bytes again; a disk tier's read is checked by ``block_fault`` once. That is sound only because a
daemon signs nothing it has not verified, so a block corrupted in a tier above (a stray write
into a lower cpu tier, bytes flipped in a disk top) is deleted and counted when it is evicted
toward the shared tier, not moved down, where it would be signed and then served.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import kvstore.store.shared_state as shared_state
from kvstore.block import encode_block
from kvstore.server.metrics import StoreMetrics
from kvstore.store.signed_tier import SignedTier
from kvstore.store.tier_bookkeeping import LevelOptions
from kvstore.store.tiered_store import TieredStore
from tiers.base import Tier
from tiers.cpu import CpuTier
from tiers.disk import DiskTier
from tiers.mac import BlockMac

pytestmark = pytest.mark.timeout(120)

BLOCK = 64 * 1024
A, B, C = (b"k-verify-once-%d" % i for i in range(3))


def _block(key: bytes, seed: int = 1) -> bytes:
    return encode_block(key, np.random.default_rng(seed).integers(0, 256, BLOCK - 64, dtype=np.uint8))


def _flip(data: bytes) -> bytes:
    bad = bytearray(data)
    bad[len(bad) // 2] ^= 0xFF
    return bytes(bad)


@pytest.fixture
def signed(redis_url: str) -> Iterator[SignedTier]:
    import redis

    from tiers.redis import RedisTier

    prefix = f"v1-{uuid.uuid4().hex[:12]}:".encode()
    yield SignedTier(RedisTier(redis_url, 64 * BLOCK, prefix=prefix), BlockMac(b"s" * 43))  # closed by its store
    plain = redis.Redis.from_url(redis_url)
    plain.delete(*(prefix + k for k in (A, B, C)))
    plain.close()


def _open(levels: list[tuple[Tier, LevelOptions]], signed: SignedTier | None) -> tuple[TieredStore, StoreMetrics]:
    metrics = StoreMetrics()
    if signed is not None:
        signed._on_reject = metrics.corrupt  # as kvstore/store/tier_factory.py wires it
    store = TieredStore(levels, observer=metrics)
    metrics.bind(store)
    return store, metrics


def _corrupt(m: StoreMetrics, tier: str, reason: str = "checksum") -> float:
    return m.registry.get_sample_value("tierkv_tier_corrupt_blocks_total", {"tier": tier, "reason": reason}) or 0.0


@pytest.fixture
def faults(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """The keys the store ran ``block_fault`` on."""
    seen: list[bytes] = []
    real = shared_state.block_fault

    def counting(buf: bytes | bytearray | memoryview, key: bytes) -> str | None:
        seen.append(key)
        return real(buf, key)

    monkeypatch.setattr(shared_state, "block_fault", counting)
    return seen


def test_a_read_from_a_signed_tier_is_checked_by_its_mac_alone(signed: SignedTier, faults: list[bytes]) -> None:
    store, _ = _open([(CpuTier(BLOCK), LevelOptions()), (signed, LevelOptions(shared=True, write_through=True))],
                     signed)  # fmt: skip
    try:
        assert store.put(A, _block(A)) and store.put(B, _block(B, 2)) and store.flush(timeout=60)
        assert store.lookup([A]).tiers == ["redis"]
        faults.clear()
        assert store.get(A) == _block(A)
        assert faults == []  # the MAC verified these bytes; block_fault over them again would be a second pass
    finally:
        store.close()


def test_a_read_from_a_disk_tier_is_checked_once(tmp_path: Path, faults: list[bytes]) -> None:
    store, _ = _open([(CpuTier(BLOCK), LevelOptions()), (DiskTier(tmp_path / "disk", 64 * BLOCK), LevelOptions())],
                     None)  # fmt: skip
    try:
        assert store.put(A, _block(A)) and store.put(B, _block(B, 2)) and store.flush(timeout=60)
        assert store.lookup([A]).tiers == ["disk"]
        faults.clear()
        assert store.get(A) == _block(A)
        assert faults == [A]
    finally:
        store.close()


def test_a_bad_block_evicted_from_a_lower_tier_is_not_carried_down_to_be_signed(
        tmp_path: Path, signed: SignedTier) -> None:  # fmt: skip
    """disk (top) -> cpu -> signed Redis: A, corrupted in the cpu tier, is evicted toward Redis."""
    cpu = CpuTier(BLOCK)
    store, metrics = _open([(DiskTier(tmp_path / "top", BLOCK), LevelOptions()), (cpu, LevelOptions()),
                            (signed, LevelOptions(shared=True))], signed)  # fmt: skip
    try:
        assert store.put(A, _block(A)) and store.put(B, _block(B, 2)) and store.flush(timeout=60)
        assert store.lookup([A]).tiers == ["cpu"]
        run = cpu._blocks[A]  # a stray write into the arena, as a buggy DMA or pointer would
        assert cpu._arena is not None and run.offset >= 0
        cpu._arena[run.offset + BLOCK // 2] ^= 0xFF  # inside the payload
        assert store.put(C, _block(C, 3)) and store.flush(timeout=60)  # B down to cpu, A out of it
        assert signed.inner.contains_many([A]) == [False], "a corrupt block was signed into Redis"
        assert _corrupt(metrics, "cpu") == 1
        assert store.get(A) is None and store.lookup([A]).tiers == [None]
        assert store.put(A, _block(A)) and store.get(A) == _block(A)  # a fresh copy is stored and served
    finally:
        store.close()


def test_a_bad_block_evicted_from_a_disk_top_is_not_carried_down_to_be_signed(
        tmp_path: Path, signed: SignedTier) -> None:  # fmt: skip
    top = DiskTier(tmp_path / "top", BLOCK)
    store, metrics = _open([(top, LevelOptions()), (signed, LevelOptions(shared=True))], signed)
    try:
        assert store.put(A, _block(A))
        top.put(A, _flip(_block(A)))  # behind the store's back, as a disk could
        assert store.put(B, _block(B, 2)) and store.flush(timeout=60)  # A is the top's victim
        assert signed.inner.contains_many([A]) == [False], "a corrupt block was signed into Redis"
        assert _corrupt(metrics, "disk") == 1
        assert store.get(A) is None and store.lookup([A]).tiers == [None]
        assert store.get(B) == _block(B, 2)
    finally:
        store.close()
