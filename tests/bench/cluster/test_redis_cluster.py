"""A real Redis Cluster in the topology: 3 masters + 3 replicas, each on its own namespace and address,
reachable from a node. Failover (kill, promotion) is exercised through RedisTier in
tests/tiers/test_redis_failover.py."""

from __future__ import annotations

import socket
from collections.abc import Callable
from pathlib import Path

import pytest
from redis.cluster import RedisCluster as ClusterClient

from bench.cluster.redis_cluster import RedisClusterConfig, in_topology
from bench.cluster.topology import Topology

SERVICES = tuple(f"redis{i}" for i in range(6))


def test_three_masters_three_replicas_on_their_own_addresses(make_topology: Callable[..., Topology],
                                                              tmp_path: Path) -> None:
    topo = make_topology(nodes=1, services=SERVICES)
    with in_topology(topo, SERVICES, tmp_path, RedisClusterConfig(replicas=1, node_timeout_ms=1000)) as cluster:
        assert sorted(r or "" for r in cluster.roles()) == ["master"] * 3 + ["slave"] * 3
        masters = cluster.masters()
        assert all(len(cluster.replicas_of(m)) == 1 for m in masters)
        with topo.entered("node0"):
            client = ClusterClient.from_url(cluster.urls[0])
            for i in range(50):
                client.set(f"k{i}", i)
            hosts = {n.host for n in client.get_nodes()}
            client.close()
        # the client was sent to each master's own address (and to nothing outside the topology)
        assert {topo.addr(SERVICES[m]) for m in masters} <= hosts <= {topo.addr(s) for s in SERVICES}
    with topo.entered("node0"):  # leaving the block stopped every server
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection((topo.addr(SERVICES[masters[0]]), 6379), timeout=2)
