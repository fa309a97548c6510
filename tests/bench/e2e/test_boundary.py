"""bench/e2e/boundary.py's figures: every case counts (no filter near the crossover), and the
biases are signed, so a model leaning to recompute and one leaning to load read differently."""

from __future__ import annotations

import pytest

from bench.e2e import figures as fig
from bench.e2e.boundary import GRID, figures


def _case(pred_load: float, pred_rec: float, load: float, rec: float, loaded: bool) -> dict:
    return {"predicted_load_ttft_s": pred_load, "predicted_recompute_s": pred_rec,
            "predicted_ratio": pred_load / pred_rec, "measured_load_ttft_s": load,
            "measured_recompute_ttft_s": rec, "measured_ratio": load / rec, "pages_loaded": 8 if loaded else 0}


def test_the_grid_spans_the_crossover_in_steps_of_005() -> None:
    assert GRID[0] == 0.7 and GRID[-1] == 1.3 and len(GRID) == 13
    assert all(abs(b - a - 0.05) < 1e-9 for a, b in zip(GRID, GRID[1:], strict=False))


def test_every_case_counts_and_the_bias_is_signed() -> None:
    cases = [_case(0.9, 1.0, 0.98, 1.0, True),  # right, 2% apart: a filtered accuracy would drop it
             _case(1.1, 1.0, 0.97, 1.0, False),  # wrong: recomputed, loading was 3% faster
             _case(0.5, 1.0, 0.6, 1.2, True),  # right
             _case(1.5, 1.0, 1.4, 1.0, False)]  # right
    f = figures(cases)
    assert f["cases_all"] == 4 and f["accuracy_all"] == 0.75
    assert f["regret_all"] == pytest.approx(0.03 / (0.98 + 0.97 + 0.6 + 1.0))
    lean_recompute = figures([_case(1.2, 1.0, 1.0, 1.0, False)])  # thinks loading slower than it is
    lean_load = figures([_case(0.8, 1.0, 1.0, 1.0, True)])
    assert lean_recompute["bias"] > 0 > lean_load["bias"]
    assert lean_recompute["bias_load"] == pytest.approx(0.2) and lean_recompute["bias_recompute"] == 0
    with pytest.raises(fig.FigureError):
        figures([])
