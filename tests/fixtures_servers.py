"""Session-scoped real servers (bench/servers.py) and a factory of fresh tiers of every kind.

Why session scope: starting SeaweedFS or a 3-node Redis Cluster takes seconds, so each starts
once, lazily (only when a test asks for it), and every tier built on it gets its own key prefix
so tests never see each other's blocks. ``make_topology`` builds a cluster's network namespaces
(bench/cluster/topology.py) for the test that asks, for tests/bench/cluster/ and tests/tiers/ alike.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from bench.servers import S3Endpoint, prepare_bucket, redis_cluster, redis_server, seaweedfs_s3
from tiers.base import Tier

if TYPE_CHECKING:
    from bench.cluster.harness import ClusterHarness
    from bench.cluster.topology import Topology

TIER_KINDS = ["cpu", "disk", "s3", "redis", "redis-cluster", "redis-signed"]  # signed: what the daemon builds
TEST_BUCKET = "tierkv-tests"

TierFactory = Callable[..., Tier]


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    with redis_server() as url:
        yield url


@pytest.fixture(scope="session")
def redis_cluster_url() -> Iterator[str]:
    with redis_cluster(nodes=3) as urls:
        yield urls[0]


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[S3Endpoint]:
    with seaweedfs_s3() as endpoint:
        prepare_bucket(endpoint, TEST_BUCKET)
        yield endpoint


@pytest.fixture
def make_topology() -> Iterator[Callable[..., Topology]]:
    """``make_topology(**TopologyConfig fields)`` -> a Topology, closed after the test; the test is
    skipped, with the reason, only where this machine cannot make network namespaces at all."""
    from bench.cluster.topology import NamespacesUnavailable, Topology, TopologyConfig

    made: list[Topology] = []

    def make(**config: object) -> Topology:
        try:
            topo = Topology(TopologyConfig(**config))  # type: ignore[arg-type]
        except NamespacesUnavailable as e:
            pytest.skip(f"no network namespaces on this machine: {e}")
        made.append(topo)
        return topo

    yield make
    for topo in made:
        topo.close()


def cluster_harness(tmp: Path, nodes: int) -> ClusterHarness:
    """bench.cluster's harness of ``nodes`` nodes (the caller enters and leaves it); the test is
    skipped, like ``make_topology``'s, only where this machine cannot make network namespaces."""
    from bench.cluster import netns
    from bench.cluster.harness import ClusterHarness
    from bench.cluster.topology import NamespacesUnavailable

    if (why := netns.unavailable()) is not None:
        pytest.skip(f"no network namespaces on this machine: {why}")
    try:
        return ClusterHarness(tmp, nodes=nodes)
    except NamespacesUnavailable as e:
        pytest.skip(f"no network namespaces on this machine: {e}")


def make_tier(kind: str, request: pytest.FixtureRequest, tmp: Path, capacity_bytes: int) -> Tier:
    """A fresh, empty tier of ``kind``; remote ones get a unique prefix on the shared server."""
    tag = uuid.uuid4().hex[:12]
    if kind == "cpu":
        from tiers.cpu import CpuTier

        return CpuTier(capacity_bytes)
    if kind == "disk":
        from tiers.disk import DiskTier

        return DiskTier(tmp / f"lmdb-{tag}", capacity_bytes)
    if kind == "s3":
        from tiers.s3 import S3Tier

        ep: S3Endpoint = request.getfixturevalue("s3_endpoint")
        return S3Tier(ep.url, TEST_BUCKET, capacity_bytes, prefix=f"t-{tag}/", access_key=ep.access_key,
                      secret_key=ep.secret_key, region=ep.region)
    if kind == "redis-signed":  # the MAC wrapper every daemon puts around Redis and S3 (one wrapper: one kind)
        from kvstore.store.signed_tier import SignedTier
        from tiers.mac import TRAILER_BYTES, BlockMac
        from tiers.redis import RedisTier

        inner = RedisTier(request.getfixturevalue("redis_url"), capacity_bytes + TRAILER_BYTES,
                          prefix=f"t-{tag}:".encode(), max_value_bytes=capacity_bytes + TRAILER_BYTES)  # fmt: skip
        return SignedTier(inner, BlockMac(b"contract-test-secret-" + tag.encode() * 2))
    if kind in ("redis", "redis-cluster"):
        from tiers.redis import RedisTier

        cluster = kind == "redis-cluster"
        url = request.getfixturevalue("redis_cluster_url" if cluster else "redis_url")
        return RedisTier(url, capacity_bytes, cluster=cluster, prefix=f"t-{tag}:".encode())
    raise ValueError(f"unknown tier kind {kind!r}")


@pytest.fixture(params=TIER_KINDS)
def tier_kind(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def tier_factory(tier_kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[TierFactory]:
    """``tier_factory(capacity_bytes=64 MiB)`` -> a new tier of the parametrized kind.

    Every tier made is emptied and closed after the test.
    """
    made: list[Tier] = []

    def factory(capacity_bytes: int = 64 << 20) -> Tier:
        tier = make_tier(tier_kind, request, tmp_path, capacity_bytes)
        made.append(tier)
        return tier

    yield factory
    for tier in made:
        try:
            for key, _ in list(tier.scan()):
                tier.delete(key)
        except Exception:  # noqa: BLE001 - already closed by the test, or its server is gone
            pass
        tier.close()


@pytest.fixture
def tier(tier_factory: TierFactory) -> Tier:
    """One fresh tier (64 MiB) of each kind."""
    return tier_factory()
