"""The radix-only sweep of the engine's ``max_prefill_tokens`` (``python -m bench.serve --sweep-only``).

A step of the engine takes every running decode plus up to ``max_prefill_tokens`` prompt tokens
(engine/scheduler.py): the larger the budget, the sooner a long prompt's first token, and the
longer every running stream waits for that step. The workload is the one #23 measured the stall
on: ``groups`` groups of ``per_group`` prompts, each group behind its own ``system_tokens`` system
prompt (the first prompt of a group prefills it, the others find it in the radix tree), sent in a
seeded random order at Poisson arrivals of ``qps``, into a pool that holds all of it (2 GiB).

Every (rep, setting) gets a fresh ``kvengine serve`` (no KV left from another setting), a few
unmeasured warm-up requests, then the measured requests; settings run in an order rotated per
rep, with the machine settled between them (bench/serve/settle.py). The best setting (``pick``)
is the one with the lowest ITL p99 among those whose TTFT mean is within ``TTFT_SLACK`` of the
lowest TTFT mean (medians over reps): the stall removed at a bounded cost in first tokens.
"""

from __future__ import annotations

import asyncio
import logging
import os
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench.serve.client import at_offsets, client, send
from bench.serve.figures import percentile
from bench.serve.modes import EngineSpec, mode_server
from bench.serve.schedule import poisson_count, rotated
from bench.serve.settle import settle
from bench.serve.workload import Text

log = logging.getLogger("bench.serve")
SETTINGS = (128, 256, 512, 1024, 2048)
TTFT_SLACK = 1.25  # a setting may cost this much of the best TTFT mean and still be picked


@dataclass(frozen=True)
class PrefixGroupsSpec:
    groups: int = 16
    per_group: int = 4
    system_tokens: int = 768
    question_tokens: int = 32
    answer_tokens: int = 32
    qps: float = 0.4
    warmup: int = 3  # unmeasured requests on other text before the measured ones

    def __post_init__(self) -> None:
        if min(self.groups, self.per_group, self.system_tokens, self.question_tokens, self.answer_tokens) <= 0 \
                or self.qps <= 0 or self.warmup < 0:
            raise ValueError(f"bad prefix-groups workload: {self}")


def prefix_group_requests(spec: PrefixGroupsSpec, tokenizer, seed: int) -> list[list[dict[str, str]]]:
    """Every group's prompts, in a seeded random order (a group's prompts spread over the run)."""
    text = Text(tokenizer, seed)
    systems = [text.make(spec.system_tokens) for _ in range(spec.groups)]
    reqs = [[{"role": "system", "content": systems[g]}, {"role": "user", "content": text.make(spec.question_tokens)}]
            for g in range(spec.groups) for _ in range(spec.per_group)]
    order = np.random.default_rng(seed + 1).permutation(len(reqs))
    return [reqs[i] for i in order]


def setting_stats(recs: Sequence[Any], seconds: float) -> dict[str, Any]:
    ok = [r for r in recs if r.error is None and not np.isnan(r.ttft_s)]
    ttft = [r.ttft_s for r in ok]
    itl = [g for r in ok for g in r.itl_s]
    return {"requests": len(recs), "errors": len(recs) - len(ok), "seconds": seconds,
            "ttft_mean_s": float(np.mean(ttft)) if ttft else float("nan"), "ttft_p90_s": percentile(ttft, 90),
            "itl_mean_s": float(np.mean(itl)) if itl else float("nan"), "itl_p99_s": percentile(itl, 99),
            "itl_gaps": len(itl)}


def summarize(runs: Mapping[int, Sequence[Mapping[str, Any]]]) -> dict[int, dict[str, Any]]:
    """Per setting: each figure's median, min and max over the reps."""
    out: dict[int, dict[str, Any]] = {}
    for s, reps in runs.items():
        row: dict[str, Any] = {"reps": len(reps), "itl_gaps": sum(r["itl_gaps"] for r in reps)}
        for k in ("ttft_mean_s", "ttft_p90_s", "itl_mean_s", "itl_p99_s"):
            xs = [r[k] for r in reps]
            row[k] = statistics.median(xs)
            row[f"{k}_min"], row[f"{k}_max"] = min(xs), max(xs)
        out[s] = row
    return out


