"""bench.serve's figures on synthetic records: each is the computation it claims, and each target
comes out false where it should (a missing mode or figure is never met)."""

from __future__ import annotations

import math

import pytest

from bench.serve import figures as fig
from bench.serve.client import Record


def _rec(ttft: float, itl: list[float], prompt: int = 100, tierkv: dict | None = None, error: str | None = None,
         completion: int = 4) -> Record:
    return Record("u", 0.0, ttft_s=ttft, itl_s=itl, prompt_tokens=prompt, completion_tokens=completion,
                  tierkv=tierkv, error=error)


def _ext(radix: int, daemon: int, computed: int, loaded: dict[str, int] | None = None, tier: str | None = None) -> dict:
    ext = {"cached": {"radix": radix, "daemon": daemon, "blend_prefix": 0, "blend_reused": 0},
           "computed": {"blend_selected": 0, "blend_chunk_miss": 0, "prefill": computed}, "daemon_tier": tier}
    if loaded is not None:
        ext["pages"] = {"page_size": 16, "total": 0,
                        "outcomes": [{"reason": "loaded", "tier": t, "pages": n} for t, n in loaded.items()]
                        + [{"reason": "tail", "tier": None, "pages": 1}]}
    return ext


def test_point_stats_over_the_requests_that_completed() -> None:
    recs = [_rec(t, [0.1, 0.2]) for t in (1.0, 2.0, 3.0, 4.0)] + [_rec(math.nan, [], error="APIError: boom")]
    st = fig.point_stats(recs, seconds=10.0)
    assert (st["requests"], st["errors"]) == (5, 1)
    assert st["ttft_mean_s"] == pytest.approx(2.5) and st["ttft_p50_s"] == pytest.approx(2.5)
    assert st["ttft_p90_s"] == pytest.approx(3.7) and st["ttft_p99_s"] == pytest.approx(3.97)
    assert st["itl_p50_s"] == pytest.approx(0.15) and st["itl_p99_s"] == pytest.approx(0.2)
    assert st["finished_per_s"] == pytest.approx(0.4) and st["output_tokens_per_s"] == pytest.approx(1.6)
    assert math.isnan(fig.point_stats([], 1.0)["ttft_p90_s"])


def test_tokens_by_source_splits_radix_tiers_and_recompute() -> None:
    recs = [_rec(1, [], 128, _ext(32, 80, 16, loaded={"cpu": 3, "disk": 2})),
            _rec(1, [], 100, _ext(0, 64, 36, tier="s3")),  # no page detail: the usage's tier
            _rec(1, [], 50, None)]  # no extension: all computed
    assert fig.tokens_by_source(recs) == {"radix": 32, "cpu": 48, "disk": 32, "s3": 64, "recomputed": 102}
    blend = _ext(16, 0, 20)
    blend["cached"]["blend_reused"] = 64
    assert fig.tokens_by_source([_rec(1, [], 100, blend)]) == {"radix": 16, "recomputed": 20, "other": 64}


def _cap_pt(qps: float, ttft: float, itl: list[float], src: dict | None = None) -> dict:
    return {"offered_qps": qps, "ttft_mean_s": ttft, "ttft_p50_s": ttft, "ttft_p90_s": 2 * ttft, "ttft_p99_s": 3 * ttft,
            "completed_per_s": qps, "_itl": itl, "tokens_by_source": src or {"radix": 10, "recomputed": 5}}


