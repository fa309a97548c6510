"""Which token-selection strategy earns the selective recompute its keep (bench.blend uses the winner).

    python -m bench.blend.compare --out F.json [--requests 20] [--threads 1]

Every strategy (a score and a connector.blend.selection.Selection) runs on the same cases as
bench.blend's quick workload at each ratio in RATIOS, next to reuse_0 and random selection at the
same ratios, against full prefill. Per strategy and ratio: continuation LCS-F1, answer agreement,
KL at the last prompt position and compute_share (rows recomputed over the selective layers, as a
share of a full prefill's: gradual filtering recomputes more than r at its first layers). The
winner has the highest continuation F1 averaged over RATIOS; ``beats_random`` /
``beats_reuse0`` per ratio use bench.blend.figures.beats on the paired cases.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time

from bench.blend.data import make_cases
from bench.blend.figures import beats
from bench.blend.quality import Method, run_quality, summarize
from bench.blend.run import load_blender
from connector.blend import Blender
from connector.blend.selection import Selection

RATIOS = (0.15, 0.3)
STRATEGIES: dict[str, tuple[str, Selection]] = {
    "k": ("k", Selection()),  # LMCache's choice: K deviation at layer 1, one set for every later layer
    "v": ("v", Selection()),  # the paper's: V deviation
    "attn": ("attn", Selection()),  # the question's attention-output deviation
    "k_sink4": ("k", Selection(sink_tokens=4)),  # each chunk's first 4 tokens always in the budget
    "k_gradual": ("k", Selection(gradual_factor=2.0, gradual_layers=4)),  # 2r at layer 1, r from layer 6
    "v_sink4_gradual": ("v", Selection(sink_tokens=4, gradual_factor=2.0, gradual_layers=4)),
}


def compare_methods(base: Blender) -> dict[str, Method]:
    """reuse_0, random_r and every strategy at every r; the blenders share base's chunk store."""
    out: dict[str, Method] = {"reuse_0": (base, 0.0, "k")}
    for r in RATIOS:
        out[f"random_{r:g}"] = (base, r, "random")
    for name, (score, sel) in STRATEGIES.items():
        b = Blender(base.model, base.chunks.fingerprint, base.chunks.store, selection=sel)
        for r in RATIOS:
            out[f"{name}@{r:g}"] = (b, r, score)
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m bench.blend.compare", description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--model", default="")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    log = logging.getLogger("bench.blend.compare")
    t0 = time.perf_counter()
    base, lm = load_blender(args)
    methods = compare_methods(base)
    cases = make_cases(lm.tokenizer, args.requests, seed=args.seed, n_fact_docs=16, n_story=10, chunks=(4, 5),
                       lo=128, hi=160)

    def report(stats: dict, state: dict, done: int) -> dict:
        s = summarize(stats)
        table = {}
        for name in STRATEGIES:
            per_r = {}
            for r in RATIOS:
                m, rnd = f"{name}@{r:g}", f"random_{r:g}"
                per_r[f"{r:g}"] = {k: s[m][k] for k in ("continuation_f1", "answer_agreement", "kl", "compute_share")}
                per_r[f"{r:g}"]["beats_random"] = beats(stats[m]["f1"], stats[rnd]["f1"], stats[m]["agree"],
                                                        stats[rnd]["agree"]) if done > 1 else None
                per_r[f"{r:g}"]["beats_reuse0"] = beats(stats[m]["f1"], stats["reuse_0"]["f1"], stats[m]["agree"],
                                                        stats["reuse_0"]["agree"]) if done > 1 else None
            table[name] = per_r
        score = {n: statistics.fmean(p["continuation_f1"] for p in t.values()) for n, t in table.items()}
        baselines = {n: {k: s[n][k] for k in ("continuation_f1", "answer_agreement", "kl")}
                     for n in ["reuse_0"] + [f"random_{r:g}" for r in RATIOS]}
        result = {"model": lm.name, "threads": args.threads, "n_requests": done, "complete": done == len(cases),
                  "ratios": list(RATIOS), "strategies": table, "baselines": baselines,
                  "mean_f1": score, "winner": max(score, key=score.get),
                  "selections": {n: {"score": sc, **vars(sel)} for n, (sc, sel) in STRATEGIES.items()},
                  "elapsed_s": time.perf_counter() - t0}
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        return result

    stats, state = run_quality(methods, lm.tokenizer, cases, log, progress=report)
    result = report(stats, state, len(cases))
    log.info("wrote %s in %.0fs: winner %s", args.out, result["elapsed_s"], result["winner"])
    return result


if __name__ == "__main__":
    main()
