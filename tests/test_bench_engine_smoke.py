"""bench.engine end to end on the tiny random Llama: every key is written and the fidelity check
agrees with HF generate. (The real benchmark, on SmolLM2, is `python -m bench.engine`.)"""

from __future__ import annotations

import json

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
    assert res["fidelity_identical"] is True, res["fidelity_detail"]
    assert res["fidelity_prompts"] >= 4
    assert any(d["prompt_tokens"] >= 500 for d in res["fidelity_detail"])
    assert res["machine"]["threads"] == 2 and res["machine"]["torch_version"]
    assert "radix-hit speedup" in capsys.readouterr().out