def test_mode_summary_is_the_median_knee_and_the_reference_point_pooled() -> None:
    runs = [{"knee_qps": 1.5, "capped": False, "points": [_cap_pt(0.5, 1.0, [0.1] * 600), _cap_pt(1.0, 9.0, [5.0])]},
            {"knee_qps": 0.75, "capped": False, "points": [_cap_pt(0.5, 3.0, [0.2] * 600)]},
            {"knee_qps": 1.25, "capped": True, "points": [_cap_pt(0.5, 2.0, [0.3] * 600)]}]
    m = fig.mode_summary(runs, reference_qps=0.5)
    assert m["capacity_qps"] == 1.25 and m["capacity_qps_runs"] == [1.5, 0.75, 1.25]
    assert m["capacity_qps_spread"] == {"min": 0.75, "median": 1.25, "max": 1.5} and m["capped_runs"] == 1
    assert m["ttft_mean_s"] == 2.0 and m["reference_points"] == 3  # the 1 req/s point is not the reference
    assert m["itl_gaps"] == 1800 and m["itl_p50_s"] == pytest.approx(0.2)  # pooled over the runs' gaps
    assert m["tokens_by_source"] == {"radix": 30, "recomputed": 15}
    assert math.isnan(fig.mode_summary([], 0.5)["capacity_qps"])


def _doc(**over: float) -> dict:
    v = {"ws": 4.2, "r_mean": 2.0, "c_mean": 0.3, "r_qps": 0.5, "c_qps": 2.0, "r_itl": 1.0, "c_itl": 0.2,
         "r_p90": 3.0, "s_p90": 1.0} | over
    return {"working_set_over_pool": v["ws"], "modes": {
        "radix": {"ttft_mean_s": v["r_mean"], "capacity_qps": v["r_qps"], "itl_p99_s": v["r_itl"],
                  "ttft_p90_s": v["r_p90"]},
        "daemon_cpu": {"ttft_mean_s": v["c_mean"], "capacity_qps": v["c_qps"], "itl_p99_s": v["c_itl"],
                       "ttft_p90_s": 0.5},
        "daemon_s3": {"ttft_mean_s": 0.5, "capacity_qps": 1.0, "itl_p99_s": 0.3, "ttft_p90_s": v["s_p90"]}}}


def test_every_target_met() -> None:
    t = fig.target_figures(_doc())
    assert all(x["met"] for x in t.values()), t
    assert t["cpu_ttft_mean_vs_radix"]["value"] == pytest.approx(0.15)
    assert t["cpu_max_qps_vs_radix"]["value"] == pytest.approx(4.0)


@pytest.mark.parametrize("over,target", [
    ({"ws": 3.9}, "working_set_over_pool"),
    ({"c_mean": 0.7}, "cpu_ttft_mean_vs_radix"),  # 0.35 of radix's
    ({"c_qps": 0.75}, "cpu_max_qps_vs_radix"),  # 1.5x
    ({"r_qps": 0.0, "c_qps": 0.0}, "cpu_max_qps_vs_radix"),  # neither held the SLO: no ratio
    ({"c_itl": 1.3}, "cpu_itl_p99_vs_radix"),
    ({"s_p90": 3.1}, "s3_ttft_p90_vs_radix"),
    ({"c_mean": math.nan}, "cpu_ttft_mean_vs_radix"),
])
def test_each_target_can_fail(over: dict, target: str) -> None:
    t = fig.target_figures(_doc(**over))
    assert not t[target]["met"]
    assert all(x["met"] for name, x in t.items() if name != target)


def test_a_missing_mode_meets_nothing_it_is_in() -> None:
    doc = _doc()
    del doc["modes"]["daemon_s3"]
    t = fig.target_figures(doc)
    assert not t["s3_ttft_p90_vs_radix"]["met"] and t["s3_ttft_p90_vs_radix"]["value"] is None
    assert t["cpu_itl_p99_vs_radix"]["met"]
    assert not fig.target_figures({"modes": {}})["working_set_over_pool"]["met"]


def test_scrape_keeps_the_named_samples() -> None:
    text = "\n".join([
        "# HELP tierkv_connector_decisions_total Cost-model decisions per request",
        'tierkv_connector_decisions_total{outcome="load_all",tier="cpu"} 32.0',
        'tierkv_connector_decisions_total{outcome="recompute",tier="s3"} 0.0',
        "tierkv_engine_preemptions 3.0", "tierkv_engine_queue_depth 1.0"])
    assert fig.scrape(text) == {'tierkv_connector_decisions_total{outcome="load_all",tier="cpu"}': 32.0,
                                "tierkv_engine_preemptions": 3.0}
