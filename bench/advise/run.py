"""Does ``kvstore advise`` predict what the real TieredStore does? ``python -m bench.advise --out F.json``.

For each synthetic workload (cyclic, zipfian, multi-round chat; bench/advise/workloads.py) it
replays the workload through a real TieredStore (cpu, then cpu+disk) with the daemon's trace
recorder on, runs the advisor on that trace file, and replays again at several other sizes:
  mrc_max_abs_error               the largest |advisor's hit ratio - replay's| over every size,
                                  trace and chain (for cpu+disk: the cpu tier's share and the total)
  recommendation_hit_rate_error   the largest |hit ratio promised for the recommended size -
                                  replay's at that size| (cpu sized alone; disk under the traced cpu)
Targets: <= 0.02 both. Beside them, the gap of two naive models of the chain (one LRU of
cpu + disk bytes, or of the larger tier), to show the metric can fail. Those replays use the
advisor's own model of the client, so they check the curves' arithmetic, not the prediction:
  real_runs, real_max_abs_error   the advisor on a trace of real engines and a real daemon, against
                                  re-runs at the recommended size, half and double it
                                  (bench/advise/real.py; ``--no-real`` skips them)
``--quick``: 3 sizes per synthetic chain, a smaller real workload (~6 min on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.advise.workloads import Workload, all_workloads, replay
from bench.servers import exit_on_sigterm
from kvstore.ops.advise import advise
from kvstore.ops.mrc import lru_curve, references
from kvstore.ops.mrc_chain import chain_hits
from kvstore.ops.trace import read_trace


def figures(traces: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The headline figures from per-trace results (pure: unit-tested)."""
    gaps = [abs(p["model"] - p["replay"]) for t in traces for p in t["points"]]
    recs = [abs(r["promised"] - r["replay"]) for t in traces for r in t["recommendations"]]

    def naive(kind: str) -> float | None:
        gap = [abs(p[kind] - p["replay"]) for t in traces for p in t["points"] if kind in p]
        return round(max(gap), 4) if gap else None

    return {
        "mrc_max_abs_error": round(max(gaps), 4) if gaps else None,
        "traces": len(traces),
        "recommendation_hit_rate_error": round(max(recs), 4) if recs else None,
        "points": len(gaps),
        "recommendations": len(recs),
        # the same gap had the chain been modelled as one LRU of cpu + disk bytes, or of the larger:
        # what the metric would show for a model that ignores how TieredStore spills and promotes
        "naive_exclusive_max_abs_error": naive("exclusive"),
        "naive_inclusive_max_abs_error": naive("inclusive"),
    }


def run_trace(w: Workload, fractions: Sequence[float], target_share: float = 0.9) -> dict[str, Any]:
    """Trace ``w`` on a cpu+disk chain, then compare the advisor with replays; the target hit rate
    is ``target_share`` of what an unbounded cache reaches on this workload (one it can reach)."""
    ws = w.working_set_bytes
    cpu, disk = ws // 4, ws // 2  # the traced chain: a cpu tier that holds a quarter of the working set
    with tempfile.TemporaryDirectory(prefix="tierkv-advise-") as tmp:
        path = Path(tmp) / f"{w.name}.kvtrace"
        replay(w, [cpu, disk], trace_to=path)
        trace = read_trace(path)
    refs = references(trace)
    curve = lru_curve(refs)
    target = round(target_share * curve.max_hit_ratio, 3)
    points: list[dict[str, Any]] = []
    for f in fractions:
        c = int(ws * f)
        r = replay(w, [c])
        points.append({"chain": "cpu", "cpu": c, "what": "hit", "model": float(curve.hit_ratio(c)),
                       "replay": r.hit_ratio()})  # fmt: skip
        r2 = replay(w, [cpu, c])
        model = chain_hits(refs, [cpu, c])
        points.append({"chain": "cpu+disk", "cpu": cpu, "disk": c, "what": "cpu hit", "model": float(model[0]),
                       "replay": r2.hit_ratio(0)})  # fmt: skip
        points.append({"chain": "cpu+disk", "cpu": cpu, "disk": c, "what": "total hit", "model": float(model.sum()),
                       "replay": r2.hit_ratio(), "exclusive": float(curve.hit_ratio(cpu + c)),
                       "inclusive": float(curve.hit_ratio(max(cpu, c)))})  # fmt: skip
    advice = advise(trace, target)
    recs = []
    top, low = advice.tiers
    if top.recommended_bytes is not None:
        recs.append({"tier": "cpu", "bytes": top.recommended_bytes, "promised": top.hit_ratio_recommended,
                     "replay": replay(w, [top.recommended_bytes]).hit_ratio()})  # fmt: skip
    if low.recommended_bytes:
        recs.append({"tier": "disk", "bytes": low.recommended_bytes, "promised": low.hit_ratio_recommended,
                     "replay": replay(w, [cpu, low.recommended_bytes]).hit_ratio()})  # fmt: skip
    return {"name": w.name, "working_set_bytes": ws, "references": len(refs), "target": target,
            "max_hit_ratio": advice.max_hit_ratio, "points": points, "recommendations": recs}  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.advise", description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="where to write the JSON results")
    ap.add_argument("--quick", action="store_true", help="three sizes per chain, a smaller real workload")
    ap.add_argument("--no-real", action="store_true", help="skip the runs of real engines and daemon")
    args = ap.parse_args(argv)
    exit_on_sigterm()
    fractions = (0.15, 0.4, 0.8) if args.quick else (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.8, 1.0, 1.2)
    from bench.e2e.support import git_revision  # (imports torch: kept out of the figures' import)

    machine = {"cpu_count": os.cpu_count(), "git_revision": git_revision(), "loadavg_start": list(os.getloadavg())}
    t0 = time.perf_counter()
    traces = []
    for w in all_workloads():
        traces.append(run_trace(w, fractions))
    real: dict[str, Any] = {}
    if not args.no_real:
        from bench.advise.real import real_runs

        with tempfile.TemporaryDirectory(prefix="tierkv-advise-real-") as tmp:
            real = real_runs(args.quick, Path(tmp), log=lambda m: print(m, flush=True))
    machine["loadavg_end"] = list(os.getloadavg())
    out = figures(traces) | real | {"seconds": round(time.perf_counter() - t0, 1), "quick": args.quick, "machine": machine,
                             "per_trace": traces}  # fmt: skip
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(json.dumps({k: v for k, v in out.items() if k not in ("per_trace", "real")}))
    return 0
