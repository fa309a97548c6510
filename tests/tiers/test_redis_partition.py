"""RedisTier cut off from its Redis Cluster (the node's link down): bounded failures, quick heal.

What must hold: every call against an unreachable cluster raises TierUnavailable in about
``socket_timeout_s`` (not the many connect timeouts of a topology refresh that tries every known
node in turn), a client built while cut off fails as fast, and once the link is back the tier
serves its blocks again within a few seconds. The bounds are generous (a loaded 2-core machine):
they only catch the stall: 6.0, 1.1, 5.1, 3.1, 3.1, 3.1 s for the six calls here, 9-11 s in the probe.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest

from bench.cluster.redis_cluster import RedisClusterConfig, in_topology
from bench.cluster.topology import Topology
from tiers.errors import TierUnavailable
from tiers.redis import RedisTier

pytestmark = pytest.mark.timeout(180)

SERVICES = tuple(f"redis{i}" for i in range(6))
SOCKET_TIMEOUT_S, CONNECT_TIMEOUT_S = 2.0, 1.0  # the daemon's defaults
CALL_BOUND_S = 4.0  # twice socket_timeout_s: room for a loaded machine; the stall was 5-11 s
TOTAL_BOUND_S = 6.0  # the six calls above: measured 3.0 s in all; the stall made it 21.5 s
HEAL_BOUND_S = 10.0  # link back to the first hit (measured well under 2 s)


def _timed(fn: Callable[[], object]) -> tuple[float, BaseException | None]:
    t0 = time.monotonic()
    try:
        fn()
    except BaseException as e:  # noqa: BLE001 - returned, asserted by the caller
        return time.monotonic() - t0, e
    return time.monotonic() - t0, None


def test_calls_against_a_cut_off_cluster_fail_in_about_the_socket_timeout(
        make_topology: Callable[..., Topology], tmp_path: Path) -> None:
    topo = make_topology(nodes=1, services=SERVICES)
    config = RedisClusterConfig(replicas=1, node_timeout_ms=1000)
    with in_topology(topo, SERVICES, tmp_path, config) as cluster, topo.entered("node0"):
        urls = ",".join(cluster.urls)
        tier = RedisTier(urls, 64 << 20, cluster=True, socket_timeout_s=SOCKET_TIMEOUT_S,
                         connect_timeout_s=CONNECT_TIMEOUT_S)
        tier.put(b"k", b"v" * 4096)
        topo.link_down("node0")
        try:
            calls = [_timed(lambda: tier.get(b"k")) for _ in range(4)]
            calls.append(_timed(lambda: tier.put(b"k2", b"w")))
            calls.append(_timed(lambda: tier.contains_many([b"k", b"k2"])))
            built = _timed(lambda: RedisTier(urls, 64 << 20, cluster=True, socket_timeout_s=SOCKET_TIMEOUT_S,
                                             connect_timeout_s=CONNECT_TIMEOUT_S))
        finally:
            topo.link_up("node0")
        seconds = [round(s, 2) for s, _ in calls]
        assert all(isinstance(e, TierUnavailable) for _, e in calls), [repr(e) for _, e in calls]
        assert max(seconds) < CALL_BOUND_S, f"a call against the cut-off cluster took {seconds} s"
        assert sum(seconds) < TOTAL_BOUND_S, f"the calls against the cut-off cluster took {seconds} s"
        assert isinstance(built[1], TierUnavailable) and built[0] < CALL_BOUND_S, built

        _wait_healed(tier)
        tier.put(b"k3", b"x")
        assert tier.get(b"k3") == b"x"

        # The lookup first this time: a pipeline over the three masters (12.4 s without its deadline)
        keys = [b"k", b"k3", *(b"spread-%d" % i for i in range(30))]
        topo.link_down("node0")
        try:
            looked, error = _timed(lambda: tier.contains_many(keys))
        finally:
            topo.link_up("node0")
        assert isinstance(error, TierUnavailable) and looked < CALL_BOUND_S, (looked, error)
        _wait_healed(tier)
        assert tier.contains_many(keys)[:2] == [True, True]
        tier.close()


def _wait_healed(tier: RedisTier) -> None:
    t0 = time.monotonic()
    while True:
        try:
            if tier.get(b"k") == b"v" * 4096:
                return
        except TierUnavailable:
            pass
        assert time.monotonic() - t0 < HEAL_BOUND_S, "the tier did not serve again after the link came back"
        time.sleep(0.05)
