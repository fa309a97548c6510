"""bench.serve's schedule: seeded Poisson arrivals at the asked rate, the modes' order rotated per run."""

from __future__ import annotations

import numpy as np
import pytest

from bench.serve.schedule import poisson_count, poisson_offsets, rotated


def test_poisson_offsets_are_seeded_and_inside_the_window() -> None:
    a = poisson_offsets(2.0, 60.0, seed=5)
    assert a == poisson_offsets(2.0, 60.0, seed=5)  # the same sends in every mode of a run
    assert a != poisson_offsets(2.0, 60.0, seed=6)
    assert a == sorted(a) and 0 < a[0] and a[-1] < 60.0


def test_a_window_sends_exactly_its_rate_with_poisson_gaps() -> None:
    """Each span holds round(qps x span) sends: a 60 s window at 0.5 req/s left to chance sent
    0.38-0.58/s; given the count the times are uniform, so the gaps are still ~exponential."""
    for s in range(50):
        a = poisson_offsets(0.5, 60.0, seed=s, warmup_s=10.0)
        assert sum(t < 10.0 for t in a) == 5 and sum(10.0 <= t < 70.0 for t in a) == 30 and a == sorted(a)
    gaps = np.diff(poisson_offsets(4.0, 2000.0, seed=1))
    assert np.mean(gaps) == pytest.approx(0.25, rel=0.05) and np.std(gaps) == pytest.approx(0.25, rel=0.1)
    lengths = [len(poisson_offsets(0.125, 60.0, seed=s)) for s in range(5)]  # 7.5 sends: rounded, never 0
    assert lengths == [8] * 5


def test_poisson_count_starts_at_zero_with_n_sends() -> None:
    a = poisson_count(0.4, 64, seed=3)
    assert len(a) == 64 and a[0] == 0.0 and a == sorted(a) and a == poisson_count(0.4, 64, seed=3)
    assert np.mean([poisson_count(0.4, 401, seed=s)[-1] for s in range(50)]) == pytest.approx(1000, rel=0.05)
    with pytest.raises(ValueError):
        poisson_offsets(0, 10, 1)


def test_rotation_puts_every_mode_in_every_position() -> None:
    modes = ["radix", "daemon_cpu", "daemon_s3"]
    orders = [rotated(modes, r) for r in range(3)]
    assert orders[0] == modes and orders[1] == ["daemon_cpu", "daemon_s3", "radix"]
    for pos in range(3):
        assert {o[pos] for o in orders} == set(modes)
    for o in orders:  # no mode always follows the same one
        assert sorted(o) == sorted(modes)
    assert rotated(modes, 3) == modes and rotated([], 2) == []
