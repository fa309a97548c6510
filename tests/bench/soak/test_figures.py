"""The soak's figures (bench/soak/figures.py) and targets (bench/run_all.py) on made-up records:
growth is per process identity after warm-up, and every target can fail."""

from __future__ import annotations

import pytest

from bench.run_all import BENCHES, all_met, lookup, verdict
from bench.soak.figures import (
    MIB,
    check_answers,
    cross_tenant_hits,
    during_outages,
    growth,
    memory_figures,
    shm_rounds,
)
from bench.soak.load import Answer
from bench.soak.watch import Sample


def _s(t: float, anon_mb: float, role: str = "daemon", pid: int = 10, start: int = 1, fds: int = 20,
       shm: dict[int, int] | None = None) -> Sample:  # fmt: skip
    return Sample(t, role, pid, start, int(anon_mb * MIB), int(anon_mb * MIB), 0, 0, fds, 8, shm or {})


def _flat(role: str, pid: int, start: int, t0: float, t1: float, anon_mb: float, **kw: object) -> list[Sample]:
    return [_s(float(t), anon_mb, role, pid, start, **kw) for t in range(int(t0), int(t1), 2)]  # type: ignore[arg-type]


def test_a_restarted_daemon_is_compared_with_itself_only() -> None:
    """Two daemon incarnations, each flat: no growth — though the role's first and last samples
    differ by 300 MiB (the mistake of comparing across a restart, in either direction)."""
    samples = _flat("daemon", 10, 1, 0, 60, 400.0) + _flat("daemon", 11, 5, 60, 120, 100.0)
    measured, short = growth(samples, lambda s: s.anon / MIB, warm_at=10, warm_s=10)
    assert short == []
    assert {g.identity: g.growth for g in measured} == {"daemon/10/1": 0.0, "daemon/11/5": 0.0}
    figs = memory_figures(samples, 10, 10)
    assert figs["rss_growth_mb"] == 0.0
    assert figs["naive"]["by_role_rss_mb"] == {"daemon": -300.0}  # what a per-role figure would say


def test_a_reused_pid_is_another_process() -> None:
    samples = _flat("daemon", 10, 1, 0, 40, 50.0) + _flat("daemon", 10, 9, 40, 80, 300.0)
    measured, _ = growth(samples, lambda s: s.anon / MIB, warm_at=0, warm_s=0)
    assert len(measured) == 2 and all(g.growth == 0 for g in measured)


def test_growth_after_warm_up_is_found_and_before_it_ignored() -> None:
    ramp = [_s(float(t), 100 + 10 * t) for t in range(0, 10)]  # warm-up: +90 MiB, not counted
    leak = [_s(float(t), 200 + 2 * (t - 10)) for t in range(10, 60)]  # +2 MiB/s after it
    figs = memory_figures(ramp + leak, warm_at=10, warm_s=0)
    assert figs["rss_growth_mb"] == pytest.approx(80, abs=1)  # a steady leak of 98 MB shows at 4/5 of it
    assert figs["growth_by_process"]["daemon/10/1"]["rss_anon_mb"] == [209.0, 289.0]  # medians of the fifths


def test_swings_at_the_ends_of_a_flat_heap_are_not_growth() -> None:
    """The replicas' heaps swing by ~10-25 MB (allocator, batch sizes): three low samples right
    after warm-up and three high ones at the end are no trend."""
    values = [655.0] * 3 + [670.0] * 34 + [685.0] * 3
    samples = [_s(float(t), v, role="replica-b") for t, v in enumerate(values)]
    assert memory_figures(samples, warm_at=0, warm_s=0)["rss_growth_mb"] == 0.0


def test_a_spike_at_an_end_does_not_count_but_too_short_a_life_is_not_measured() -> None:
    samples = _flat("replica-a", 3, 1, 0, 40, 500.0)
    samples[-1] = samples[-1]._replace(anon=900 * MIB)  # one spike in the last window
    samples += _flat("daemon", 12, 7, 30, 36, 80.0)  # killed 6 s after it started
    figs = memory_figures(samples, warm_at=0, warm_s=2)
    assert figs["rss_growth_mb"] == 0.0
    assert figs["not_measured"] == ["daemon/12/7"]


def test_fd_growth_and_shm_counted_once_per_segment() -> None:
    a = _flat("replica-a", 3, 1, 0, 40, 10.0, fds=30, shm={7: 64 * MIB})
    d = _flat("daemon", 4, 1, 0, 40, 10.0, fds=40, shm={7: 64 * MIB})  # the same segment, both sides
    d[-3:] = [s._replace(fds=50) for s in d[-3:]]
    assert shm_rounds(a + d)[0] == (0.0, 64 * MIB)
    figs = memory_figures(a + d, warm_at=0, warm_s=0)
    assert figs["fd_growth"] == 10 and figs["shm_growth_mb"] == 0.0
    leak = a + [s._replace(shm={7: 64 * MIB, 8 + i: 64 * MIB}) if s.t > 30 else s for i, s in enumerate(d)]
    assert memory_figures(leak, warm_at=0, warm_s=0)["shm_growth_mb"] == 64.0


