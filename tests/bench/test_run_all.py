"""make bench's summary: how a figure is read and judged (pure functions, synthetic inputs)."""

from __future__ import annotations

import pytest

from bench.run_all import BENCHES, Figure, lookup, main, summary_markdown, verdict


def test_lookup_walks_dotted_paths_and_reports_missing() -> None:
    doc = {"tiers": {"cpu": {"ratio": 0.93}}, "flag": False}
    assert lookup(doc, "tiers.cpu.ratio") == 0.93
    assert lookup(doc, "flag") is False
    assert lookup(doc, "tiers.disk.ratio") is None
    assert lookup(doc, "tiers.cpu.ratio.deeper") is None


@pytest.mark.parametrize("value,fig,want", [
    (0.91, Figure("x", 0.9), "met"),
    (0.89, Figure("x", 0.9), "MISSED"),
    (2.1, Figure("x", 2.0, "<="), "MISSED"),
    (1.9, Figure("x", 2.0, "<="), "met"),
    (True, Figure("x", True, "=="), "met"),
    (False, Figure("x", True, "=="), "MISSED"),
    (1, Figure("x", True, "=="), "MISSED"),  # a number where a boolean is due is not a pass
    (True, Figure("x", 0.5), "MISSED"),  # nor a boolean where a number is due
    (None, Figure("x", 0.9), "missing"),  # never shown as met
    (0.15, Figure("x", None), "reported"),
])
def test_verdict(value: object, fig: Figure, want: str) -> None:
    assert verdict(value, fig) == want


def test_summary_lists_every_figure_with_its_verdict() -> None:
    machine = {"cores": 2, "loadavg": [1.5, 1.0, 0.5], "git_revision": "abcdef1234567", "git_dirty": True}
    figs = [0.95, 0.87, 0.5, None, 0.9, 0.75, 4.0, 1.6, 0.3]
    run = {"returncode": 0, "wall_s": 42.0, "machine_before": machine,
           "machine_after": {**machine, "loadavg": [2.5, 1, 1]}, "figures": figs}
    md = summary_markdown({"tiers": run})
    assert "load average 1.5 before / 2.5 after" in md and "(dirty)" in md
    rows = [ln for ln in md.splitlines() if ln.startswith("| tiers |")]
    assert len(rows) == len(BENCHES["tiers"])
    assert [r.split(" | ")[5] for r in rows[:4]] == ["met", "reported", "MISSED", "missing"]
    assert all(r.endswith("| 1.5 → 2.5 |") and " | — | " in r for r in rows)  # measured once: no spread


def test_spread_over_runs_is_read_beside_the_headline() -> None:
    """A headline a bench repeated: its runs' values beside it give min–max in the one table; a
    single value, a list of non-numbers or nothing gives no spread (never an invented one)."""
    from bench.run_all import spread_of

    doc = {"modes": {"cpu": {"capacity_qps": 1.5, "capacity_qps_runs": [1.25, 1.5, 2.0]}},
           "targets": {"w": {"value": 1.1, "runs": [1.0, 1.2]}}, "x": 3, "x_runs": ["a"]}
    assert spread_of(doc, "modes.cpu.capacity_qps") == [1.25, 2.0, 3]
    assert spread_of(doc, "targets.w.value") == [1.0, 1.2, 2]
    assert spread_of(doc, "x") is None and spread_of(doc, "nope") is None
    machine = {"cores": 2, "loadavg": [0.5], "git_revision": "0" * 40, "git_dirty": False}
    run = {"returncode": 0, "wall_s": 1.0, "machine_before": machine, "machine_after": machine,
           "figures": [1.5], "spreads": [spread_of(doc, "modes.cpu.capacity_qps")]}
    assert "| 1.5 | 1.25–2 (3 runs) |" in summary_markdown({"tiers": run})


def test_unknown_bench_is_refused() -> None:
    with pytest.raises(SystemExit):
        main(["--only", "nope"])


