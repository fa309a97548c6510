"""The advisor against the real TieredStore, its recommendation, its cost figures and bad input;
bench/advise/run.py's figures as a pure function."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.advise.run import figures
from bench.advise.workloads import chat, replay
from kvstore.cli import main
from kvstore.ops.advise import CostFigures, advise
from kvstore.ops.mrc import lru_curve, references
from kvstore.ops.mrc_chain import chain_hits
from kvstore.ops.trace import TraceError, TraceRecorder, read_trace, write_trace
from kvstore.store.observers import OP_LOOKUP


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    """A multi-round chat traced on a cpu tier of a quarter of its working set over a disk tier."""
    w = chat(conversations=10, requests=50)
    path = tmp_path_factory.mktemp("trace") / "chat.kvtrace"
    replay(w, [w.working_set_bytes // 4, w.working_set_bytes // 2], trace_to=path)
    return path, w.working_set_bytes


def test_curves_agree_with_a_tiered_store_replay(traced: tuple[Path, int]) -> None:
    path, ws = traced
    w = chat(conversations=10, requests=50)
    trace = read_trace(path)
    refs = references(trace)
    curve = lru_curve(refs)
    for f in (0.2, 0.5, 0.9):
        cpu_only = replay(w, [int(ws * f)])
        assert abs(float(curve.hit_ratio(int(ws * f))) - cpu_only.hit_ratio()) <= 0.02
        chain = replay(w, [ws // 4, int(ws * f)])
        model = chain_hits(refs, [ws // 4, int(ws * f)])
        assert abs(model[0] - chain.hit_ratio(0)) <= 0.02 and abs(model.sum() - chain.hit_ratio()) <= 0.02
    # what the chain is not: one LRU of cpu + disk bytes (exclusive) misses the promoted duplicates
    assert abs(float(curve.hit_ratio(ws // 4 + ws // 2)) - replay(w, [ws // 4, ws // 2]).hit_ratio()) > 0.02


def test_recommended_size_delivers_the_promised_hit_rate(traced: tuple[Path, int]) -> None:
    path, ws = traced
    w = chat(conversations=10, requests=50)
    a = advise(read_trace(path), target=0.6)
    top, disk = a.tiers
    assert top.recommended_bytes is not None and top.hit_ratio_recommended >= 0.6
    assert abs(replay(w, [top.recommended_bytes]).hit_ratio() - top.hit_ratio_recommended) <= 0.02
    assert disk.recommended_bytes == 0 or disk.hit_ratio_recommended >= 0.6
    assert top.saved_s_per_1000_reads > 0  # the larger cpu tier saves prefill time
    sampled = advise(read_trace(path), target=0.6, exact_limit=100, max_samples=len(references(read_trace(path))) // 2)
    assert sampled.rate < 1 and sampled.sampling_error > 0
    assert abs(sampled.tiers[0].hit_ratio_now - top.hit_ratio_now) <= sampled.sampling_error


def test_saved_time_follows_the_cost_figures(tmp_path: Path) -> None:
    cost_file = tmp_path / "cost.json"
    cost_file.write_text(json.dumps({"prefill_s_per_token": 0.001, "kv_bytes_per_token": 1000,
                                     "tiers": {"disk": [0.001, 1e6]}}))  # fmt: skip
    c = CostFigures.load(cost_file)
    assert c.saved_s_per_page("disk", 10_000) == pytest.approx(10 * 0.001 - 0.01)  # loading costs what it saves
    assert c.saved_s_per_page("cpu", 10_000) == pytest.approx(0.01 - 10_000 / 2e9)  # defaults kept for the rest
    with pytest.raises(TraceError, match="bytes_per_s > 0"):
        CostFigures(tiers={"disk": (0.001, 0.0)})
    with pytest.raises(TraceError, match="must be > 0"):
        CostFigures(prefill_s_per_token=0)
    cost_file.write_text(json.dumps({"prefill_s_per_tok": 1}))
    with pytest.raises(TraceError, match="expected a JSON object with keys"):
        CostFigures.load(cost_file)


def test_bad_input_is_one_line(traced: tuple[Path, int], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path, _ = traced
    bad = tmp_path / "bad.kvtrace"
    bad.write_bytes(b"TKVTRACE")
    rec = TraceRecorder(4)
    rec(OP_LOOKUP, b"k", 0, None)
    write_trace(tmp_path / "idle.kvtrace", {"tiers": [{"name": "cpu", "capacity_bytes": 1 << 20}]}, rec.records())
    for argv in (["advise", str(bad)], ["advise", str(path), "--target-hit-rate", "1.5"],
                 ["advise", str(path), "--cost", str(tmp_path / "absent.json")],
                 ["advise", str(tmp_path / "idle.kvtrace")]):  # fmt: skip
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("kvstore: ") and err.count("\n") == 1, err
    assert main(["advise", str(path), "--target-hit-rate", "0.6"]) == 0
    out = capsys.readouterr().out
    assert "recommended" in out and "cpu" in out and "disk" in out


def test_bench_figures() -> None:
    traces = [
        {"points": [{"model": 0.5, "replay": 0.51, "exclusive": 0.7}, {"model": 0.2, "replay": 0.2}],
         "recommendations": [{"promised": 0.8, "replay": 0.79}]},
        {"points": [{"model": 0.9, "replay": 0.87, "inclusive": 0.6}], "recommendations": []},
    ]  # fmt: skip
    f = figures(traces)
    assert f["mrc_max_abs_error"] == 0.03 and f["traces"] == 2 and f["recommendation_hit_rate_error"] == 0.01
    assert f["naive_exclusive_max_abs_error"] == 0.19 and f["naive_inclusive_max_abs_error"] == 0.27
    assert figures([])["mrc_max_abs_error"] is None
