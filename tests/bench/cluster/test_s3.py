"""SeaweedFS S3 in a namespace of its own, reached by a node's S3Tier over the bridge; the node's
link cut: TierUnavailable (not a hang, not other bytes); healed: the same bytes again."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest

from bench.cluster.topology import Topology
from bench.servers import SeaweedS3, prepare_bucket
from tiers.errors import TierUnavailable
from tiers.s3 import S3Tier

pytestmark = pytest.mark.timeout(180)

BUCKET = "tierkv-cluster"
HEAL_DEADLINE_S = 60.0  # only catches "never"


def test_s3_in_its_namespace_serves_a_node_and_fails_fast_when_cut_off(make_topology: Callable[..., Topology],
                                                                       tmp_path: Path) -> None:
    topo = make_topology(nodes=1, services=("s3",))
    server = SeaweedS3(tmp_path, host=topo.addr("s3"), netns=topo.ns("s3"))
    try:
        ep = server.endpoint
        assert ep.url.startswith(f"http://{topo.addr('s3')}:")
        with topo.entered("node0"):
            prepare_bucket(ep, BUCKET)
            tier = S3Tier(ep.url, BUCKET, 64 << 20, access_key=ep.access_key, secret_key=ep.secret_key,
                          region=ep.region, read_timeout_s=1.0)
            block = bytes(range(256)) * 64
            tier.put(b"k", block)
            assert tier.get(b"k") == block
            topo.link_down("node0")
            with pytest.raises(TierUnavailable):
                tier.get(b"k")
            topo.link_up("node0")
            deadline = time.monotonic() + HEAL_DEADLINE_S
            while True:
                try:
                    assert tier.get(b"k") == block
                    break
                except TierUnavailable:
                    assert time.monotonic() < deadline, "S3 did not come back after the link did"
                    time.sleep(0.2)
            tier.close()
    finally:
        server.stop()