def test_an_only_run_replaces_its_sections_and_keeps_the_others(tmp_path) -> None:
    import json

    from bench.run_all import merged

    prev = tmp_path / "run_all.json"
    old = {"tiers": {"figures": [1], "returncode": 0}, "vllm": {"figures": [2], "returncode": 1}}
    prev.write_text(json.dumps(old))
    got = merged(prev, {"vllm": {"figures": [3], "returncode": 0}, "engine": {"figures": [4], "returncode": 0}})
    assert list(got) == ["engine", "tiers", "vllm"]  # BENCHES order
    assert got["vllm"]["figures"] == [3] and got["tiers"] == old["tiers"]
    prev.write_text("not json")
    assert merged(prev, {"tiers": {"figures": [5]}}) == {"tiers": {"figures": [5]}}


def test_kept_sections_are_read_again_under_todays_figures(tmp_path) -> None:
    """A bench whose figure list changed since its last run: its figures are looked up again in its
    JSON (not zipped against the new list, which crashed the summary), else shown as missing."""
    import json

    from bench.run_all import BENCHES, merged, summary_markdown

    machine = {"cores": 2, "loadavg": [0.0], "git_revision": "0" * 40, "git_dirty": False}
    run = {"figures": [1], "returncode": 0, "wall_s": 1.0, "machine_before": machine, "machine_after": machine}
    (tmp_path / "run_all.json").write_text(json.dumps({"soak": run, "e2e": run}))
    first = BENCHES["soak"][0].path
    doc: dict = {}
    node = doc
    *parents, leaf = first.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = 42
    (tmp_path / "soak_quick.json").write_text(json.dumps(doc))
    got = merged(tmp_path / "run_all.json", {})
    assert got["soak"]["figures"][0] == 42 and len(got["soak"]["figures"]) == len(BENCHES["soak"])
    assert got["e2e"]["figures"] == [1]  # no JSON: as recorded
    text = summary_markdown(got)
    assert "| 42 |" in text and text.count("missing") >= len(BENCHES["e2e"]) - 1


def test_a_bench_run_by_hand_is_shown_with_its_own_load(tmp_path) -> None:
    """A bench's JSON that records its load and revision wins over the older run_all record's."""
    import json

    from bench.run_all import merged

    machine = {"cores": 2, "loadavg": [0.1], "git_revision": "a" * 40, "git_dirty": False}
    run = {"figures": [], "returncode": 0, "wall_s": 1.0, "machine_before": machine, "machine_after": machine}
    (tmp_path / "run_all.json").write_text(json.dumps({"soak": run, "e2e": run}))
    (tmp_path / "soak_quick.json").write_text(json.dumps(
        {"machine": {"loadavg_before": [5.9, 5, 5], "loadavg_after": [8.7, 8, 8], "git_revision": "b" * 40},
         "wall_s": 2084.0}))
    (tmp_path / "e2e_quick.json").write_text(json.dumps({"machine": {"cores": 2}}))  # no load recorded: as on record
    got = merged(tmp_path / "run_all.json", {})
    assert got["soak"]["machine_before"]["loadavg"][0] == 5.9 and got["soak"]["machine_after"]["loadavg"][0] == 8.7
    assert got["soak"]["machine_before"]["git_revision"] == got["soak"]["machine_after"]["git_revision"] == "b" * 40
    assert got["soak"]["wall_s"] == 2084.0  # its own length, not the older run_all's 1 s
    assert got["e2e"]["machine_before"]["loadavg"] == [0.1] and got["e2e"]["wall_s"] == 1.0
    assert "5.9 → 8.7" in summary_markdown(got)


def test_every_cluster_figure_is_in_its_committed_quick_result() -> None:
    """A renamed field in bench.cluster's JSON would show as 'missing' in make bench's table: the
    committed quick result must hold every figure the cluster entry names."""
    import json
    from pathlib import Path

    doc = json.loads((Path(__file__).resolve().parents[2] / "bench/results/cluster_quick.json").read_text())
    assert [f.path for f in BENCHES["cluster"] if lookup(doc, f.path) is None] == []
