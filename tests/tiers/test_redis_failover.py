"""RedisTier through a Redis Cluster failover: a master SIGKILLed while a client writes and reads.

What must hold: no wrong block ever (a read returns what was written, a miss, or TierUnavailable);
every block written (and replicated) before the kill reads back once the replica is promoted; new
writes succeed again after the failover, within a deadline far above Redis's own (no hang).
The failover's transient answers (CLUSTERDOWN, MASTERDOWN, TRYAGAIN) are TierUnavailable: the
store falls through and its breaker retries, instead of treating the tier as broken.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path

import pytest
import redis.exceptions as rex

from bench.cluster.failover import drive_failover
from bench.cluster.redis_cluster import RedisClusterConfig, in_topology
from bench.cluster.topology import Topology
from tiers.errors import TierError, TierUnavailable
from tiers.redis import RedisTier

pytestmark = pytest.mark.timeout(120)

SERVICES = tuple(f"redis{i}" for i in range(6))
RECOVERY_DEADLINE_S = 30.0  # Redis promotes in ~2-3 s at node timeout 1 s; this only catches a hang


def _value(key: bytes) -> bytes:
    return hashlib.sha256(key).digest() * 128  # 4 KiB, different for every key


@pytest.mark.parametrize("error", [
    rex.ClusterDownError("The cluster is down"),
    rex.MasterDownError("Link with MASTER is down and replica-serve-stale-data is set to 'no'."),
    rex.TryAgainError("Multiple keys request during rehashing of slot"),
])
def test_failover_answers_are_unavailable_not_tier_errors(error: Exception) -> None:
    tier = RedisTier("redis://127.0.0.1:1/0", 1 << 20, connect=False)

    class Failing:
        def __getattr__(self, name: str) -> Callable[..., object]:
            def fail(*args: object, **kw: object) -> object:
                raise error
            return fail

    tier._r = Failing()
    with pytest.raises(TierUnavailable):
        tier.get(b"k")
    with pytest.raises(TierUnavailable):
        tier.put(b"k", b"v")


def test_a_response_error_outside_failover_stays_a_tier_error() -> None:
    tier = RedisTier("redis://127.0.0.1:1/0", 1 << 20, connect=False)

    class Wrong:
        def get(self, *args: object) -> object:
            raise rex.ResponseError("WRONGTYPE Operation against a key holding the wrong kind of value")

    tier._r = Wrong()
    with pytest.raises(TierError) as caught:
        tier.get(b"k")
    assert not isinstance(caught.value, TierUnavailable)


def test_master_killed_while_a_client_writes_and_reads(make_topology: Callable[..., Topology],
                                                       tmp_path: Path) -> None:
    topo = make_topology(nodes=1, services=SERVICES)
    config = RedisClusterConfig(replicas=1, node_timeout_ms=1000)
    with in_topology(topo, SERVICES, tmp_path, config) as cluster, topo.entered("node0"):
        tier = RedisTier(cluster.urls[0], 64 << 20, cluster=True, socket_timeout_s=1.0, connect_timeout_s=0.5)
        before = [b"before-%d" % i for i in range(60)]  # spread over the three masters' slots
        for key in before:
            tier.put(key, _value(key))
        cluster.wait_replicated()
        victim = cluster.masters()[0]
        heir = cluster.replicas_of(victim)[0]

        seen = drive_failover(cluster, tier, victim, heir, before, _value, RECOVERY_DEADLINE_S)
        cluster.wait_promoted(heir)

        assert seen.wrong == [], f"wrong bytes for {seen.wrong}"
        assert [k for k in before if tier.get(k) != _value(k)] == [], "a replicated block was lost"
        for key in seen.during:  # acknowledged mid-failover: the bytes written, or lost (a miss), never others
            assert tier.get(key) in (_value(key), None)
        for j in range(20):
            tier.put(b"after-%d" % j, _value(b"after-%d" % j))
        assert all(tier.get(b"after-%d" % j) == _value(b"after-%d" % j) for j in range(20))
        assert seen.unavailable > 0, f"the kill was not seen: {seen.outcomes}"
        tier.close()

        # A client started now (a daemon restarting) and told only of the dead master never finds
        # the healthy cluster; told of several nodes (comma-separated urls), it finds the others.
        with pytest.raises(TierUnavailable):
            RedisTier(cluster.urls[victim], 64 << 20, cluster=True, connect_timeout_s=0.5)
        several = RedisTier(f"{cluster.urls[victim]},{cluster.urls[heir]}", 64 << 20, cluster=True,
                            socket_timeout_s=1.0, connect_timeout_s=0.5)
        assert [k for k in before if several.get(k) != _value(k)] == []
        several.close()


def test_several_startup_urls_are_for_cluster_mode_and_carry_no_second_password() -> None:
    with pytest.raises(TierError, match="cluster"):
        RedisTier("redis://127.0.0.1:1/0,redis://127.0.0.1:2/0", 1 << 20, connect=False)
    with pytest.raises(TierError, match="first url") as caught:
        RedisTier("redis://:pw1@127.0.0.1:1/0,redis://:sekrit@127.0.0.1:2/0", 1 << 20, cluster=True, connect=False)
    assert "sekrit" not in str(caught.value) and "pw1" not in str(caught.value)
    tier = RedisTier("redis://:pw1@127.0.0.1:1/0,redis://127.0.0.1:2/0", 1 << 20, cluster=True, connect=False)
    assert tier.where == "redis://:***@127.0.0.1:1/0,redis://127.0.0.1:2/0"
