"""A daemon per node, sharing a real Redis Cluster (3 masters + 3 replicas, each in its own namespace):
node B (told of every cluster node: --redis URL,URL,...) serves the blocks node A put, through
Redis, with every byte right; node B cut off from the cluster answers misses (never other bytes)
and serves them again once its link is back, by itself.
(A master's failover is tested through RedisTier in tests/tiers/test_redis_failover.py.)"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from bench.cluster.nodes import NodeDaemon
from bench.cluster.redis_cluster import RedisClusterConfig, in_topology
from bench.cluster.topology import Topology

pytestmark = pytest.mark.timeout(180)

SERVICES = tuple(f"redis{i}" for i in range(6))
HEAL_DEADLINE_S = 90.0  # the breaker re-probes after 2 s, doubling to 20 s: this only catches "never"


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
        assert a.client("put", "late", 16) == {"put": 16, "pending": 0}
        got = b.client("get", "conv", 16)
        assert got["wrong"] == 0 and got["hits"] == 16, got
        assert got["tiers"] == {"redis": 16}, got  # node B's own cpu tier never held them

        topo.link_down("node1")  # node B loses the cluster: misses, never other bytes, answered
        cut = b.client("get", "late", 16, "--wait-s", "60")
        assert cut["wrong"] == 0 and cut["hits"] == 0, cut
        topo.link_up("node1")
        deadline = time.monotonic() + HEAL_DEADLINE_S
        while (healed := b.client("get", "late", 16))["hits"] < 16:  # the breaker closes by itself
            assert healed["wrong"] == 0, healed
            assert time.monotonic() < deadline, f"node B did not get the shared tier back: {healed}"
            time.sleep(0.5)
        assert healed["wrong"] == 0, healed
    with topo.entered("node0"), pytest.raises(ConnectionRefusedError):  # the block stopped every server
        socket.create_connection((topo.addr(SERVICES[0]), 6379), timeout=2)