def test_answers_against_the_reference() -> None:
    ref = {"p1": "Paris.", "p2": "Lyon."}
    answers = [Answer("p1", "t", "a", text="Paris."), Answer("p2", "t", "b", text="Paris."),
               Answer("p1", "t", "a", error="APIConnectionError: boom"), Answer("p9", "t", "a", text="x")]  # fmt: skip
    c = check_answers(answers, ref)
    assert (c.requests, c.wrong_outputs, c.client_errors) == (4, 1, 2)
    assert "Lyon." in c.wrong[0] and "no reference" in c.errors[1]


def test_the_share_of_checked_answers_whose_prefix_the_daemon_loaded() -> None:
    """Only answers checked against a reference count, and only a daemon source loads: radix hits and
    blend reuse do not, and an errored answer is in neither side of the share."""
    ref = {"p1": "Paris."}
    answers = [Answer("p1", "t", "a", text="Paris.", sources={"radix": 0, "daemon": 64}),
               Answer("p1", "t", "a", text="Paris.", sources={"radix": 128, "daemon": 0}),
               Answer("p1", "t", "b", text="Lyon.", sources={"daemon": 16}),  # wrong, but still loaded
               Answer("p1", "t", "b", text="Paris.", sources={"blend_reused": 32}),
               Answer("p1", "t", "a", error="boom", sources={"daemon": 64})]  # fmt: skip
    c = check_answers(answers, ref)
    assert (c.daemon_loaded, c.daemon_loaded_share, c.wrong_outputs) == (2, 0.5, 1)
    assert check_answers([], ref).daemon_loaded_share is None


def test_cross_tenant_hits_count_only_answers_with_cached_tokens() -> None:
    probes = [Answer("x", "b", "a", cached=0), Answer("x", "c", "a", cached=16), Answer("x", "c", "a", error="e")]
    assert cross_tenant_hits(probes) == 1


def test_answers_in_flight_during_an_outage() -> None:
    faults = [{"target": "daemon", "killed_at": 10.0, "back_at": 15.0}, {"target": "redis", "killed_at": 30.0},
              {"target": "daemon", "killed_at": 50.0, "back_at": 55.0}]  # fmt: skip
    answers = [Answer("p", "t", "a", t0=8, t1=11), Answer("p", "t", "a", t0=15, t1=20), Answer("p", "t", "a", t0=51, t1=52),
               Answer("p", "t", "a", t0=40, t1=41)]  # fmt: skip
    assert during_outages(answers, faults) == 2
    assert during_outages(answers, faults, "redis") == 2  # never came back: down to the end


GOOD = {"requests": 300, "wrong_outputs": 0, "client_errors": 0, "checked_prompts": 64, "tokens_per_answer": 32,
        "daemon_loaded_share": 0.62, "faults_injected": 6, "fuzz_cases": 10_000,
        "fuzz_crashes": 0, "unauthenticated_accepted": 0, "cross_tenant_hits": 0, "rss_growth_mb": 12.0,
        "fd_growth": 2, "shm_growth_mb": 0.0, "cross_tenant_reads": 0, "cross_tenant_attempts": 120,
        "forged_blocks_served": 0, "forged_probes_exercised": 4, "shm_reclaim_s": 0.1,
        "dos": {p: {"itl_p99_ratio": 1.1, "health_max_s": 0.05, "rss_growth_mb": 2.0, "lookup_deadline_met": True}
                for p in ("stop_strings", "prompt_16mib", "salts", "stalled_puts", "watch_names")}}  # fmt: skip
BAD = {"wrong_outputs": 1, "client_errors": 1, "checked_prompts": 16, "tokens_per_answer": 10,
       "daemon_loaded_share": 0.4, "faults_injected": 5, "fuzz_cases": 9_999, "fuzz_crashes": 1,
       "unauthenticated_accepted": 1, "cross_tenant_hits": 1, "rss_growth_mb": 50.5, "fd_growth": 6,
       "shm_growth_mb": 64.0, "cross_tenant_reads": 1, "forged_blocks_served": 2, "shm_reclaim_s": 31.0,
       "dos.stop_strings.itl_p99_ratio": 1.51, "dos.prompt_16mib.health_max_s": 1.0,
       "dos.salts.rss_growth_mb": 20.5, "dos.stalled_puts.lookup_deadline_met": False}  # fmt: skip


def test_every_target_is_met_by_a_good_run_and_missed_by_a_bad_value() -> None:
    figs = BENCHES["soak"]
    assert {f.path: verdict(lookup(GOOD, f.path), f) for f in figs} == {f.path: "reported" if f.target is None
                                                                        else "met" for f in figs}  # fmt: skip
    for name, bad in BAD.items():
        fig = next(f for f in figs if f.path == name)
        assert verdict(bad, fig) == "MISSED", name
    assert verdict(None, figs[1]) == "missing"  # a figure the run did not produce is never met


def test_a_good_run_passes_and_one_missed_or_missing_figure_fails_it() -> None:
    """The soak's exit code: the 'reported' request count is no failure (a good run exited 1 before
    all_met), but any MISSED or missing figure is."""
    figs = BENCHES["soak"]
    good = [verdict(lookup(GOOD, f.path), f) for f in figs]
    assert "reported" in good and all_met(good)
    for name, bad in BAD.items():
        assert not all_met([verdict(bad if f.path == name else lookup(GOOD, f.path), f) for f in figs]), name
    assert not all_met([verdict(None if f.path == "fuzz_crashes" else lookup(GOOD, f.path), f) for f in figs])
