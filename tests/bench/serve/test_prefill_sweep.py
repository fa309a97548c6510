"""The max_prefill_tokens sweep's pure parts: the workload's shape, the summary over reps and the pick."""

from __future__ import annotations

import pytest

from bench.serve import prefill_sweep as ps
from engine.model_loader import hf_model_dir


def _rep(ttft: float, itl99: float, gaps: int = 100) -> dict:
    return {"ttft_mean_s": ttft, "ttft_p90_s": 2 * ttft, "itl_mean_s": itl99 / 4, "itl_p99_s": itl99, "itl_gaps": gaps}


def test_summary_is_the_median_with_min_and_max() -> None:
    s = ps.summarize({256: [_rep(1.0, 0.3), _rep(3.0, 0.2), _rep(2.0, 0.9)]})[256]
    assert (s["ttft_mean_s"], s["ttft_mean_s_min"], s["ttft_mean_s_max"]) == (2.0, 1.0, 3.0)
    assert s["itl_p99_s"] == 0.3 and s["itl_gaps"] == 300 and s["reps"] == 3


def test_pick_is_the_lowest_itl_p99_within_the_ttft_slack() -> None:
    summ = ps.summarize({128: [_rep(2.0, 0.1)], 256: [_rep(1.2, 0.2)], 2048: [_rep(1.0, 1.5)]})
    assert ps.pick(summ) == 256  # 128 stalls nothing but costs 2x the TTFT
    assert ps.pick(summ, slack=2.5) == 128
    assert ps.pick(summ, slack=1.0) == 2048  # no slack: the fastest first token


def test_prefix_groups_workload_shape() -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(hf_model_dir(""))
    spec = ps.PrefixGroupsSpec(groups=3, per_group=2, system_tokens=64, question_tokens=8)
    reqs = ps.prefix_group_requests(spec, tok, seed=1)
    assert len(reqs) == 6 and reqs == ps.prefix_group_requests(spec, tok, seed=1)
    systems = [r[0]["content"] for r in reqs]
    assert len(set(systems)) == 3 and all(systems.count(s) == 2 for s in systems)  # 3 groups of 2
    assert len({r[1]["content"] for r in reqs}) == 6
    with pytest.raises(ValueError):
        ps.PrefixGroupsSpec(qps=0)
