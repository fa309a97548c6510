"""Past one node, measured (issue #25): ``python -m bench.cluster --out F.json [--quick]``.

Three (or more) nodes as network namespaces, each with a kvstore daemon whose chain is cpu ->
Redis Cluster (3 masters + 3 replicas, each in its own namespace) -> S3 (SeaweedFS in its own
namespace), both shared tiers written through, and a client worker beside it
(bench/cluster/harness.py). Traffic comes in rounds: every node writes fresh blocks, then reads
another node's (bench/cluster/rounds.py). The JSON:

- ``nodes``: node namespaces.
- ``cross_node_hit_rate``: over ``warm_rounds`` rounds in which every node reads every other
  node's blocks of that round, hits / blocks asked; ``cross_node`` has the counts, the tiers that
  answered, and ``s3_only``: one more round read by a node whose daemon has no Redis tier (cpu ->
  S3), so S3 alone is shown to serve the other nodes' blocks.
- ``faults``: bench/cluster/faults.py, each injected ``plan.repeats`` (3) times while every node
  keeps writing and reading: counts summed over the runs, ``recovery_s`` their median.
- ``get_latency_by_link``: bench/cluster/link_latency.py (a batch read from S3 and from Redis
  Cluster under tbf rates, and from S3 under SlowLink round trips): the shared tier's transfer.
- ``regret_by_link`` ({link: regret}) and ``decisions_by_link`` ({link: {prefix pages: share of the
  cost model's decisions that loaded}}): bench/cluster/regret.py. Node A's kvengine replica writes
  prompts through its daemon to S3; node B's replicas (forced to load, forced to recompute, and the
  cost model's own choice) read them across the bridge, a 100 Mbit/s tbf and a 20 ms RTT proxy,
  learning each link from their own loads; regret is the mean over prefix lengths of (t_chosen -
  best) / best on the measured TTFTs. ``regret`` has every figure, run and the plan, and
  ``wrong_outputs``: answers that differ from the writer's fresh prefill.
- ``meta``: load average before and after, cores, git revision, the plan.

What "wrong" means in ``faults`` and ``cross_node``: blocks whose bytes differ from what their
writer put (each block's bytes follow from its key, bench/cluster/node_client.py), counted on every
read. The fault rounds run no engine, so their ``wrong_outputs`` counts wrong blocks, not wrong
completions; the regret part runs engines and counts wrong completions.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import time
from pathlib import Path

from bench.cluster.faults import FAULTS, Driver, Plan, repeated
from bench.cluster.harness import NODE_TIMEOUT_MS, TIER_RETRY_S, ClusterHarness
from bench.cluster.link_latency import get_latency_by_link
from bench.cluster.regret import RegretPlan, measure_regret
from bench.cluster.rounds import Round, summed

ROOT = Path(__file__).resolve().parents[2]


def _git_revision() -> str:
    r = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return r.stdout.strip()


def cross_node(d: Driver, warm_rounds: int) -> dict[str, object]:
    rounds: list[Round] = [d.round(read_all_others=True) for _ in range(warm_rounds)]
    total = summed(rounds)
    out: dict[str, object] = {"hits": total["hits"], "asked": total["asked"], "wrong": total["wrong"],
                              "client_errors": total["client_errors"], "rounds": warm_rounds,
                              "tiers": {k[5:]: v for k, v in total.items() if k.startswith("tier_")},
                              "round_s": [r.seconds for r in rounds]}
    reader = len(d.h.nodes) - 1  # S3 alone: a daemon with no Redis tier reads the others' blocks
    d.h.stop_node(reader)
    d.h.start_node(reader, redis=False)
    try:
        s3 = summed([d.round(read_all_others=True)])
    finally:
        d.h.stop_node(reader)
        d.h.start_node(reader)
    out["s3_only"] = {"hits": s3["hits"], "asked": s3["asked"], "wrong": s3["wrong"],
                      "client_errors": s3["client_errors"],
                      "tiers": {k[5:]: v for k, v in s3.items() if k.startswith("tier_")}}
    return out


def regret_plan(quick: bool) -> RegretPlan:
    return RegretPlan() if quick else RegretPlan(lengths=(1, 2, 4, 8, 16, 32), reps=5, learn=3)


def run(quick: bool, nodes: int = 3, faults: list[str] | None = None, latency: bool = True,
        prefix: str = "", regret: bool = True, only_regret: bool = False) -> dict[str, object]:
    """The JSON of the module doc; ``only_regret``: ``nodes`` and the regret part alone."""
    meta: dict[str, object] = {"loadavg_before": list(os.getloadavg()), "cpus": os.cpu_count(),
                               "cores_usable": len(os.sched_getaffinity(0)), "git_revision": _git_revision(),
                               "quick": quick, "redis_node_timeout_ms": NODE_TIMEOUT_MS,
                               "daemon_tier_retry_s": TIER_RETRY_S}
    plan = Plan() if quick else Plan(count=32, during=3)
    meta["plan"] = vars(plan)
    rplan = regret_plan(quick)
    t0 = time.monotonic()
    out: dict[str, object] = {"nodes": nodes}
    with tempfile.TemporaryDirectory(prefix="tierkv-cluster-") as tmp, ClusterHarness(Path(tmp), nodes=nodes, prefix=prefix) as h:
        meta["bring_up_s"] = round(time.monotonic() - t0, 1)
        if only_regret:
            out.update(measure_regret(h, rplan))
        else:
            d = Driver(h, plan)
            cn = cross_node(d, warm_rounds=3 if quick else 6)
            out["cross_node_hit_rate"] = round(cn["hits"] / cn["asked"], 4) if cn["asked"] else None  # type: ignore[operator]
            out["cross_node"] = cn
            if regret:  # on a quiet cluster, before the faults
                out.update(measure_regret(h, rplan))
            out["faults"] = {name: repeated(FAULTS[name], d) for name in (faults or list(FAULTS))}
            if latency:
                out["get_latency_by_link"] = get_latency_by_link(h, repeats=5 if quick else 9)
    meta["wall_s"] = round(time.monotonic() - t0, 1)
    meta["loadavg_after"] = list(os.getloadavg())
    out["meta"] = meta
    return out
