"""Two nodes share one real Redis and one real S3 bucket: a node restarting small deletes nothing
the other node wrote.

Why: the shared key space used to be scanned and trimmed to the restarting node's capacity, so
one node restarting with ``--redis-capacity 1MiB`` emptied the cache of every other node. Now a
shared tier's budget is the server's own (maxmemory/TTL, an S3 lifecycle rule) and a store's
capacity for it covers only what that store wrote (kvstore/README.md, "Shared tiers").
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import boto3
import numpy as np
import pytest
import redis

from bench.servers import S3Endpoint
from kvstore.block import encode_block
from kvstore.store.tier_bookkeeping import LevelOptions
from kvstore.store.tiered_store import TieredStore
from tests.fixtures_servers import TEST_BUCKET
from tiers.cpu import CpuTier
from tiers.redis import RedisTier
from tiers.s3 import S3Tier

pytestmark = pytest.mark.timeout(180)

BLOCK = 64 * 1024
SHARED = LevelOptions(shared=True, write_through=True)


def _k(node: str, i: int) -> bytes:
    return f"{node}-{i:014d}".encode()


def _v(key: bytes) -> bytes:
    seed = int.from_bytes(key[-8:], "little") + key[0]
    return encode_block(key, np.random.default_rng(seed).integers(0, 256, BLOCK - 64, dtype=np.uint8))


class Cluster:
    """Where the nodes meet: one Redis prefix and one S3 prefix, both shared."""

    def __init__(self, redis_url: str, ep: S3Endpoint) -> None:
        self.redis_url, self.ep = redis_url, ep
        tag = uuid.uuid4().hex[:12]
        self.redis_prefix, self.s3_prefix = f"shared-{tag}:".encode(), f"shared-{tag}/"
        self.redis = redis.Redis.from_url(redis_url)
        self.s3 = boto3.client("s3", endpoint_url=ep.url, aws_access_key_id=ep.access_key,
                               aws_secret_access_key=ep.secret_key, region_name=ep.region)  # fmt: skip

    def node(self, capacity_blocks: int, redis_only: bool = False, s3_only: bool = False) -> TieredStore:
        levels = [(CpuTier(2 * BLOCK), LevelOptions())]
        if not s3_only:
            levels.append((RedisTier(self.redis_url, capacity_blocks * BLOCK, prefix=self.redis_prefix), SHARED))
        if not redis_only:
            ep = self.ep
            levels.append((S3Tier(ep.url, TEST_BUCKET, capacity_blocks * BLOCK, prefix=self.s3_prefix,
                                  access_key=ep.access_key, secret_key=ep.secret_key, region=ep.region), SHARED))  # fmt: skip
        return TieredStore(levels)

    def in_redis(self, key: bytes) -> bool:
        return bool(self.redis.exists(self.redis_prefix + key))

    def in_s3(self, key: bytes) -> bool:
        listing = self.s3.list_objects_v2(Bucket=TEST_BUCKET, Prefix=self.s3_prefix + key.hex())
        return listing.get("KeyCount", 0) > 0

    def clear(self) -> None:
        for k in self.redis.scan_iter(match=self.redis_prefix + b"*"):
            self.redis.delete(k)
        for obj in self.s3.list_objects_v2(Bucket=TEST_BUCKET, Prefix=self.s3_prefix).get("Contents", []):
            self.s3.delete_object(Bucket=TEST_BUCKET, Key=obj["Key"])
        self.redis.close()


@pytest.fixture
def cluster(redis_url: str, s3_endpoint: S3Endpoint) -> Iterator[Cluster]:
    c = Cluster(redis_url, s3_endpoint)
    yield c
    c.clear()


def _write(node: TieredStore, keys: list[bytes]) -> None:
    for k in keys:
        assert node.put(k, _v(k))
    assert node.flush(timeout=120)


def test_a_node_restarting_small_keeps_the_other_nodes_blocks(cluster: Cluster) -> None:
    a_keys = [_k("a", i) for i in range(12)]
    b_keys = [_k("b", i) for i in range(6)]
    a = cluster.node(capacity_blocks=64)
    _write(a, a_keys)
    b = cluster.node(capacity_blocks=64)
    _write(b, b_keys)
    b.close()
    assert all(cluster.in_redis(k) and cluster.in_s3(k) for k in a_keys + b_keys)

    b = cluster.node(capacity_blocks=1)  # node b comes back with room for one block
    try:
        # and writes past that room: blocks of its own, and blocks node a wrote too (the same
        # prompt prefix served on both nodes has the same keys), which it then evicts
        _write(b, a_keys[:4] + [_k("b", i) for i in range(6, 12)])
        for t in b.stats().tiers[1:]:
            assert t.used_bytes <= t.capacity_bytes  # its accounting covers only its own writes
    finally:
        b.close()

    assert all(cluster.in_redis(k) for k in a_keys), "node b deleted node a's blocks from redis"
    assert all(cluster.in_s3(k) for k in a_keys), "node b deleted node a's blocks from s3"
    a.close()
    for only in ({"redis_only": True}, {"s3_only": True}):  # a restarts: each shared tier serves it
        a = cluster.node(capacity_blocks=64, **only)
        try:
            assert [a.get(k) for k in a_keys] == [_v(k) for k in a_keys]
        finally:
            a.close()


def test_an_explicit_delete_still_reaches_the_shared_tiers(cluster: Cluster) -> None:
    """Only capacity decisions are left to the server: a delete asked for by a client is done."""
    a = cluster.node(capacity_blocks=64)
    try:
        key = _k("a", 99)
        _write(a, [key])
        assert cluster.in_redis(key) and cluster.in_s3(key)
        assert a.delete(key)
        assert not cluster.in_redis(key) and not cluster.in_s3(key)
    finally:
        a.close()
