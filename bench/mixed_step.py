"""What another client's prompt costs a decoding stream: one engine step of a lone decode, and the
same step with one new prompt of k tokens from someone else joined to it.

    python -m bench.mixed_step --out F.json [--threads 1,2] [--prompt-tokens 5,16,64] [--reps 15]

Why: bench.soak's DoS probes hold a normal client's ITL p99 under each probe to <= 1.5x without it
(issue #22). A probe the engine refuses costs only its refusal; a flood of real requests (the salt
flood: a few tokens each, max_tokens 1) is admitted, and each of its prompts is computed in some
step of the stream's. This measures that step against a decode-only one, in-process (no HTTP, no
daemon, no other process): the floor of what any admitted request costs the stream's gap, so the
p99 ratio under a flood that reaches more than 1% of the stream's steps is at least this.

One in-process engine per thread count, the bundled model; a stream decodes throughout; for each
rep, the decode-only step and then, for each k, a step joined by one new k-token prompt
(max_tokens 1: it leaves in that step), interleaved so background load falls on all alike. The
median of ``reps`` and each one's ratio to the decode-only step.

Each thread count runs twice: the engine as configured by default (``cpu_gemm`` auto: the native
form of csrc/gemm.c among the forms timed at start-up) and with ``cpu_gemm`` torch (torch's forms
only, the engine before the native form), in alternating order; ``native_speedup`` is the torch
engine's median step over the default one's (``torch_forms`` holds its figures), and ``forms``
each engine's start-up choice.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np
import torch

from engine import cpu_gemm
from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.model_loader import load_model
from engine.sampling import SamplingParams


def _timed_step(eng: LLMEngine) -> float:
    t0 = time.perf_counter()
    eng.step()
    return time.perf_counter() - t0


def measure(eng: LLMEngine, prompt_tokens: list[int], reps: int, rng: np.random.Generator) -> dict[str, list[float]]:
    """Step seconds: ``decode`` (the stream alone) and ``k`` (one k-token prompt joined)."""
    eng.add_request([int(x) for x in rng.integers(200, 40000, 64)],
                    SamplingParams(max_tokens=2000, ignore_eos=True))  # fmt: skip
    for _ in range(4):  # its prefill, then decode steps: warm
        eng.step()
    out: dict[str, list[float]] = {"decode": [], **{str(k): [] for k in prompt_tokens}}
    for _ in range(reps):
        out["decode"].append(_timed_step(eng))
        for k in prompt_tokens:
            eng.add_request([int(x) for x in rng.integers(200, 40000, k)], SamplingParams(max_tokens=1, ignore_eos=True))
            out[str(k)].append(_timed_step(eng))
            _timed_step(eng)  # a decode step between: the joined request is gone
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.mixed_step", description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--prompt-tokens", default="5,16,64")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--quick", action="store_true", help="the defaults (for make bench)")
    a = ap.parse_args(argv)
    threads = [int(x) for x in a.threads.split(",")]
    ks = [int(x) for x in a.prompt_tokens.split(",")]
    lm = load_model("")
    rng = np.random.default_rng(0)
    load_before = os.getloadavg()
    doc: dict[str, object] = {"threads": threads, "prompt_tokens": ks, "reps": a.reps, "step_s": {},
                              "step_runs_s": {}, "ratio_to_decode": {}, "forms": {},
                              "torch_forms": {"step_s": {}, "step_runs_s": {}, "ratio_to_decode": {}},
                              "native_speedup": {}}  # fmt: skip
    for i, t in enumerate(threads):
        torch.set_num_threads(t)
        meds = {}
        for gemm in (("auto", "torch") if i % 2 == 0 else ("torch", "auto")):
            eng = LLMEngine(EngineConfig(num_threads=t, num_pages=256, cpu_gemm=gemm), loaded=lm)
            lin = eng.model.linear
            doc["forms"].setdefault(str(t), {})[gemm] = cpu_gemm.describe(getattr(lin, "plan", ()))  # type: ignore[union-attr]
            runs = measure(eng, ks, a.reps, rng)
            del eng
            med = meds[gemm] = {k: statistics.median(v) for k, v in runs.items()}
            into = doc if gemm == "auto" else doc["torch_forms"]
            into["step_s"][str(t)] = med  # type: ignore[index]
            into["step_runs_s"][str(t)] = runs  # type: ignore[index]
            into["ratio_to_decode"][str(t)] = {k: med[k] / med["decode"] for k in runs if k != "decode"}  # type: ignore[index]
        doc["native_speedup"][str(t)] = {k: meds["torch"][k] / meds["auto"][k] for k in meds["auto"]}  # type: ignore[index]
    doc["loadavg_before"], doc["loadavg_after"] = list(load_before), list(os.getloadavg())
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=1)
    print(json.dumps({k: doc[k] for k in ("forms", "step_s", "ratio_to_decode", "native_speedup")}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
