"""How long a node waits for a batch of blocks from a shared tier, per link: ``get_latency_by_link``.

From node0's namespace, the daemon's own tier client (S3Tier; RedisTier on the Redis Cluster) reads
``count`` blocks of ``block_bytes`` it wrote before, all at once on 8 threads (one ``get`` per
block, as the daemon reads a batch), ``repeats`` times; the median and every run's seconds are
reported per tier and link (``s3.<link>``, ``redis.<link>``). Links:

- ``bridge``: the topology's veth and bridge as they are (no shaping);
- ``tbf_1000mbit`` / ``tbf_100mbit``: tbf on both ends of node0's veth (bench/cluster/topology.py);
- ``rtt_0.5ms`` / ``rtt_20ms`` (S3 only): the reads go through bench/slow_link.py's SlowLink in
  node0's namespace, delaying each direction by half the round trip (this kernel has no netem).
  Redis Cluster cannot be put behind one proxy: its MOVED redirects name the servers' own
  addresses, which bypass it.

It measures the shared tier's transfer under the link, not an engine's TTFT (no engine runs here).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from bench.cluster.harness import BUCKET, ClusterHarness
from bench.slow_link import SlowLink
from tiers.base import Tier
from tiers.redis import RedisTier
from tiers.s3 import S3Tier

NODE = "node0"


def _timed_reads(h: ClusterHarness, make: Callable[[], Tier], keys: list[bytes], value: bytes,
                 repeats: int) -> list[float]:
    with h.topo.entered(NODE):  # the tier's sockets, and its pool's threads, live in node0's namespace
        tier = make()
        try:
            with ThreadPoolExecutor(8) as pool:
                list(pool.map(lambda k: tier.put(k, value), keys))
                seconds = []
                for _ in range(repeats):
                    t0 = time.monotonic()
                    got = list(pool.map(tier.get, keys))
                    seconds.append(round(time.monotonic() - t0, 4))
                    if any(g != value for g in got):
                        raise RuntimeError(f"{tier!r} answered other bytes than were written")
        finally:
            tier.close()
    return seconds


def get_latency_by_link(h: ClusterHarness, count: int = 16, block_bytes: int = 64 << 10,
                        repeats: int = 3) -> dict[str, object]:
    keys = [f"lat-{i}".encode() for i in range(count)]
    value = bytes(range(256)) * (block_bytes // 256)
    ep = h.s3.endpoint
    host, _, port = ep.url.removeprefix("http://").rpartition(":")

    def s3(url: str) -> Callable[[], Tier]:
        return lambda: S3Tier(url, BUCKET, 1 << 30, prefix="latency/", access_key=ep.access_key,
                              secret_key=ep.secret_key, region=ep.region, read_timeout_s=30.0, create_bucket=False)

    def redis() -> Tier:
        return RedisTier(",".join(h.redis.urls), 1 << 30, cluster=True, prefix=b"latency:", socket_timeout_s=30.0)

    out: dict[str, object] = {"measures": f"seconds for node0 to read {count} x {block_bytes >> 10} KiB blocks "
                                          "from a shared tier (its tier client, 8 threads), median of the runs",
                              "blocks": count, "block_bytes": block_bytes}
    by_tier: dict[str, dict[str, object]] = {"s3": {}, "redis": {}}
    for tier, make in (("s3", s3(ep.url)), ("redis", redis)):
        by_tier[tier]["bridge"] = _summary(_timed_reads(h, make, keys, value, repeats))
        for mbit in (1000, 100):
            h.topo.set_rate(NODE, mbit)
            try:
                by_tier[tier][f"tbf_{mbit}mbit"] = _summary(_timed_reads(h, make, keys, value, repeats))
            finally:
                h.topo.clear_rate(NODE)
    for rtt_ms in (0.5, 20):
        with SlowLink((host, int(port)), delay_s=rtt_ms / 2000, netns=h.topo.ns(NODE)) as link:
            by_tier["s3"][f"rtt_{rtt_ms:g}ms"] = _summary(
                _timed_reads(h, s3(f"http://{link.address}"), keys, value, repeats))
    out.update(by_tier)
    return out


def _summary(seconds: list[float]) -> dict[str, object]:
    return {"s": statistics.median(seconds), "runs": seconds}
