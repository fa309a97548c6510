"""engine/cpu_gemm.py: the mm and native forms are the same product as F.linear, used only for small
steps and only where start-up timing found them faster; a batch's row subset runs as the whole batch
would."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine import cpu_gemm
from engine.config import EngineConfig
from engine.cpu_gemm import MM_ROWS, SMALL_ROWS, TIMED_ROWS, SmallRows, mm_form, plain, small_rows_plan
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


def _recording(name: str, calls: list[tuple[str, int]]):
    def form(x, w, b=None):  # noqa: ANN001, ANN202
        calls.append((name, x.shape[0]))
        return mm_form(x, w, b)

    return form


def test_small_rows_takes_each_steps_form_from_the_plan_and_the_rows_hint_decides() -> None:
    calls: list[tuple[str, int]] = []
    forms = {"mm": _recording("mm", calls), "native": _recording("native", calls)}
    lin = SmallRows(((2, "mm"), (16, "native")), forms)
    w = torch.randn(16, 8)
    for rows in (1, 2, 3, 16, 17):
        lin(torch.randn(rows, 8), w)
    lin(torch.randn(2, 8), w, rows=20)  # a subset of a 20-row step: as the step (F.linear)
    lin(torch.randn(2, 8), w, rows=5)  # ... of a 5-row step: native
    lin(torch.randn(0, 8), w)
    assert calls == [("mm", 1), ("mm", 2), ("native", 3), ("native", 16), ("native", 2)]


def _time_as(table: dict[tuple[str, int], float]):
    def fake(fn, xs, weights, reps):  # noqa: ANN001, ANN202
        rows = next(iter(xs.values())).shape[0]
        return table[("linear" if fn is F.linear else fn.__name__, rows)]

    return fake


def _form(name: str):
    def f(x, w, b=None):  # noqa: ANN001, ANN202
        return F.linear(x, w, b)

    f.__name__ = name
    return f


def test_the_plan_takes_the_fastest_form_at_each_row_count_up_to_where_none_beats_f_linear(monkeypatch) -> None:
    w = [torch.randn(16, 8)]
    cands = {"mm": _form("mm"), "native": _form("native")}
    table = {(form, n): t for n in TIMED_ROWS for form, t in (("linear", 1.0), ("mm", 0.5), ("native", 0.6))}
    monkeypatch.setattr(cpu_gemm, "_time", _time_as(table))
    # mm is fastest where it is timed (up to MM_ROWS rows), native past it
    assert small_rows_plan(w, cands) == ((MM_ROWS, "mm"), (SMALL_ROWS, "native"))
    faster = {**table, ("native", 2): 0.4}  # native fastest at 2 rows only: three entries, in order
    monkeypatch.setattr(cpu_gemm, "_time", _time_as(faster))
    assert small_rows_plan(w, cands) == ((1, "mm"), (2, "native"), (MM_ROWS, "mm"), (SMALL_ROWS, "native"))
    even = {**table, ("native", 16): 0.95}  # within the margin at 16: F.linear from there on
    monkeypatch.setattr(cpu_gemm, "_time", _time_as(even))
    assert small_rows_plan(w, cands) == ((MM_ROWS, "mm"),)
    slow_at_2 = {**table, ("mm", 2): 1.2, ("native", 2): 1.2}  # none faster at 2: 1 row only, whatever 4+ say
    monkeypatch.setattr(cpu_gemm, "_time", _time_as(slow_at_2))
    assert small_rows_plan(w, cands) == ((1, "mm"),)
    slow_at_1 = {**table, ("mm", 1): 1.0, ("native", 1): 1.0}
    monkeypatch.setattr(cpu_gemm, "_time", _time_as(slow_at_1))
    assert small_rows_plan(w, cands) == ()
    # without the native form (its library not built): the mm form alone, as before it existed
    monkeypatch.setattr(cpu_gemm, "_time", _time_as(table))
    assert small_rows_plan(w, {"mm": cands["mm"]}) == ((MM_ROWS, "mm"),)


def test_the_plan_is_described_in_the_log_line() -> None:
    assert cpu_gemm.describe(()) == "F.linear"
    assert cpu_gemm.describe(((2, "mm"), (32, "native"))) == "mm form for 1-2 rows, native for 3-32 rows, F.linear past 32"
    assert cpu_gemm.describe(((1, "native"),)) == "native for 1 row, F.linear past 1"


def test_an_engine_on_the_cpu_offers_the_native_form_where_its_library_loads() -> None:
    from engine import native_gemm

    lib, why = native_gemm.load()
    assert ("native" in cpu_gemm.forms(2)) == (lib is not None), why


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
    calls: list[tuple[str, int]] = []
    model.linear = SmallRows(((8, "mm"),), {"mm": _recording("mm", calls)})
    seqs = [(list(range(3, 23)), 0, [0, 1]), (list(range(30, 40)), 0, [2])]  # a 30-row step
    step = ForwardBatch.build(seqs, 16, torch.device("cpu"), logits="last")
    assert step.logit_indices.tolist() == [19, 29]
    model.forward(step, eng.pool, eng.attn)
    assert calls == [("mm", 2)]  # the LM head on the 2 rows that need logits


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
    good: cpu_gemm.Plan = ((SMALL_ROWS, "mm"),)
    monkeypatch.setattr(cpu_gemm, "small_rows_plan", lambda _w, _c: () if now[0].now else good)
    slept: list[float] = []
    quiet = QuietCores(cores, 10.0, threads=2, sleep=slept.append)  # type: ignore[arg-type]
    assert cpu_gemm.chosen_plan([torch.zeros(4, 4)], {}, quiet) == good
    assert quiet.contended == 1 and slept  # it waited, then timed again
    # cores that stay busy: the last timing stands once the budget is spent
    busy = now[0] = _Cores([True] * 10_000)
    quiet = QuietCores(busy, 2.0, threads=2, sleep=lambda s: None)  # type: ignore[arg-type]
    assert cpu_gemm.chosen_plan([torch.zeros(4, 4)], {}, quiet) == () and quiet.left <= 0
    # without a reading of the cores: one timing, no wait
    calls: list[int] = []
    monkeypatch.setattr(cpu_gemm, "small_rows_plan", lambda _w, _c: calls.append(1) or ((4, "mm"),))
    assert cpu_gemm.chosen_plan([torch.zeros(4, 4)], {}, QuietCores(None, 10.0, threads=2)) == ((4, "mm"),)
    assert calls == [1]


def test_the_wait_for_quiet_cores_is_configured_and_bounded(monkeypatch) -> None:
    with pytest.raises(ValueError, match="cpu_gemm_quiet_wait_s"):
        EngineConfig(cpu_gemm_quiet_wait_s=-1)
    monkeypatch.setenv("TIERKV_ENGINE_CPU_GEMM_QUIET_WAIT_S", "0")
    assert EngineConfig.from_env().cpu_gemm_quiet_wait_s == 0.0
    opened: list[int] = []
    monkeypatch.setattr(cpu_gemm.CoreLoad, "open", staticmethod(lambda: opened.append(1)))
    monkeypatch.setattr(cpu_gemm, "small_rows_plan", lambda _w, _c: ((2, "mm"),))
    cpu_gemm.for_weights(("quiet-wait-0",), [torch.zeros(4, 4)], quiet_wait_s=0)
    assert opened == []  # 0: the cores are not even read
