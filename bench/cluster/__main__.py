"""``python -m bench.cluster --out F.json [--quick]``: the cluster bench of issue #25 (bench/cluster/run.py)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench.cluster.faults import FAULTS
from bench.cluster.run import run
from bench.cluster.topology import NamespacesUnavailable
from bench.servers import exit_on_sigterm


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.cluster", description=__doc__)
    p.add_argument("--out", type=Path)
    p.add_argument("--quick", action="store_true", help="fewer rounds and blocks (make bench: <= 6 min on 2 cores)")
    p.add_argument("--nodes", type=int, default=3)
    p.add_argument("--faults", default=",".join(FAULTS), help=f"comma-separated subset of {','.join(FAULTS)}")
    p.add_argument("--no-latency", action="store_true", help="skip get_latency_by_link")
    p.add_argument("--no-regret", action="store_true", help="skip regret_by_link (no engines run)")
    p.add_argument("--regret-only", action="store_true",
                   help="only regret_by_link and decisions_by_link (no cross-node rounds, faults, latency)")
    p.add_argument("--prefix", default="", help=argparse.SUPPRESS)  # the namespaces' prefix (tests)
    args = p.parse_args(argv)
    if args.no_regret and args.regret_only:
        p.error("--no-regret and --regret-only: nothing would run")
    if args.nodes < 3:
        p.error("--nodes: at least 3 (issue #25)")
    faults = [f for f in args.faults.split(",") if f]
    if unknown := set(faults) - set(FAULTS):
        p.error(f"unknown faults {sorted(unknown)}; choose from {list(FAULTS)}")
    exit_on_sigterm()  # the harness's ``with`` tears down every namespace and process
    try:
        res = run(args.quick, nodes=args.nodes, faults=faults, latency=not args.no_latency, prefix=args.prefix,
                  regret=not args.no_regret, only_regret=args.regret_only)
    except NamespacesUnavailable as e:
        print(f"bench.cluster needs network namespaces: {e}", file=sys.stderr)
        return 2
    text = json.dumps(res, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    summary = {k: res[k] for k in ("nodes", "cross_node_hit_rate", "regret_by_link", "decisions_by_link") if k in res}
    if "faults" in res:
        shown = ("wrong_outputs", "client_errors", "recovery_s", "rounds_to_recover", "network_first_s", "network_back_s",
                 "rounds_after_network", "cut_puts_shared_after")
        summary["faults"] = {k: {f: v.get(f) for f in shown if f in v}  # type: ignore[union-attr,operator]
                             for k, v in res["faults"].items()}  # type: ignore[union-attr]
    print(json.dumps(summary), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
