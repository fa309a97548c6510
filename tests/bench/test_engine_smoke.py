"""bench.engine end to end on the tiny random Llama: every key is written, every figure is the
computation its samples say (recomputed here), and the fidelity check agrees with HF generate.
(The real benchmark, on SmolLM2, is `python -m bench.engine`.)"""

from __future__ import annotations

import json
from statistics import median

import pytest

from bench import engine as bench_engine

KEYS = ("hf_prefill_tok_s", "engine_prefill_tok_s", "prefill_ratio", "decode_tok_s_bs1", "decode_tok_s_bs8",
        "cold_ttft_s", "radix_hit_ttft_s", "radix_hit_speedup", "fidelity_identical", "fidelity_prompts")


def test_bench_engine_on_tiny_model(tiny_model_dir, tmp_path, capsys, monkeypatch):
    small = bench_engine.Plan(reps_prefill=1, reps_ttft=1, reps_decode=1, decode_prompt=32, decode_steps=4,
                              fid_new_tokens=8, fid_long_prompt=520)
    monkeypatch.setattr(bench_engine, "QUICK", small)
    out = tmp_path / "engine.json"
    assert bench_engine.main(["--out", str(out), "--quick", "--threads", "2", "--model", str(tiny_model_dir)]) == 0
    res = json.loads(out.read_text())
    for k in KEYS:
        assert k in res, k
    for k in KEYS[:8]:
        assert isinstance(res[k], float) and res[k] > 0, k
    # every figure is what its samples say: a rate from the median time, a ratio of the two figures
    reps = {"hf_prefill_s_all": small.reps_prefill, "engine_prefill_s_all": small.reps_prefill,
            "cold_ttft_s_all": small.reps_ttft, "radix_hit_ttft_s_all": small.reps_ttft}
    for k, n in reps.items():
        assert len(res[k]) == n and min(res[k]) > 0, k
    tokens = bench_engine.PREFIX_TOKENS
    assert res["hf_prefill_tok_s"] == pytest.approx(tokens / median(res["hf_prefill_s_all"]))
    assert res["engine_prefill_tok_s"] == pytest.approx(tokens / median(res["engine_prefill_s_all"]))
    assert res["prefill_ratio"] == pytest.approx(res["engine_prefill_tok_s"] / res["hf_prefill_tok_s"])
    assert res["cold_ttft_s"] == pytest.approx(median(res["cold_ttft_s_all"]))
    assert res["radix_hit_ttft_s"] == pytest.approx(median(res["radix_hit_ttft_s_all"]))
    assert res["radix_hit_speedup"] == pytest.approx(res["cold_ttft_s"] / res["radix_hit_ttft_s"])
    assert res["decode_bs8_over_bs1"] == pytest.approx(res["decode_tok_s_bs8"] / res["decode_tok_s_bs1"])
    assert res["decode_tok_s_bs1"] == pytest.approx(1e3 / res["decode_step_ms_bs1_median"])
    assert res["decode_tok_s_bs8"] == pytest.approx(8e3 / res["decode_step_ms_bs8_median"])
    met = res["targets_met"]
    assert met["prefill_ratio>=1.0"] == (res["prefill_ratio"] >= 1.0)
    assert met["radix_hit_speedup>=20"] == (res["radix_hit_speedup"] >= 20)
    assert met["decode_bs8>=3*bs1"] == (res["decode_tok_s_bs8"] >= 3 * res["decode_tok_s_bs1"])
    # fidelity: one row per prompt, each row's verdict is its own comparison, the headline their conjunction
    detail = res["fidelity_detail"]
    assert res["fidelity_prompts"] == len(detail) >= 4
    assert all(d["identical"] == (d["hf"] == d["engine"]) and d["engine"] for d in detail)
    assert res["fidelity_identical"] is all(d["identical"] for d in detail) is True, detail
    assert met["fidelity_identical"] is True
    assert any(d["prompt_tokens"] >= 500 for d in detail)
    assert res["machine"]["threads"] == 2 and res["machine"]["torch_version"]
    assert len(res["machine"]["loadavg_start"]) == len(res["machine"]["loadavg_end"]) == 3
    assert "radix-hit speedup" in capsys.readouterr().out
