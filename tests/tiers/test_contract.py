"""The Tier contract, run against every tier on real servers (cpu, disk, s3, redis, redis-cluster).

Why a contract: the TieredStore treats tiers as interchangeable byte stores, so each one must
agree on misses (None), overwrite semantics, ``contains_many`` in key order, ``scan`` with sizes
(used to rebuild the index after a restart), binary keys, and what ``close`` means.
"""

from __future__ import annotations

import numpy as np
import pytest

from tiers.base import Tier
from tiers.errors import BlockTooLarge, TierError

pytestmark = pytest.mark.timeout(60)

MiB = 1 << 20
SIZES = [MiB // 2, MiB, 2 * MiB - 12345]  # 0.5-2 MB blocks, one of them not page-aligned


def blob(n: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def as_bytes(value: object) -> bytes | None:
    return None if value is None else bytes(value)  # type: ignore[call-overload]


def has(tier: Tier, key: bytes) -> bool:
    return tier.contains_many([key]) == [True]


def stored_bytes(tier: Tier) -> int:
    return sum(n for _, n in tier.scan())


def test_round_trip_large_values(tier: Tier) -> None:
    values = {f"key-{i}".encode(): blob(n, i) for i, n in enumerate(SIZES)}
    for k, v in values.items():
        tier.put(k, v)
    for k, v in values.items():
        assert as_bytes(tier.get(k)) == v
        assert has(tier, k)


def test_overwrite_replaces_value_and_size(tier: Tier) -> None:
    tier.put(b"k", blob(2 * MiB, 1))
    small = blob(MiB // 2, 2)
    tier.put(b"k", small)
    assert as_bytes(tier.get(b"k")) == small
    assert list(tier.scan()) == [(b"k", len(small))]


def test_miss_returns_none(tier: Tier) -> None:
    assert tier.get(b"absent") is None
    assert not has(tier, b"absent")
    assert tier.delete(b"absent") is False


def test_delete(tier: Tier) -> None:
    tier.put(b"gone", blob(MiB, 3))
    tier.put(b"kept", blob(MiB, 4))
    assert tier.delete(b"gone") is True
    assert tier.get(b"gone") is None and not has(tier, b"gone")
    assert tier.delete(b"gone") is False
    assert as_bytes(tier.get(b"kept")) == blob(MiB, 4)


def test_contains_many_in_key_order(tier: Tier) -> None:
    keys = [f"b{i}".encode() for i in range(6)]
    for i, k in enumerate(keys):
        tier.put(k, blob(SIZES[i % 3], 10 + i))
    assert tier.contains_many([b"missing", keys[3]]) == [False, True]
    tier.delete(keys[0])
    tier.delete(keys[5])
    assert tier.contains_many(keys) == [False, True, True, True, True, False]
    assert tier.contains_many([]) == []


def test_scan_sizes_follow_overwrites_and_deletes(tier: Tier) -> None:
    assert stored_bytes(tier) == 0
    for k, n, seed in ((b"a", MiB, 20), (b"b", MiB // 2, 21), (b"c", 2 * MiB, 22)):
        tier.put(k, blob(n, seed))
    assert stored_bytes(tier) == MiB + MiB // 2 + 2 * MiB
    tier.put(b"a", blob(1000, 23))  # overwrite shrinks
    assert dict(tier.scan()) == {b"a": 1000, b"b": MiB // 2, b"c": 2 * MiB}
    tier.delete(b"c")
    tier.delete(b"b")
    assert dict(tier.scan()) == {b"a": 1000}


def test_scan_lists_keys_and_sizes(tier: Tier) -> None:
    expected = {f"s{i}".encode(): SIZES[i % 3] for i in range(5)}
    for i, (k, n) in enumerate(expected.items()):
        tier.put(k, blob(n, i))
    tier.delete(b"s4")
    del expected[b"s4"]
    assert dict(tier.scan()) == expected


def test_binary_keys(tier: Tier) -> None:
    keys = [bytes(range(32)), b"\xff" * 16, b"a*b?[c]\\d", b"\x00", bytes(range(255, 191, -1))]
    for i, k in enumerate(keys):
        tier.put(k, blob(1000 + i, 30 + i))
    for i, k in enumerate(keys):
        assert as_bytes(tier.get(k)) == blob(1000 + i, 30 + i)
    assert sorted(k for k, _ in tier.scan()) == sorted(keys)
    assert tier.delete(b"a*b?[c]\\d") and not has(tier, b"a*b?[c]\\d")
    assert has(tier, b"\x00")


def test_accepts_any_buffer(tier: Tier) -> None:
    raw = blob(MiB, 40)
    tier.put(b"ba", bytearray(raw))
    tier.put(b"mv", memoryview(raw)[10:])
    tier.put(b"np", np.frombuffer(raw, dtype=np.float32))
    assert as_bytes(tier.get(b"ba")) == raw
    assert as_bytes(tier.get(b"mv")) == raw[10:]
    assert as_bytes(tier.get(b"np")) == raw
    assert stored_bytes(tier) == 3 * MiB - 10


def test_empty_value(tier: Tier) -> None:
    tier.put(b"empty", b"")
    assert as_bytes(tier.get(b"empty")) == b""
    assert has(tier, b"empty")
    assert dict(tier.scan()) == {b"empty": 0}


def test_block_larger_than_capacity(tier_factory) -> None:  # type: ignore[no-untyped-def]
    small = tier_factory(capacity_bytes=MiB)
    with pytest.raises(BlockTooLarge):
        small.put(b"big", blob(MiB + 1, 50))
    assert small.get(b"big") is None
    small.put(b"fits", blob(MiB, 51))
    assert as_bytes(small.get(b"fits")) == blob(MiB, 51)


def test_close_is_idempotent_and_final(tier: Tier) -> None:
    tier.put(b"k", b"v")
    tier.close()
    tier.close()
    for op in (lambda: tier.get(b"k"), lambda: tier.put(b"k", b"v"), lambda: tier.contains_many([b"k"]),
               lambda: tier.delete(b"k"), lambda: list(tier.scan())):
        with pytest.raises(TierError):
            op()


def test_context_manager_closes(tier: Tier) -> None:
    with tier as t:
        t.put(b"k", b"v")
    with pytest.raises(TierError):
        tier.get(b"k")


def test_returned_value_outlives_overwrite_and_delete(tier: Tier) -> None:
    """What ``get`` returned stays intact when the key changes (cpu hands out arena views)."""
    first = blob(MiB, 60)
    tier.put(b"k", first)
    held = tier.get(b"k")
    tier.put(b"k", blob(MiB, 61))
    held_too = tier.get(b"k")
    tier.delete(b"k")
    tier.put(b"other", blob(2 * MiB, 62))  # would reuse freed space if it were freed too early
    assert as_bytes(held) == first
    assert as_bytes(held_too) == blob(MiB, 61)


def test_what_is_derived_from_a_returned_value_outlives_it_too(tier: Tier) -> None:
    """A slice or numpy array made from what ``get`` returned keeps those bytes after the value
    itself is dropped and the key deleted (the cpu tier reuses arena bytes only when nothing
    derived from its view is left), and once they go too, the space is reused."""
    first = blob(MiB, 70)
    tier.put(b"k", first)
    got = tier.get(b"k")
    part = memoryview(got)[100:]
    arr = np.frombuffer(memoryview(got)[: MiB // 2], dtype=np.uint8)
    del got
    tier.delete(b"k")
    for i in range(3):
        tier.put(b"other-%d" % i, blob(MiB, 71 + i))  # would land on the freed run if freed too early
    assert bytes(part) == first[100:] and arr.tobytes() == first[: MiB // 2]
    del part, arr
    for i in range(3):
        tier.delete(b"other-%d" % i)
    tier.put(b"again", blob(MiB, 80))
    assert as_bytes(tier.get(b"again")) == blob(MiB, 80)


def test_capacity_is_reusable(tier_factory) -> None:  # type: ignore[no-untyped-def]
    """Fill to capacity, free, fill again: freed bytes come back (arena runs, lmdb pages)."""
    small = tier_factory(capacity_bytes=4 * MiB)
    for rnd in range(3):
        keys = [b"r%d-%d" % (rnd, i) for i in range(4)]
        for i, k in enumerate(keys):
            small.put(k, blob(MiB - 64 * i, rnd * 10 + i))
            assert small.get(k) is not None  # drop the returned view at once
        assert [small.delete(k) for k in keys] == [True] * 4
    assert stored_bytes(small) == 0


# -- options of one tier kind (not part of the shared contract) -----------------------------


def test_redis_ttl_is_applied(redis_url: str) -> None:
    import redis

    from tiers.redis import RedisTier

    with RedisTier(redis_url, MiB, ttl_s=30, prefix=b"ttl-test:") as t:
        t.put(b"k", b"v")
        plain = redis.Redis.from_url(redis_url)
        assert 0 < plain.ttl(b"ttl-test:k") <= 30
        t.delete(b"k")
        plain.close()


def test_s3_contents_found_again_by_a_new_instance(s3_endpoint) -> None:  # type: ignore[no-untyped-def]
    from tiers.s3 import S3Tier

    ep = s3_endpoint
    args = (ep.url, "tierkv-tests", 16 * MiB)
    kw = dict(prefix="reopen/", access_key=ep.access_key, secret_key=ep.secret_key, region=ep.region)
    with S3Tier(*args, **kw) as t:
        t.put(b"a", blob(MiB, 70))
        t.put(b"b", b"xyz")
    with S3Tier(*args, **kw) as t:
        assert dict(t.scan()) == {b"a": MiB, b"b": 3}
        assert as_bytes(t.get(b"a")) == blob(MiB, 70)
        t.delete(b"a")
        t.delete(b"b")


def test_concurrent_use_keeps_values_intact(tier: Tier) -> None:
    """The daemon serves many clients from threads: no torn or mixed-up values, sane accounting."""
    import threading

    values = {i: bytes([i]) * (64 * 1024 + 1000 * i) for i in range(8)}
    bad: list[int] = []

    def worker(seed: int) -> None:
        rng = np.random.default_rng(seed)
        for _ in range(25):
            i = int(rng.integers(len(values)))
            op = int(rng.integers(3))
            if op == 0:
                tier.put(b"c%d" % i, values[i])
            elif op == 1:
                got = tier.get(b"c%d" % i)
                if got is not None and bytes(got) != values[i]:
                    bad.append(i)
            else:
                tier.delete(b"c%d" % i)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert bad == []
    assert all(n == len(values[int(k[1:])]) for k, n in tier.scan())
