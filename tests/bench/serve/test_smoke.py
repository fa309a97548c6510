"""bench.serve end to end on the tiny random Llama, sized down: real kvengine servers (radix only,
no cache, a cpu daemon; the other daemon modes differ only in the daemon's tier flag), the OpenAI
client, Poisson points, the knee search, every
key of the JSON the issue names, the plot. (The real benchmark, on SmolLM2, is
`python -m bench.serve --quick`.)"""

from __future__ import annotations

import json
import shutil

import pytest

from bench import serve
from bench.serve import run
from bench.serve.capacity import PointPlan
from bench.serve.workload import QASpec
from engine.model_loader import hf_model_dir

pytestmark = pytest.mark.timeout(600)
KEYS = ("capacity_qps", "capacity_qps_runs", "capacity_qps_spread", "ttft_mean_s", "ttft_p90_s", "itl_p50_s",
        "itl_p99_s", "itl_gaps", "tokens_by_source", "runs")
POINT_KEYS = ("offered_qps", "completed_per_s", "sent_per_s", "duration_s", "itl_gaps", "ttft_p90_s", "passes",
              "held_tokens_start", "held_tokens_end", "settle")


def test_bench_serve_on_tiny_model(tiny_model_dir, tmp_path, monkeypatch) -> None:
    qa = QASpec(system_tokens=32, context_tokens=96, question_tokens=8, answer_tokens=4, max_turns=2)
    # one point per mode (the knee's walk and bisection are tests/bench/serve/test_knee.py's); a
    # generous SLO, and the knee checked against the point, not against a value
    small = run.Preset(qa, 24, (4.0,), PointPlan((2.0,), 0, 2.0, 4.0, 20.0, 60.0, 2.0), 1,
                       ("no_cache", "radix", "daemon_cpu"), None, ())
    monkeypatch.setattr(run, "QUICK", small)
    # The tiny model recomputes a page faster than any tier loads it, so the cost model would rightly
    # recompute: this smoke checks the plumbing, so every hit is loaded.
    monkeypatch.setenv("TIERKV_CONNECTOR_LOAD_MODE", "always")
    model = shutil.copytree(tiny_model_dir, tmp_path / "tiny")  # with SmolLM2's chat template: the API is chat
    shutil.copy(hf_model_dir("") / "chat_template.jinja", model / "chat_template.jinja")
    out = tmp_path / "serve.json"
    assert serve.main(["--out", str(out), "--quick", "--model", str(model)]) == 0
    doc = json.loads(out.read_text())
    assert doc["runs"] == 1 and doc["slo_ttft_p90_s"] == 60.0 and doc["pool_tokens"] == 24 * 16
    assert {"cpu_count", "loadavg_start", "loadavg_end", "torch_threads", "git_revision"} <= set(doc["machine"])
    ratio = doc["working_set_sweep"]["4x"]["working_set_over_pool"]
    n_points = sum(len(m["runs"][0]["points"]) for m in doc["modes"].values())
    assert doc["working_set_over_pool"] == ratio["median"] and ratio["points"] == n_points and ratio["median"] > 1
    for mode in ("no_cache", "radix", "daemon_cpu"):
        m = doc["modes"][mode]
        for k in KEYS:
            assert k in m, (mode, k)
        (r,) = m["runs"]
        assert r["first_round_errors"] == 0 and r["points"][0]["offered_qps"] == 2.0
        held = [p["offered_qps"] for p in r["points"] if p["passes"]]
        assert m["capacity_qps"] == r["knee_qps"] == max(held, default=0.0)
        for p in r["points"]:
            assert set(POINT_KEYS) <= set(p) and "_itl" not in p and p["duration_s"] == 4.0
    src = {mode: doc["modes"][mode]["tokens_by_source"] for mode in doc["modes"]}
    assert src["no_cache"]["radix"] == 0 and set(src["no_cache"]) == {"radix", "recomputed"}
    assert src["daemon_cpu"].get("cpu", 0) > 0  # the daemon supplied evicted conversations
    assert set(doc["targets"]) >= {"working_set_over_pool", "cpu_max_qps_vs_radix", "s3_ttft_p90_vs_radix"}
    assert not doc["targets"]["s3_ttft_p90_vs_radix"]["met"]  # no s3 mode in this run: never shown as met
    assert out.with_suffix(".png").stat().st_size > 1000
