"""What ``kvstore advise`` prints and draws: a table per tier, JSON, and a PNG of the curves."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the CLI builds its parser from add_arguments: keep numpy out of that import
    from kvstore.ops.advise import Advice


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def table(a: Advice) -> str:
    how = ("exact LRU stack distances" if a.rate >= 1
           else f"SHARDS sampling at rate {a.rate:.4g}, hit ratios within +/-{a.sampling_error:.3f}")  # fmt: skip
    lines = [
        f"trace: {a.references} references, {a.demands} page reads over {a.duration_s:.1f} s; {how}",
        f"target hit rate {a.target:.2f} (an unbounded cache reaches {a.max_hit_ratio:.3f}; the rest are first reads);"
        f" mean page {fmt_bytes(a.mean_page_bytes)}",
    ]
    cols = ("tier", "size now", "hit now", "recommended", "hit then", "prefill saved / 1000 reads")
    rows = []
    for t in a.tiers:
        rec = "unreachable" if t.recommended_bytes is None else fmt_bytes(t.recommended_bytes)
        rows.append((t.name, fmt_bytes(t.configured_bytes), f"{t.hit_ratio_now:.3f}", rec,
                     f"{t.hit_ratio_recommended:.3f}", f"{t.saved_s_per_1000_reads:+.2f} s"))  # fmt: skip
    widths = [max(len(str(x)) for x in col) for col in zip(cols, *rows, strict=True)]
    lines += ["  ".join(str(x).rjust(w) for x, w in zip(row, widths, strict=True)) for row in (cols, *rows)]
    lines.append("hit ratios are cumulative: a tier's row counts reads served by it or a tier above it "
                 "(the tiers above at their traced sizes)")
    if a.duration_s > 0:
        for t in a.tiers:
            per_s = t.saved_s_per_1000_reads * a.demands / 1000 / a.duration_s
            lines.append(f"{t.name}: at the traced rate ({a.demands / a.duration_s:.1f} reads/s) the recommended size "
                         f"saves {per_s:.3f} s of prefill per second")  # fmt: skip
    lines += [f"note: {n}" for n in a.notes]
    return "\n".join(lines)


def plot(a: Advice, path: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(a.tiers), figsize=(5 * len(a.tiers), 3.8), squeeze=False)
    for i, (ax, t) in enumerate(zip(axes[0], a.tiers, strict=True)):
        xs = [c / 2**20 for c, _ in t.curve]
        ax.plot(xs, [h for _, h in t.curve], marker=".", label="hit ratio")
        if a.sampling_error:
            ax.fill_between(xs, [max(0, h - a.sampling_error) for _, h in t.curve],
                            [min(1, h + a.sampling_error) for _, h in t.curve], alpha=0.2, label="sampling error")  # fmt: skip
        ax.axvline(t.configured_bytes / 2**20, color="grey", ls="--", label="traced size")
        if t.recommended_bytes is not None:
            ax.axvline(t.recommended_bytes / 2**20, color="green", ls=":", label="recommended")
        ax.axhline(a.target, color="red", lw=0.8, label=f"target {a.target:.2f}")
        above = ", ".join(u.name for u in a.tiers[:i])
        ax.set(title=t.name + (f" ({above} at traced size)" if above else " alone"), xlabel="capacity (MiB)", ylabel="hit ratio",
               ylim=(0, 1.02))  # fmt: skip
        ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", help="a trace file written by `kvstore trace stop`")
    p.add_argument("--target-hit-rate", type=float, default=0.8, help="hit ratio to size for (default 0.8)")
    p.add_argument("--png", help="write the curves to this PNG")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.add_argument("--cost", help="JSON of cost figures (kv_bytes_per_token, prefill_s_per_token, "
                   "tiers: {name: [latency_s, bytes_per_s]}); default: kvstore/ops/advise.py CostFigures")
    p.add_argument("--exact-limit", type=int, default=300_000,
                   help="exact stack distances up to this many references, SHARDS sampling above (default 300000)")
    p.add_argument("--samples", type=int, default=200_000, help="references SHARDS keeps (default 200000)")


def run(args: argparse.Namespace) -> int:
    """Raises TraceError (one line) on a bad trace or figures; the CLI prints it and exits 2."""
    from kvstore.ops.advise import CostFigures, advise
    from kvstore.ops.trace import read_trace

    cost = CostFigures.load(args.cost) if args.cost else CostFigures()
    a = advise(read_trace(args.trace), args.target_hit_rate, cost, args.exact_limit, args.samples)
    if args.png:
        plot(a, args.png)
    if args.json:
        json.dump(a.to_json(), sys.stdout, indent=1)
        print()
    else:
        print(table(a))
    return 0
