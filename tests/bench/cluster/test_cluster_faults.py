"""The cluster bench end to end, small: 3 nodes (a daemon each, cpu -> Redis Cluster -> S3), each of
bench.cluster's faults while every node keeps writing and reading — a node's daemon SIGKILLed, S3's
link slowed, a Redis master killed, a node blackholed and one partitioned (link down), a daemon
restarted smaller: no wrong block, recovery within its bound, the others never stop hitting. And a
bring-up failing half way leaves no namespace behind."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from bench.cluster import netns
from bench.cluster.faults import (
    Driver,
    Plan,
    daemon_restarted_smaller,
    node_blackholed,
    node_lost,
    node_partitioned,
    redis_master_killed,
    s3_slow,
)
from tests.fixtures_servers import cluster_harness

pytestmark = pytest.mark.timeout(180)


def _skip_without_namespaces() -> None:
    if (why := netns.unavailable()) is not None:
        pytest.skip(f"no network namespaces on this machine: {why}")


def test_node_lost_and_s3_slow_with_every_node_busy(tmp_path: Path) -> None:
    with cluster_harness(tmp_path, nodes=3) as h:
        d = Driver(h, Plan(count=4, during=1, max_rounds_after=6, s3_rate_mbit=8.0, repeats=1))
        warm = d.round(read_all_others=True)
        assert all(warm.full_hit(i) for i in range(3)), warm.gets
        lost = node_lost(d)
        assert lost["wrong_outputs"] == 0 and lost["recovered"], lost
        assert lost["rounds_to_recover"] <= 2 and lost["others_hit_rate_during"] == 1.0, lost  # type: ignore[operator]
        assert lost["unavailable"] > 0  # the node really was down for a round
        slow = s3_slow(d)
        assert slow["wrong_outputs"] == 0 and slow["client_errors"] == 0 and slow["recovered"], slow
        assert slow["rounds_to_recover"] <= 2, slow  # type: ignore[operator]
        prefix = h.topo.prefix
    assert netns.existing(prefix + "-") == []


def test_redis_failover_cuts_and_a_smaller_restart_with_every_node_busy(tmp_path: Path) -> None:
    """Recovery within 2 rounds of the heal (the kill, for Redis), but for the partition: taking a
    link down flushes the node's ARP entries, and after the heal nothing leaves it before ARP's
    resend, up to 1 s later (docs/operations.md), so it gets the bench's 12 rounds, and within 2 of
    those that ended after the network let the node through (``rounds_after_network``)."""
    with cluster_harness(tmp_path, nodes=3) as h:
        d = Driver(h, Plan(count=4, during=1, max_rounds_after=12, repeats=1))
        assert all(d.round(read_all_others=True).full_hit(i) for i in range(3))
        killed = redis_master_killed(d)
        assert killed["wrong_outputs"] == 0 and killed["client_errors"] == 0, killed
        assert killed["recovered"] and killed["promoted_s"] is not None, killed
        assert killed["rounds_to_recover"] <= 2 and killed["redis_serving_again_s"] is not None, killed  # type: ignore[operator]
        for cut in (node_blackholed, node_partitioned):
            out = cut(d)
            assert out["wrong_outputs"] == 0 and out["recovered"], (cut.__name__, out)
            assert out["client_errors"] == 0 and out["unavailable"] == 0, out  # its own daemon stayed: misses, not errors
            assert out["cut_puts_shared_after"] == 1.0, out  # its cut-time puts replayed to the shared tiers
            assert out["network_back_s"] is not None and out["rounds_after_network"] <= 2, out  # type: ignore[operator]
            if cut is node_blackholed:
                assert out["rounds_to_recover"] <= 2, out  # type: ignore[operator]
        smaller = daemon_restarted_smaller(d)
        assert smaller["wrong_outputs"] == 0 and smaller["recovered"], smaller
        assert smaller["rounds_to_recover"] <= 2 and smaller["own_blocks_hits"] == 4, smaller  # type: ignore[operator]
        prefix = h.topo.prefix
    assert netns.existing(prefix + "-") == []


def test_a_bring_up_failing_half_way_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from bench.cluster import harness

    _skip_without_namespaces()

    def s3_refuses(*args: object, **kw: object) -> None:
        raise RuntimeError("injected: s3 did not start")

    monkeypatch.setattr(harness, "SeaweedS3", s3_refuses)
    prefix = "tkhf" + os.urandom(2).hex()
    with pytest.raises(RuntimeError, match="injected"):
        harness.ClusterHarness(tmp_path, nodes=3, prefix=prefix)
    assert netns.existing(prefix + "-") == []  # the topology went, and the Redis Cluster with it:
    assert _running_under(tmp_path) == []  # no redis-server still running in its directory


def _running_under(d: Path) -> list[int]:
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.readlink(f"/proc/{pid}/cwd").startswith(str(d)):
                pids.append(int(pid))
        except OSError:
            continue  # gone meanwhile, or not ours to read
    return pids


def test_sigterm_mid_run_tears_everything_down() -> None:
    """``timeout`` or a CI runner stops the bench with SIGTERM: no namespace and no process of the
    run (found by its namespaces) may outlive it."""
    import signal
    import subprocess
    import sys
    import time

    _skip_without_namespaces()
    prefix = "tkst" + os.urandom(2).hex()
    proc = subprocess.Popen([sys.executable, "-m", "bench.cluster", "--quick", "--no-latency", "--faults",
                             "node_lost", "--prefix", prefix], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    by_name: dict[str, int] = {}
    nsfs = os.stat("/proc/self/ns/net").st_dev  # a namespace's file, once `ip netns add` has mounted it
    try:
        deadline = time.monotonic() + 60
        while len(by_name) < 11 and time.monotonic() < deadline:  # bridge + 3 nodes + 6 redis + s3
            for ns in netns.existing(prefix + "-"):
                try:
                    st = os.stat(f"{netns.NETNS_DIR}/{ns}")
                except OSError:
                    continue
                if st.st_dev == nsfs:  # not the plain file `ip netns add` creates before it mounts on it
                    by_name[ns] = st.st_ino
            time.sleep(0.2)
        inodes = set(by_name.values())
        assert len(inodes) == 11, f"the run never built its namespaces ({proc.poll()})"
        node2 = os.stat(f"{netns.NETNS_DIR}/{prefix}-node2").st_ino
        while not _in_namespaces({node2}, b"node_worker") and time.monotonic() < deadline + 60:
            time.sleep(0.2)  # mid-run: the last node's worker is up, its faults under way
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) != 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert netns.existing(prefix + "-") == []
    assert _in_namespaces(inodes) == []


def _in_namespaces(inodes: set[int], needle: bytes = b"") -> list[bytes]:
    """Command lines of the processes living in those network namespaces (containing ``needle``)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.stat(f"/proc/{pid}/ns/net").st_ino in inodes:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
                if needle in cmdline:
                    found.append(cmdline[:120])
        except OSError:
            continue  # gone meanwhile
    return found
