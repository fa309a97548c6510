"""engine/cpu_gemm.py: the mm form is the same product as F.linear, used only for small steps and
only where start-up timing found it faster; a batch's row subset runs as the whole batch would."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine import cpu_gemm
from engine.config import EngineConfig
from engine.cpu_gemm import SMALL_ROWS, TIMED_ROWS, SmallRows, mm_form, plain, small_rows_upto
from engine.engine import LLMEngine
from engine.forward_batch import ForwardBatch
from engine.model import LlamaModel


@pytest.mark.parametrize("rows", [1, 2, 3, 8, 9])
def test_the_mm_form_is_f_linear(rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    w, b = torch.randn(48, 32, generator=g), torch.randn(48, generator=g)
    x = torch.randn(rows, 32, generator=g)
    wide = torch.randn(rows, 64, generator=g)[:, :32]  # the strided rows of a fused gate/up output
    for got, want in ((mm_form(x, w), F.linear(x, w)), (mm_form(x, w, b), F.linear(x, w, b)),
                      (mm_form(wide, w), F.linear(wide, w))):  # fmt: skip
        assert got.shape == want.shape and got.is_contiguous()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_small_rows_uses_the_mm_form_up_to_its_bound_and_the_rows_hint_decides(monkeypatch) -> None:
    calls: list[int] = []
    real = cpu_gemm.mm_form
    monkeypatch.setattr(cpu_gemm, "mm_form", lambda x, w, b=None: calls.append(x.shape[0]) or real(x, w, b))
    lin = SmallRows(4)
    w = torch.randn(16, 8)
    lin(torch.randn(4, 8), w)
    lin(torch.randn(5, 8), w)
    lin(torch.randn(2, 8), w, rows=20)  # a subset of a 20-row step: as the step
    lin(torch.randn(0, 8), w)
    assert calls == [4]


def _time_as(table: dict[tuple[str, int], float]):
    def fake(fn, xs, weights, reps):  # noqa: ANN001, ANN202
        rows = next(iter(xs.values())).shape[0]
        return table[("linear" if fn is F.linear else "mm", rows)]

    return fake


def test_the_mm_form_is_used_up_to_the_last_row_count_where_it_was_faster(monkeypatch) -> None:
    w = [torch.randn(16, 8)]
    fast = {(form, n): (0.5 if form == "mm" else 1.0) for form in ("mm", "linear") for n in TIMED_ROWS}
    monkeypatch.setattr(cpu_gemm, "_time", _time_as(fast))
    assert small_rows_upto(w) == SMALL_ROWS
    even_at_8 = {**fast, ("mm", SMALL_ROWS): 0.95}  # within the margin: F.linear from there on
    monkeypatch.setattr(cpu_gemm, "_time", _time_as(even_at_8))
    assert small_rows_upto(w) == 4
    slow_at_2 = {**fast, ("mm", 2): 1.2}  # slower at 2 rows: only 1 row, whatever 4 and 8 say
    monkeypatch.setattr(cpu_gemm, "_time", _time_as(slow_at_2))
    assert small_rows_upto(w) == 1
    slow_at_1 = {**fast, ("mm", 1): 1.0}
    monkeypatch.setattr(cpu_gemm, "_time", _time_as(slow_at_1))
    assert small_rows_upto(w) == 0


def test_an_engine_told_linear_uses_f_linear_and_bad_values_are_refused(tiny) -> None:
    assert LLMEngine(EngineConfig(num_pages=16, cpu_gemm="linear"), loaded=tiny).model.linear is plain
    with pytest.raises(ValueError, match="cpu_gemm"):
        EngineConfig(cpu_gemm="fast")


def test_the_last_layers_row_subset_takes_the_whole_steps_form(tiny, monkeypatch) -> None:
    """The last layer runs only the rows that need logits (padded to 8): those rows take the form of
    the whole step (30 rows: F.linear), as they did before the mm form existed, not the form of a
    step of 8 rows. Only the LM head, which always runs on just those rows, takes the mm form."""
    eng = LLMEngine(EngineConfig(num_pages=64, cpu_gemm="linear"), loaded=tiny)
    model: LlamaModel = eng.model
    model.linear = SmallRows(SMALL_ROWS)
    rows_seen: list[int] = []
    real = cpu_gemm.mm_form
    monkeypatch.setattr(cpu_gemm, "mm_form", lambda x, w, b=None: rows_seen.append(x.shape[0]) or real(x, w, b))
    seqs = [(list(range(3, 23)), 0, [0, 1]), (list(range(30, 40)), 0, [2])]  # a 30-row step
    step = ForwardBatch.build(seqs, 16, torch.device("cpu"), logits="last")
    assert step.logit_indices.tolist() == [19, 29]
    model.forward(step, eng.pool, eng.attn)
    assert rows_seen == [2]  # the LM head on the 2 rows that need logits


class _Cores:
    """A CoreLoad whose windows are busy (another process on most of 2 cores) or quiet, in order."""

    cpus = {0, 1}

    def __init__(self, busy: list[bool]) -> None:
        self.busy, self.now = list(busy), False

    def mark(self) -> None:
        self.now = self.busy.pop(0) if self.busy else False

    def others_share(self) -> float:
        return 0.8 if self.now else 0.0


def test_a_choice_timed_on_shared_cores_is_timed_again_once_they_are_quiet(monkeypatch) -> None:
    """Under contention the mm form's threads wait for each other and F.linear's one does not: a
    timing on shared cores would choose F.linear for the process's life."""
    from engine.core_load import QuietCores

    cores = _Cores([True])  # the first timing shares its cores; every look after is quiet
    now = [cores]  # the timing's answer follows the cores it ran on: F.linear (0) when they were shared
    monkeypatch.setattr(cpu_gemm, "small_rows_upto", lambda _w: 0 if now[0].now else SMALL_ROWS)
    slept: list[float] = []
    quiet = QuietCores(cores, 10.0, threads=2, sleep=slept.append)  # type: ignore[arg-type]
    assert cpu_gemm.chosen_upto([torch.zeros(4, 4)], quiet) == SMALL_ROWS
    assert quiet.contended == 1 and slept  # it waited, then timed again
    # cores that stay busy: the last timing stands once the budget is spent
    busy = now[0] = _Cores([True] * 10_000)
    quiet = QuietCores(busy, 2.0, threads=2, sleep=lambda s: None)  # type: ignore[arg-type]
    assert cpu_gemm.chosen_upto([torch.zeros(4, 4)], quiet) == 0 and quiet.left <= 0
    # without a reading of the cores: one timing, no wait
    calls: list[int] = []
    monkeypatch.setattr(cpu_gemm, "small_rows_upto", lambda _w: calls.append(1) or 4)
    assert cpu_gemm.chosen_upto([torch.zeros(4, 4)], QuietCores(None, 10.0, threads=2)) == 4 and calls == [1]


def test_the_wait_for_quiet_cores_is_configured_and_bounded(monkeypatch) -> None:
    with pytest.raises(ValueError, match="cpu_gemm_quiet_wait_s"):
        EngineConfig(cpu_gemm_quiet_wait_s=-1)
    monkeypatch.setenv("TIERKV_ENGINE_CPU_GEMM_QUIET_WAIT_S", "0")
    assert EngineConfig.from_env().cpu_gemm_quiet_wait_s == 0.0
    opened: list[int] = []
    monkeypatch.setattr(cpu_gemm.CoreLoad, "open", staticmethod(lambda: opened.append(1)))
    monkeypatch.setattr(cpu_gemm, "small_rows_upto", lambda _w: 2)
    cpu_gemm.for_weights(("quiet-wait-0",), [torch.zeros(4, 4)], quiet_wait_s=0)
    assert opened == []  # 0: the cores are not even read