def pick(summary: Mapping[int, Mapping[str, Any]], slack: float = TTFT_SLACK) -> int:
    """The setting with the lowest ITL p99 among those within ``slack`` x the lowest TTFT mean."""
    best_ttft = min(r["ttft_mean_s"] for r in summary.values())
    ok = [s for s, r in summary.items() if r["ttft_mean_s"] <= slack * best_ttft]
    return min(ok, key=lambda s: (summary[s]["itl_p99_s"], summary[s]["ttft_mean_s"]))


async def _one(port: int, model: str, reqs: list, offsets: list[float], answer: int, desc: str):
    async with client(port) as api:  # closed in this loop (after asyncio.run, each connection logs a traceback)
        jobs = [lambda m=m: send(api, model, "sweep", m, answer) for m in reqs]
        return await at_offsets(jobs, offsets, desc)


def run_sweep(spec: PrefixGroupsSpec, settings: Sequence[int], reps: int, engine: EngineSpec, tokenizer,
              work: Path, seed: int = 23) -> dict[str, Any]:
    runs: dict[int, list[dict[str, Any]]] = {s: [] for s in settings}
    order_log = []
    n = spec.groups * spec.per_group
    for rep in range(reps):
        order = [int(s) for s in rotated([str(s) for s in settings], rep)]
        order_log.append(order)
        reqs = prefix_group_requests(spec, tokenizer, seed + 100 * rep)  # the same requests for every setting
        warm = prefix_group_requests(PrefixGroupsSpec(groups=1, per_group=spec.warmup or 1), tokenizer, seed + 7)
        offsets = poisson_count(spec.qps, n, seed + 100 * rep + 2)
        for s in order:
            settled = settle(queue=None)
            es = EngineSpec(**{**vars(engine), "max_prefill_tokens": s})
            with mode_server("radix", es, work / f"r{rep}_p{s}") as srv:
                if spec.warmup:
                    asyncio.run(_one(srv.port, srv.model, warm[:spec.warmup], [0.0] * spec.warmup,
                                     spec.answer_tokens, f"warm-up {s}"))
                recs, secs = asyncio.run(_one(srv.port, srv.model, reqs, offsets, spec.answer_tokens,
                                              f"rep {rep} max_prefill_tokens={s}"))
            st = setting_stats(recs, secs)
            st.update({"rep": rep, "settle_wait_s": settled.waited_s, "settle_busy": settled.busy,
                       "loadavg": list(os.getloadavg())})
            runs[s].append(st)
            log.info("rep %d max_prefill_tokens=%d: TTFT mean %.3fs p90 %.3fs, ITL mean %.3fs p99 %.3fs (%d gaps), "
                     "load %.2f", rep, s, st["ttft_mean_s"], st["ttft_p90_s"], st["itl_mean_s"], st["itl_p99_s"],
                     st["itl_gaps"], st["loadavg"][0])
    summary = summarize(runs)
    best = pick(summary)
    ref = summary[max(settings)]
    return {"workload": vars(spec), "settings": list(settings), "reps": reps, "order_per_rep": order_log,
            "runs": {str(s): r for s, r in runs.items()}, "summary": {str(s): r for s, r in summary.items()},
            "best": best, "best_rule": f"lowest ITL p99 with TTFT mean <= {TTFT_SLACK} x the lowest TTFT mean",
            "best_vs_largest": {"itl_p99": summary[best]["itl_p99_s"] / ref["itl_p99_s"],
                                "itl_mean": summary[best]["itl_mean_s"] / ref["itl_mean_s"],
                                "ttft_mean": summary[best]["ttft_mean_s"] / ref["ttft_mean_s"],
                                "ttft_p90": summary[best]["ttft_p90_s"] / ref["ttft_p90_s"]}}
