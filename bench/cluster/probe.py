"""Redis Cluster faults as RedisTier sees them: ``python -m bench.cluster.probe --out F.json [--quick]``.

One node and a Redis Cluster of 3 masters + 3 replicas, each in its own namespace (bench/cluster/),
node timeout 1 s. The client is the daemon's own RedisTier (its default timeouts: connect 1 s,
socket 2 s; told of every cluster node), in the node's namespace. Repeated ``repeats`` times, with
the median reported:

- ``failover``: a master SIGKILLed while the client alternates writes and reads
  (bench/cluster/failover.py): ``recovery_s`` (kill to the end of the last failed operation),
  ``unavailable`` operations, ``wrong`` blocks (must be 0), ``lost_replicated`` (blocks replicated
  before the kill and missing after it: must be 0), ``during_lost`` (writes acknowledged mid-failover
  and gone after it: allowed, Redis replicates asynchronously). The killed node then rejoins as a
  replica before the next repeat.
- ``partition``: the node's link cut (packets dropped): the seconds each of the first
  ``calls`` ``get`` take to raise TierUnavailable (what one request of the daemon waits before its
  breaker detaches the tier after 3 of them), then ``heal_s``: link back to the first hit.
- ``daemon_partition``: the same cut under a kvstore daemon of node0 (a fresh one each repeat, told
  of every cluster node): the seconds each of the first ``calls`` lookup requests of a client
  beside it take (keys in no tier, so each asks Redis until the breaker detaches it).

``meta`` records the load average before and after and the cores.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.cluster.failover import drive_failover
from bench.cluster.nodes import NodeDaemon
from bench.cluster.redis_cluster import RedisCluster, RedisClusterConfig, in_topology
from bench.cluster.topology import Topology, TopologyConfig
from tiers.errors import TierUnavailable
from tiers.redis import RedisTier

SERVICES = tuple(f"redis{i}" for i in range(6))
NODE_TIMEOUT_MS = 1000


def value_of(key: bytes) -> bytes:
    return hashlib.sha256(key).digest() * 128  # 4 KiB


def one_failover(cluster: RedisCluster, tier: RedisTier, run: int, blocks: int) -> dict[str, float]:
    before = [f"before-{run}-{i}".encode() for i in range(blocks)]
    for key in before:
        tier.put(key, value_of(key))
    cluster.wait_replicated()
    victim = cluster.masters()[0]
    heir = cluster.replicas_of(victim)[0]
    seen = drive_failover(cluster, tier, victim, heir, before, value_of, tag=f"during-{run}")
    cluster.wait_promoted(heir)
    lost = sum(tier.get(k) != value_of(k) for k in before)
    during_lost = sum(tier.get(k) is None for k in seen.during)
    cluster.start_node(victim)  # rejoins as the heir's replica (its nodes.conf)
    cluster.wait_ok()
    cluster.wait_until(lambda: victim in cluster.replicas_of(heir), f"node {victim} back as a replica")
    return {"recovery_s": round(seen.recovery_s, 3), "unavailable": seen.unavailable, "wrong": len(seen.wrong),
            "lost_replicated": lost, "during_acknowledged": len(seen.during), "during_lost": during_lost}


def one_partition(topo: Topology, tier: RedisTier, run: int, calls: int) -> dict[str, object]:
    key = f"partition-{run}".encode()
    tier.put(key, value_of(key))
    topo.link_down("node0")
    call_s, errors = [], []
    for _ in range(calls):
        t0 = time.monotonic()
        try:
            tier.get(key)
            errors.append("answered")
        except TierUnavailable as e:
            errors.append(type(e.__cause__).__name__)
        call_s.append(round(time.monotonic() - t0, 3))
    topo.link_up("node0")
    t0 = time.monotonic()
    while True:
        try:
            if tier.get(key) == value_of(key):
                break
        except TierUnavailable:
            pass
        if time.monotonic() - t0 > 120:
            raise RuntimeError("the tier did not come back within 120 s of the link")
        time.sleep(0.1)
    return {"call_s": call_s, "errors": errors, "heal_s": round(time.monotonic() - t0, 3)}


def one_daemon_partition(topo: Topology, cluster: RedisCluster, workdir: Path, run: int,
                         calls: int) -> dict[str, object]:
    with NodeDaemon(topo, "node0", workdir, ",".join(cluster.urls), "--cpu", "4MiB") as daemon, \
            daemon.lookups() as client:  # fmt: skip
        warm = [client.ask(f"warm-{run}-{i}")["s"] for i in range(2)]
        topo.link_down("node0")
        try:
            cut = [client.ask(f"cut-{run}-{i}") for i in range(calls)]
        finally:
            topo.link_up("node0")
    return {"warm_s": warm, "call_s": [c["s"] for c in cut], "errors": [c.get("error") for c in cut]}


def run(repeats: int, blocks: int, calls: int) -> dict[str, object]:
    out: dict[str, object] = {"meta": {"loadavg_before": os.getloadavg(), "cpus": os.cpu_count(),
                                       "node_timeout_ms": NODE_TIMEOUT_MS, "repeats": repeats}}
    with tempfile.TemporaryDirectory(prefix="tierkv-probe-") as d, \
            Topology(TopologyConfig(nodes=1, services=SERVICES)) as topo, \
            in_topology(topo, SERVICES, Path(d), RedisClusterConfig(replicas=1, node_timeout_ms=NODE_TIMEOUT_MS)) \
            as cluster, topo.entered("node0"):  # fmt: skip
        tier = RedisTier(",".join(cluster.urls), 1 << 30, cluster=True)
        failovers = [one_failover(cluster, tier, r, blocks) for r in range(repeats)]
        partitions = [one_partition(topo, tier, r, calls) for r in range(repeats)]
        tier.close()
        daemons = [one_daemon_partition(topo, cluster, Path(d) / f"daemon{r}", r, calls) for r in range(repeats)]
    first_calls = [p["call_s"][0] for p in partitions]  # type: ignore[index]
    all_calls = [s for p in partitions for s in p["call_s"]]  # type: ignore[attr-defined]
    out["figures"] = {
        "failover_recovery_s_median": statistics.median(f["recovery_s"] for f in failovers),
        "failover_wrong_total": sum(f["wrong"] for f in failovers),
        "failover_lost_replicated_total": sum(f["lost_replicated"] for f in failovers),
        "partition_first_call_s_median": statistics.median(first_calls),
        "partition_call_s_max": max(all_calls),
        "partition_heal_s_median": statistics.median(p["heal_s"] for p in partitions),  # type: ignore[misc]
        "daemon_partition_first_request_s_median": statistics.median(p["call_s"][0] for p in daemons),  # type: ignore[index]
        "daemon_partition_request_s_max": max(s for p in daemons for s in p["call_s"]),  # type: ignore[attr-defined]
    }
    out["failover"], out["partition"], out["daemon_partition"] = failovers, partitions, daemons
    out["meta"]["loadavg_after"] = os.getloadavg()  # type: ignore[index]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.cluster.probe", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path)
    p.add_argument("--quick", action="store_true", help="fewer blocks and calls (still 3 repeats)")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    res = run(args.repeats, blocks=20 if args.quick else 60, calls=3 if args.quick else 5)
    text = json.dumps(res, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    print(json.dumps(res["figures"]), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
