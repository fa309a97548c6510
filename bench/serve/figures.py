"""The figures of bench.serve, as pure functions of what the client recorded (tested on synthetic
records in tests/bench/serve/test_figures.py).

A point is the requests sent open-loop (Poisson) in one measured window; its TTFT and inter-token
figures are over the requests that completed. A mode's ``capacity_qps`` is the median over runs of
each run's knee (bench/serve/knee.py), with every run's knee and their spread beside it. Its TTFT
and ITL figures are at the reference rate (the grid's first point, which every run of every mode
measures, so modes compare at the same load), pooled over the runs. The target
``cpu_max_qps_vs_radix`` keeps its name (bench/run_all.py reads it) and is now the ratio of the
capacities.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from bench.serve.client import Record

#: the issue's targets (the JSON's ``targets``): figure -> (comparison, limit, as written)
TARGETS = {
    "working_set_over_pool": (">=", 4.0, ">= 4"),
    "cpu_ttft_mean_vs_radix": ("<=", 1 / 3, "<= 1/3"),
    "cpu_max_qps_vs_radix": (">=", 2.0, ">= 2"),
    "cpu_itl_p99_vs_radix": ("<=", 1.2, "<= 1.2"),
    "s3_ttft_p90_vs_radix": ("<=", 1.0, "<= 1"),
}


#: the server's own counters kept beside the figures (decisions and their inputs, loads, preemptions)
SCRAPED = ("tierkv_connector_decisions_total", "tierkv_connector_load_failures_total",
           "tierkv_connector_fetches_total", "tierkv_connector_load_aware_changes_total",
           "tierkv_connector_lookups_total", "tierkv_connector_decision_transfer_wait_seconds_sum",
           "tierkv_connector_decision_prefill_wait_seconds_sum", "tierkv_connector_loading_seconds_sum",
           "tierkv_connector_loading_seconds_count", "tierkv_engine_preemptions", "tierkv_engine_prompt_pages_total")


def scrape(text: str, names: Iterable[str] = SCRAPED) -> dict[str, float]:
    """``name{labels}`` -> value of the Prometheus samples named in ``names`` (zeros left out)."""
    wanted = set(names)
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        sample, _, value = line.rpartition(" ")
        if sample.split("{", 1)[0] in wanted and float(value):
            out[sample] = float(value)
    return out


def percentile(xs: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs, dtype=float), q)) if len(xs) else math.nan


def tokens_by_source(records: Iterable[Record]) -> dict[str, int]:
    """Prompt tokens by where their KV came from: the radix tree, each daemon tier, recomputed (any
    other reuse, e.g. CacheBlend's, under ``other``); from each usage's ``tierkv`` extension."""
    out: dict[str, int] = {"radix": 0, "recomputed": 0}
    for r in records:
        ext = r.tierkv
        if not ext:
            out["recomputed"] += r.prompt_tokens
            continue
        cached, computed = ext.get("cached", {}), ext.get("computed", {})
        out["radix"] += int(cached.get("radix", 0))
        out["recomputed"] += int(sum(computed.values()))
        daemon = int(cached.get("daemon", 0))
        pages = ext.get("pages") or {}
        by_tier = {o["tier"] or "?": o["pages"] * pages["page_size"] for o in pages.get("outcomes", ())
                   if o["reason"] == "loaded"}
        if sum(by_tier.values()) != daemon:  # no page detail: all of it from the tier the usage names
            by_tier = {ext.get("daemon_tier") or "daemon": daemon} if daemon else {}
        for t, n in by_tier.items():
            out[t] = out.get(t, 0) + n
        other = sum(int(v) for k, v in cached.items() if k not in ("radix", "daemon"))
        if other:
            out["other"] = out.get("other", 0) + other
    return out


def point_stats(records: Sequence[Record], seconds: float) -> dict[str, Any]:
    ok = [r for r in records if r.error is None and not math.isnan(r.ttft_s)]
    ttft = [r.ttft_s for r in ok]
    itl = [g for r in ok for g in r.itl_s]
    return {
        "requests": len(records), "errors": len(records) - len(ok), "seconds": seconds,
        "ttft_mean_s": float(np.mean(ttft)) if ttft else math.nan,
        "ttft_p50_s": percentile(ttft, 50), "ttft_p90_s": percentile(ttft, 90), "ttft_p99_s": percentile(ttft, 99),
        "itl_p50_s": percentile(itl, 50), "itl_p99_s": percentile(itl, 99),
        "finished_per_s": len(ok) / seconds if seconds > 0 else math.nan,
        "output_tokens_per_s": sum(r.completion_tokens for r in ok) / seconds if seconds > 0 else math.nan,
        "tokens_by_source": tokens_by_source(ok),
    }


def spread(xs: Sequence[float]) -> dict[str, float]:
    return {"min": float(min(xs)), "median": float(np.median(xs)), "max": float(max(xs))}


def mode_summary(runs: Sequence[Mapping[str, Any]], reference_qps: float) -> dict[str, Any]:
    """A mode's figures from its runs (each with ``knee_qps`` and ``points``, a point with its raw
    gaps under ``_itl``): the capacity's median, every run's and their spread; the reference
    point's TTFT (median over runs) and ITL (pooled over the runs' gaps)."""
    knees = [float(r["knee_qps"]) for r in runs]
    refs = [p for r in runs for p in r["points"] if p["offered_qps"] == reference_qps]
    gaps = [g for p in refs for g in p.get("_itl", ())]
    src: dict[str, int] = {}
    for p in refs:
        for k, v in p["tokens_by_source"].items():
            src[k] = src.get(k, 0) + v

    def med(key: str) -> float:
        xs = [p[key] for p in refs if not math.isnan(p[key])]
        return float(np.median(xs)) if xs else math.nan

    return {"capacity_qps": float(np.median(knees)) if knees else math.nan, "capacity_qps_runs": knees,
            "capacity_qps_spread": spread(knees) if knees else None,
            "capped_runs": sum(bool(r.get("capped")) for r in runs),
            "reference_qps": reference_qps, "reference_points": len(refs),
            "ttft_mean_s": med("ttft_mean_s"), "ttft_p50_s": med("ttft_p50_s"), "ttft_p90_s": med("ttft_p90_s"),
            "ttft_p99_s": med("ttft_p99_s"), "completed_per_s": med("completed_per_s"),
            "itl_p50_s": percentile(gaps, 50), "itl_p99_s": percentile(gaps, 99), "itl_gaps": len(gaps),
            "tokens_by_source": src}


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or math.isnan(a) or math.isnan(b):
        return None
    if b == 0:
        return math.inf if a > 0 else None
    return a / b


def target_figures(doc: Mapping[str, Any]) -> dict[str, Any]:
    """Each target's figure and whether it is met (a missing mode or figure is not met)."""
    modes = doc.get("modes", {})

    def fig(mode: str, key: str) -> float | None:
        v = modes.get(mode, {}).get(key)
        return None if v is None else float(v)

    values = {
        "working_set_over_pool": doc.get("working_set_over_pool"),
        "cpu_ttft_mean_vs_radix": _ratio(fig("daemon_cpu", "ttft_mean_s"), fig("radix", "ttft_mean_s")),
        "cpu_max_qps_vs_radix": _ratio(fig("daemon_cpu", "capacity_qps"), fig("radix", "capacity_qps")),
        "cpu_itl_p99_vs_radix": _ratio(fig("daemon_cpu", "itl_p99_s"), fig("radix", "itl_p99_s")),
        "s3_ttft_p90_vs_radix": _ratio(fig("daemon_s3", "ttft_p90_s"), fig("radix", "ttft_p90_s")),
    }
    out: dict[str, Any] = {}
    for name, v in values.items():
        op, limit, text = TARGETS[name]
        met = v is not None and (v >= limit if op == ">=" else v <= limit)
        out[name] = {"value": v, "target": text, "met": bool(met)}
    return out
