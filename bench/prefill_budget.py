"""What the step budget costs a lone prompt: TTFT of one prompt on an idle engine per ``max_prefill_tokens``.

    python -m bench.prefill_budget --out F.json [--budgets 128,256,512,2048] [--lengths 512,2048] [--reps 3]

bench.serve's sweep (``--sweep-only``) picks the engine's default step budget under load, where a
smaller budget keeps decoding streams from waiting behind long prefills. This is the other side:
a smaller budget splits a prompt over more steps, each reading the weights again, so a prompt with
nothing else running waits longer for its first token. One in-process engine per budget (same
weights, same pool), prompts of random tokens, budgets interleaved within each repetition so
background load falls on all alike; the median of ``reps`` per (length, budget) and each one's
ratio to the largest budget.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np
import torch

from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.model_loader import load_model
from engine.request import Status
from engine.sampling import SamplingParams


def ttft(eng: LLMEngine, ids: list[int]) -> float:
    t0 = time.monotonic()
    rid = eng.add_request(ids, SamplingParams(max_tokens=1, ignore_eos=True))
    req = eng.requests[rid]
    while req.status is not Status.FINISHED:
        eng.step()
    return req.first_token_time - t0  # type: ignore[operator]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.prefill_budget", description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--budgets", default="128,256,512,2048")
    ap.add_argument("--lengths", default="512,2048")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="the defaults (for make bench)")
    a = ap.parse_args(argv)
    budgets = [int(x) for x in a.budgets.split(",")]
    lengths = [int(x) for x in a.lengths.split(",")]
    torch.set_num_threads(a.threads)
    lm = load_model("")
    pages = (max(lengths) + 64) // 16 * 2
    engines = {b: LLMEngine(EngineConfig(num_pages=pages, num_threads=a.threads, max_prefill_tokens=b), loaded=lm)
               for b in budgets}
    rng = np.random.default_rng(0)
    load_before = os.getloadavg()
    samples: dict[int, dict[int, list[float]]] = {n: {b: [] for b in budgets} for n in lengths}
    for n in lengths:
        ttft(engines[budgets[0]], [int(x) for x in rng.integers(200, 40000, n)])  # warm-up, not counted
        for _ in range(a.reps):
            for b, eng in engines.items():
                samples[n][b].append(ttft(eng, [int(x) for x in rng.integers(200, 40000, n)]))
    top = max(budgets)
    doc = {"budgets": budgets, "lengths": lengths, "reps": a.reps, "threads": a.threads,
           "ttft_s": {str(n): {str(b): statistics.median(v) for b, v in per.items()} for n, per in samples.items()},
           "ttft_runs_s": {str(n): {str(b): v for b, v in per.items()} for n, per in samples.items()},
           "ttft_vs_largest": {str(n): {str(b): statistics.median(v) / statistics.median(per[top]) for b, v in per.items()}
                               for n, per in samples.items()},
           "loadavg_before": list(load_before), "loadavg_after": list(os.getloadavg())}  # fmt: skip
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=1)
    print(json.dumps(doc["ttft_vs_largest"], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
