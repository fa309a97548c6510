"""A daemon per node, sharing a real Redis Cluster (3 masters + 3 replicas, each in its own namespace):
node B (told of every cluster node: --redis URL,URL,...) serves the blocks node A put, through
Redis, with every byte right. (A master's failover is tested through RedisTier in
tests/tiers/test_redis_failover.py, a node cut off from the cluster through RedisTier in
tests/tiers/test_redis_partition.py, and through a daemon by ``python -m bench.cluster.probe``.)"""

from __future__ import annotations

import socket
from collections.abc import Callable
from pathlib import Path

import pytest

from bench.cluster.nodes import NodeDaemon
from bench.cluster.redis_cluster import RedisClusterConfig, in_topology
from bench.cluster.topology import Topology

pytestmark = pytest.mark.timeout(180)

SERVICES = tuple(f"redis{i}" for i in range(6))


def test_node_b_reads_what_node_a_put_through_redis_cluster(make_topology: Callable[..., Topology],
                                                             tmp_path: Path) -> None:
    topo = make_topology(nodes=2, services=SERVICES)
    config = RedisClusterConfig(replicas=1, node_timeout_ms=1000)
    with in_topology(topo, SERVICES, tmp_path / "redis", config) as cluster, \
            NodeDaemon(topo, "node0", tmp_path, cluster.urls[0], "--cpu", "4MiB") as a, \
            NodeDaemon(topo, "node1", tmp_path, ",".join(cluster.urls), "--cpu", "4MiB") as b:  # fmt: skip
        assert sorted(r or "" for r in cluster.roles()) == ["master"] * 3 + ["slave"] * 3
        assert all(len(cluster.replicas_of(m)) == 1 for m in cluster.masters())

        assert a.client("put", "conv", 16) == {"put": 16, "pending": 0}
        got = b.client("get", "conv", 16)
        assert got["wrong"] == 0 and got["hits"] == 16, got
        assert got["tiers"] == {"redis": 16}, got  # node B's own cpu tier never held them

    with topo.entered("node0"), pytest.raises(ConnectionRefusedError):  # the block stopped every server
        socket.create_connection((topo.addr(SERVICES[0]), 6379), timeout=2)
