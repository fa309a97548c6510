"""bench.serve end to end on the tiny random Llama, sized down: real kvengine servers (radix only,
no cache, a cpu daemon, a redis daemon), the OpenAI client, every key of the JSON, the plot. (The real
benchmark, on SmolLM2, is `python -m bench.serve --quick`.)"""

from __future__ import annotations

import json
import shutil

import pytest

from bench import serve
from bench.serve import run
from bench.serve.workload import QASpec, RAGSpec
from engine.model_loader import hf_model_dir

pytestmark = pytest.mark.timeout(600)
KEYS = ("ttft_mean_s", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s", "max_qps_at_slo",
        "finished_per_s", "output_tokens_per_s", "tokens_by_source", "sweep", "server_metrics")


def test_bench_serve_on_tiny_model(tiny_model_dir, tmp_path, monkeypatch) -> None:
    small = run.Preset(QASpec(users=8, system_tokens=32, context_tokens=96, question_tokens=8, answer_tokens=4),
                         4, (4.0, 8.0), 60.0,
                         RAGSpec(docs=3, doc_tokens=32, question_tokens=8, answer_tokens=4, requests=2),
                         ("radix", "daemon_cpu"))
    monkeypatch.setattr(run, "QUICK", small)
    # The tiny model recomputes a page faster than any tier loads it, so the cost model would rightly
    # recompute (CI once saw 0 redis tokens): this smoke checks the plumbing, so every hit is loaded.
    monkeypatch.setenv("TIERKV_CONNECTOR_LOAD_MODE", "always")
    model = shutil.copytree(tiny_model_dir, tmp_path / "tiny")  # with SmolLM2's chat template: the API is chat
    shutil.copy(hf_model_dir("") / "chat_template.jinja", model / "chat_template.jinja")
    out = tmp_path / "serve.json"
    assert serve.main(["--out", str(out), "--quick", "--model", str(model),
                       "--modes", "no_cache,radix,daemon_cpu,daemon_redis"]) == 0
    doc = json.loads(out.read_text())
    assert doc["working_set_over_pool"] >= 4 and doc["slo_ttft_p90_s"] == 60.0
    assert {"cpu_count", "loadavg_start", "loadavg_end", "torch_threads", "git_revision"} <= set(doc["machine"])
    for mode in ("no_cache", "radix", "daemon_cpu", "daemon_redis"):
        m = doc["modes"][mode]
        for k in KEYS:
            assert k in m, (mode, k)
        assert m["errors"] == 0 and m["first_round_errors"] == 0
        assert [p["qps"] for p in m["sweep"]] == [4.0, 8.0] and m["max_qps_at_slo"] == 8.0
    src = {mode: doc["modes"][mode]["tokens_by_source"] for mode in doc["modes"]}
    assert src["no_cache"]["radix"] == 0 and set(src["no_cache"]) == {"radix", "recomputed"}
    assert src["daemon_cpu"].get("cpu", 0) > 0  # the daemon supplied evicted conversations
    assert src["daemon_redis"].get("redis", 0) > 0
    assert "rag" in doc["modes"]["daemon_cpu"] and "rag" not in doc["modes"]["no_cache"]
    assert set(doc["targets"]) >= {"working_set_over_pool", "cpu_ttft_mean_vs_radix", "s3_ttft_p90_vs_radix"}
    assert not doc["targets"]["s3_ttft_p90_vs_radix"]["met"]  # no s3 mode in this run: never shown as met
    assert out.with_suffix(".png").stat().st_size > 1000
