"""bench.e2e.figures on synthetic timings: each figure is the computation it claims, comes out
low / false where it should, and refuses inputs no figure can come from."""

from __future__ import annotations

import pytest

from bench.e2e import figures as fig

MB = 1_000_000


def test_repeated_median_needs_the_repetitions() -> None:
    assert fig.repeated_median([3.0, 1.0, 2.0]) == 2.0
    assert fig.repeated_median([9.0, 1.0, 2.0, 1.5, 30.0], 5) == 2.0  # an outlier moves it little
    with pytest.raises(fig.FigureError, match=">= 3 runs"):
        fig.repeated_median([1.0, 2.0])  # one or two samples are not a headline
    with pytest.raises(fig.FigureError):
        fig.repeated_median([1.0, 0.0, 2.0])


def test_load_over_floor_is_the_load_against_memcpy_alone() -> None:
    # 100 MB at 10 GB/s is a 10 ms floor; loads of 40-60 ms are 5x it, whatever the suffix costs
    assert fig.memcpy_floor_s(100 * MB, 10e9) == pytest.approx(0.01)
    assert fig.load_over_floor([0.06, 0.04, 0.05], 100 * MB, 10e9) == pytest.approx(5.0)
    assert fig.load_over_floor([0.0101, 0.0099, 0.01], 100 * MB, 10e9) == pytest.approx(1.0)
    with pytest.raises(fig.FigureError):
        fig.load_over_floor([0.05], 0, 10e9)
    with pytest.raises(fig.FigureError):
        fig.load_over_floor([], 100 * MB, 10e9)


def test_load_over_a_cold_copy_uses_the_median_copy_of_the_same_state() -> None:
    # copies of 100 MB timed at 20, 30 and 25 ms: 4 GB/s; a 20 ms load is then 0.8x that copy
    bw = fig.copy_bandwidth(100 * MB, [0.02, 0.03, 0.025])
    assert bw == pytest.approx(4e9)
    assert fig.load_over_floor([0.02], 100 * MB, bw) == pytest.approx(0.8)
    with pytest.raises(fig.FigureError):
        fig.copy_bandwidth(100 * MB, [])
    with pytest.raises(fig.FigureError):
        fig.copy_bandwidth(0, [0.02])


def test_old_ttft_floor_ratio_hides_a_slow_load() -> None:
    """Why it is secondary: with 1 s of suffix compute both sides pay, a load 5x its floor barely moves it."""
    slow_load = fig.ttft_floor_ratio(1.0 + 0.05, 100 * MB, 10e9, 1.0)
    assert slow_load == pytest.approx(1.05 / 1.01)
    assert slow_load < 1.05 and fig.load_over_floor([0.05], 100 * MB, 10e9) == pytest.approx(5.0)


def test_speedup_and_hit_rate() -> None:
    assert fig.speedup(12.0, 0.2) == pytest.approx(60.0)
    assert fig.speedup(1.0, 2.0) == 0.5  # slower than the baseline comes out below 1
    assert fig.hit_rate(1024, 2048) == 0.5 and fig.hit_rate(0, 2048) == 0.0
    with pytest.raises(fig.FigureError):
        fig.hit_rate(10, 0)
    with pytest.raises(fig.FigureError):
        fig.speedup(1.0, 0.0)


def test_bandwidth_for_puts_the_predicted_load_at_f_times_the_recompute() -> None:
    rec, suffix, lat, nbytes = 2.0, 0.1, 0.02, 40 * MB
    for f in (0.5, 0.8, 1.25, 2.0):
        bw = fig.bandwidth_for(f, rec, suffix, lat, nbytes)
        assert lat + nbytes / bw + suffix == pytest.approx(f * rec)
    assert fig.bandwidth_for(0.5, rec, suffix, lat, nbytes) > fig.bandwidth_for(2.0, rec, suffix, lat, nbytes)
    with pytest.raises(fig.FigureError, match="alone take longer"):
        fig.bandwidth_for(0.05, rec, suffix, lat, nbytes)  # 0.1 s of work is already more than 0.05 x 2 s


def test_throttle_for_composes_with_the_real_tier() -> None:
    thr = fig.throttle_for(50 * MB, 200 * MB)
    assert 1 / (1 / (200 * MB) + 1 / thr) == pytest.approx(50 * MB)
    assert thr == pytest.approx(200 * MB / 3)
    with pytest.raises(fig.FigureError, match="cannot be slowed"):
        fig.throttle_for(300 * MB, 200 * MB)  # a throttle only ever slows a tier down


def test_grid_verdict_judges_on_measured_times() -> None:
    right = fig.grid_verdict(True, 1.0, 2.0)
    assert right.correct and right.chosen_s == right.best_s == 1.0 and right.gap == pytest.approx(1.0)
    wrong = fig.grid_verdict(True, 2.0, 1.0)  # loaded when recomputing was twice as fast
    assert not wrong.correct and (wrong.chosen_s, wrong.best_s) == (2.0, 1.0)
    assert not fig.grid_verdict(False, 0.5, 1.0).correct


def test_accuracy_counts_only_decisive_cases() -> None:
    verdicts = [fig.grid_verdict(True, 1.0, 2.0), fig.grid_verdict(False, 1.0, 2.0),  # right, wrong
                fig.grid_verdict(True, 1.05, 1.0), fig.grid_verdict(False, 1.0, 1.05)]  # a coin toss: 5% apart
    acc, n = fig.accuracy(verdicts, 0.1)
    assert (acc, n) == (0.5, 2)
    assert fig.accuracy(verdicts, 0.0) == (0.25, 4)  # (the near-ties were both decided wrong)
    with pytest.raises(fig.FigureError):
        fig.accuracy(verdicts[2:], 0.1)  # nothing decisive: no accuracy to quote


def test_regret_is_time_lost_over_best_time() -> None:
    perfect = [fig.grid_verdict(True, 1.0, 2.0), fig.grid_verdict(False, 3.0, 1.0)]
    assert fig.regret(perfect) == 0.0
    # best 1 + 1 = 2 s; one wrong choice costs 2 - 1 = 1 s: regret 0.5
    assert fig.regret([fig.grid_verdict(False, 1.0, 2.0), fig.grid_verdict(False, 3.0, 1.0)]) == pytest.approx(0.5)
    # two wrong choices: (3 - 1) + (2.5 - 2) lost over 1 + 2 best
    assert fig.regret([fig.grid_verdict(True, 3.0, 1.0), fig.grid_verdict(False, 2.0, 2.5)]) == pytest.approx(2.5 / 3)
    with pytest.raises(fig.FigureError):
        fig.regret([])


def test_median_relative_error() -> None:
    assert fig.median_relative_error([1.0, 2.0, 3.0], [1.0, 2.0, 3.0]) == 0.0
    assert fig.median_relative_error([1.5, 1.0, 4.0], [1.0, 2.0, 2.0]) == pytest.approx(0.5)
    with pytest.raises(fig.FigureError):
        fig.median_relative_error([1.0], [1.0, 2.0])
    with pytest.raises(fig.FigureError):
        fig.median_relative_error([1.0], [0.0])


def test_percentile_interpolates_like_numpy() -> None:
    import numpy as np

    xs = [0.3, 0.1, 0.9, 0.4, 0.2]
    for q in (0, 50, 90, 100):
        assert fig.percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))
    assert fig.percentile([], 50) != fig.percentile([], 50)  # NaN for no samples
