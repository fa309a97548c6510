"""bench.serve's knee: the pass rule (completed/s within 90% of what was sent, TTFT p90 within the
SLO) and the grid walk then bisection on synthetic monotone pass functions."""

from __future__ import annotations

import math

import pytest

from bench.serve.knee import find_knee, passes


def _pt(sent: float, done: float, p90: float) -> dict:
    return {"sent_per_s": sent, "completed_per_s": done, "ttft_p90_s": p90}


def test_a_point_passes_only_when_it_completes_what_it_is_offered_within_the_slo() -> None:
    assert passes(_pt(2.0, 1.85, 1.0), 3.0)
    assert not passes(_pt(4.0, 1.94, 1.0), 3.0)  # the old figure's "holds 4 req/s" while completing 1.94/s
    assert passes(_pt(2.0, 1.8, 3.0), 3.0) and not passes(_pt(2.0, 1.79, 1.0), 3.0)  # 90% exactly holds
    assert not passes(_pt(1.0, 1.0, 3.01), 3.0)
    assert not passes(_pt(1.0, math.nan, 1.0), 3.0) and not passes(_pt(1.0, 1.0, math.nan), 3.0)
    assert not passes(_pt(0.0, 0.0, 1.0), 3.0)  # nothing sent proves nothing


def test_one_answer_that_crossed_the_window_end_is_not_falling_behind() -> None:
    """8 sent in 60 s, 7 finished inside the window: 0.875 < 90%, but a count is whole requests."""
    low = {**_pt(8 / 60, 7 / 60, 1.5), "duration_s": 60.0}
    assert passes(low, 3.0) and not passes({**low, "duration_s": None}, 3.0)
    assert not passes({**low, "completed_per_s": 6 / 60}, 3.0)  # two short: 75%, falling behind
    busy = {**_pt(60 / 60, 52 / 60, 1.5), "duration_s": 60.0}  # 52 of 60: one request of slack is not 8
    assert not passes(busy, 3.0) and passes({**busy, "completed_per_s": 53 / 60}, 3.0)


def _synthetic(true_knee: float):
    calls: list[tuple[float, str]] = []

    def measure(q: float, phase: str) -> bool:
        calls.append((q, phase))
        return q <= true_knee

    return measure, calls


@pytest.mark.parametrize("true_knee", [0.6, 0.99, 1.3, 1.77, 2.5, 3.9])
def test_bisection_finds_the_knee_between_grid_points(true_knee: float) -> None:
    measure, calls = _synthetic(true_knee)
    k = find_knee(measure, (0.5, 1, 2, 4), bisect_steps=6)
    assert k.lo <= true_knee < k.hi and k.qps == k.lo
    assert k.hi - k.lo <= 2 / 2**6 + 1e-9  # the grid's bracket halved six times
    assert k.qps == pytest.approx(true_knee, abs=2 / 2**6)
    assert not k.capped and [p for _, p in calls].count("grid") <= 4
    assert k.qps not in (0.5, 1, 2, 4) or true_knee in (0.5, 1, 2, 4)  # not a grid point: searched


def test_the_walk_stops_at_the_first_failing_grid_point() -> None:
    measure, calls = _synthetic(1.3)
    k = find_knee(measure, (0.5, 1, 2, 4), bisect_steps=2)
    assert [q for q, p in calls if p == "grid"] == [0.5, 1, 2]  # 4 never run
    assert [q for q, p in calls if p == "bisect"] == [1.5, 1.25]
    assert (k.qps, k.lo, k.hi) == (1.25, 1.25, 1.5)


def test_nothing_passing_and_everything_passing() -> None:
    measure, _ = _synthetic(0.1)
    k = find_knee(measure, (0.5, 1), bisect_steps=2)
    assert k.lo <= 0.1 < k.hi and k.qps == 0.0 and not k.capped  # 0.25 and 0.125 fail: nothing held
    measure, _ = _synthetic(10)
    k = find_knee(measure, (0.5, 1), bisect_steps=2)
    assert k.capped and k.qps == 1 and math.isinf(k.hi)  # at least the grid's top
    with pytest.raises(ValueError):
        find_knee(measure, (2, 1), 1)
