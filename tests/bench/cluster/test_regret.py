"""bench/cluster/regret.py: the regret arithmetic on fixed timings, the plan's and the forced engines'
guards, and one small real run (a writer node's engine, a reader node's three engines across the
bridge to S3) whose answers are checked against the writer's fresh prefill."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.cluster.node_engine import Completion
from bench.cluster.regret import Case, RegretError, RegretPlan, _checked, length_figures, link_figures
from bench.e2e.figures import FigureError
from tests.fixtures_servers import cluster_harness


def test_regret_is_the_mean_over_lengths_of_the_chosen_options_relative_loss() -> None:
    cases = [
        # 1 page: recompute (0.10) beats load (0.15); the model loaded once in two: (0.15-0.10)/0.10 / 2
        Case(1, [0.14, 0.15, 0.16], [0.10, 0.09, 0.11], [0.12, 0.1], [True, False]),
        # 8 pages: load (0.2) beats recompute (0.5) and the model always loaded: no regret
        Case(8, [0.2, 0.2, 0.3], [0.5, 0.4, 0.6], [0.21], [True]),
        # 16 pages: load (0.3) beats recompute (0.9); it recomputed: (0.9-0.3)/0.3
        Case(16, [0.3], [0.9], [0.95], [False]),
    ]
    out = link_figures(cases)
    per = {p["pages"]: p for p in out["by_pages"]}  # type: ignore[union-attr]
    assert per[1]["regret"] == pytest.approx(0.25) and per[1]["load_share"] == 0.5 and per[1]["best"] == "recompute"
    assert per[8]["regret"] == 0.0 and per[8]["load_ttft_s"] == 0.2 and per[8]["recompute_ttft_s"] == 0.5
    assert per[16]["regret"] == pytest.approx(2.0) and per[16]["correct"] == 0.0 and per[16]["auto_ttft_s"] == 0.95
    assert out["regret"] == pytest.approx((0.25 + 0 + 2.0) / 3)
    # time-weighted: (0.05 + 0 + 0 + 0.6) / (0.1 + 0.1 + 0.2 + 0.3)
    assert out["regret_time_weighted"] == pytest.approx(0.65 / 0.7)
    assert out["accuracy"] == pytest.approx(2 / 4)
    assert out["load_share_by_pages"] == {"1": 0.5, "8": 1.0, "16": 0.0}


def test_a_length_without_runs_has_no_figure() -> None:
    with pytest.raises(FigureError):
        length_figures(Case(4, [0.1], [], [0.1], [True]))
    with pytest.raises(FigureError):
        link_figures([])


@pytest.mark.parametrize("kw", [{"lengths": ()}, {"lengths": (0, 2)}, {"reps": 0}, {"question": 16},
                                {"question": 0}, {"links": ("rtt_1ms",)}, {"writer": 1, "reader": 1},
                                {"rate_mbit": 0}])
def test_a_plan_that_measures_nothing_sensible_is_refused(kw: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        RegretPlan(**kw)  # type: ignore[arg-type]


def _completion(*outcomes: tuple[str, str, int]) -> Completion:
    return Completion(0.1, "x", {"pages": {"page_size": 16, "outcomes": [
        {"reason": r, "tier": t, "pages": n} for r, t, n in outcomes]}})


def test_a_forced_engine_that_did_otherwise_stops_the_bench() -> None:
    assert _checked("always", 4, _completion(("loaded", "s3", 4), ("tail", "none", 1)))
    with pytest.raises(RegretError, match="loaded 2 of 4"):  # a load cut short is not a load's time
        _checked("always", 4, _completion(("loaded", "s3", 2), ("read_failed", "s3", 2), ("tail", "none", 1)))
    with pytest.raises(RegretError, match="not S3 alone"):  # served by the reader's own cpu tier
        _checked("always", 4, _completion(("loaded", "cpu", 4), ("tail", "none", 1)))
    with pytest.raises(RegretError, match="forced recompute loaded"):
        _checked("never", 4, _completion(("loaded", "s3", 1), ("bypassed", "s3", 3)))
    assert not _checked("never", 4, _completion(("bypassed", "s3", 4), ("tail", "none", 1)))
    assert _checked("auto", 4, _completion(("read_failed", "s3", 4)))  # it chose to load
    assert not _checked("auto", 4, _completion(("bypassed", "s3", 4)))


@pytest.mark.timeout(600)
def test_one_link_two_lengths_answers_right_and_decides(tmp_path: Path) -> None:
    from bench.cluster.regret import measure_regret

    with cluster_harness(tmp_path, nodes=2) as h:
        out = measure_regret(h, RegretPlan(lengths=(1, 8), reps=1, learn=1, links=("none",)))
    reg = out["regret"]
    link = reg["links"]["none"]  # type: ignore[index]
    assert reg["wrong_outputs"] == 0, link  # type: ignore[index]  # load and recompute: the writer's greedy text
    assert link["reads"] == 3 * (1 + 2)
    assert set(out["regret_by_link"]) == {"none"} and out["regret_by_link"]["none"] >= 0  # type: ignore[index,operator]
    assert set(out["decisions_by_link"]["none"]) == {"1", "8"}  # type: ignore[index]
    for p in link["by_pages"]:
        assert p["load_ttft_s"] > 0 and p["recompute_ttft_s"] > 0 and len(p["runs"]["auto_loaded"]) == 1


def test_the_cli_refuses_to_skip_the_regret_part_and_run_only_it() -> None:
    from bench.cluster.__main__ import main

    with pytest.raises(SystemExit):
        main(["--no-regret", "--regret-only"])
