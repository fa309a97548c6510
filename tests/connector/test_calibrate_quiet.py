"""The start-up prefill calibration times its prefills on quiet cores (connector/calibrate.py,
engine/core_load.py): it waits for other processes to leave its cores, times again a shape
whose runs all shared them, and gives up waiting after its budget with a warning."""

from __future__ import annotations

import logging
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from connector import calibrate
from connector.cost_model import PrefillModel
from engine import core_load
from engine.core_load import CoreLoad

SAMPLES = ((16, 0), (64, 0), (256, 0), (128, 512))


def true_time(new: int, ctx: int) -> float:
    return 0.05 + 0.001 * new + 1e-6 * new * (ctx + new / 2)


class Machine:
    """Other processes' work, window by window: ``busy`` says, for each window the calibration
    opens (a look at the cores or a timed prefill), whether it shared the cores; past the list,
    quiet. A prefill in a busy window takes 5x as long."""

    cpus = {0, 1}

    def __init__(self, busy: list[bool], share: float = 0.7) -> None:
        self.busy, self.now, self.windows, self.slept, self.slow_runs = list(busy), False, 0, 0.0, 0
        self.share = share

    def mark(self) -> None:
        self.now = self.busy.pop(0) if self.busy else False
        self.windows += 1

    def others_share(self) -> float:
        return self.share if self.now else 0.0

    def sleep(self, s: float) -> None:
        self.slept += s

    def time_prefill(self, view: object, new: int, ctx: int) -> float:
        self.slow_runs += self.now
        return true_time(new, ctx) * (5 if self.now else 1)


@pytest.fixture
def view() -> SimpleNamespace:
    return SimpleNamespace(fingerprint="fp", device=torch.device("cpu"), dtype=torch.float32)


def run(machine: Machine, view: SimpleNamespace, monkeypatch: pytest.MonkeyPatch, threads: int = 2,
        **kw: object) -> PrefillModel:
    monkeypatch.setattr(calibrate, "time_prefill", machine.time_prefill)
    monkeypatch.setattr(calibrate.torch, "get_num_threads", lambda: threads)
    return calibrate.calibrate_prefill(view, SAMPLES, cache=False, load=machine, sleep=machine.sleep, **kw)


def exact() -> PrefillModel:
    return PrefillModel.fit([(n, c, true_time(n, c)) for n, c in SAMPLES])


def test_it_waits_for_busy_cores_then_fits_the_quiet_timings(view, monkeypatch) -> None:
    m = Machine([True] * 4)  # the first four looks find the cores busy (engines starting beside it)
    model = run(m, view, monkeypatch)
    assert m.slow_runs == 0 and m.windows > 4  # every busy window was a look, none a timed run
    assert m.slept >= 4 * core_load.LOOK_S + 4 * core_load.PAUSE_S[0]
    assert model.a == pytest.approx(exact().a) and model.b == pytest.approx(exact().b)


def test_a_shape_timed_only_on_shared_cores_is_timed_again(view, monkeypatch) -> None:
    # two quiet looks; then both runs of the first shape share the cores; its retry (after quiet looks) does not
    m = Machine([False, False, True, True])
    model = run(m, view, monkeypatch)
    assert model.a == pytest.approx(exact().a) and model.b == pytest.approx(exact().b)
    # without the retry the first shape's point is 5x slow, and the fit with it
    m2 = Machine([False, False, True, True])
    monkeypatch.setattr(calibrate, "RETRIES", 0)
    assert run(m2, view, monkeypatch).a > 2 * exact().a


def test_cores_that_never_quieten_cost_at_most_the_budget_then_a_warning(view, monkeypatch, caplog) -> None:
    m = Machine([True] * 10_000)
    with caplog.at_level(logging.WARNING, logger="connector.calibrate"):
        model = run(m, view, monkeypatch, quiet_wait_s=5.0)
    assert m.slept <= 5.0 + core_load.LOOK_S + core_load.PAUSE_S[1]
    assert m.windows < 5.0 / core_load.LOOK_S + len(SAMPLES) * (2 + calibrate.RETRIES)
    assert model.a > 2 * exact().a  # it took what it had: the slow timings
    assert "kept this engine's cores busy" in caplog.text


def test_a_quiet_look_is_confirmed_by_a_second_after_a_random_pause(view, monkeypatch) -> None:
    """Engines waiting for each other all see quiet cores at once (each is only looking): a look
    that finds the cores quiet is taken again after a random pause before the timing starts."""
    m = Machine([False, True, False, False])  # quiet, then busy (another engine began), then quiet twice
    run(m, view, monkeypatch)
    assert m.slow_runs == 0


def test_what_counts_as_busy_follows_the_engines_threads(view, monkeypatch) -> None:
    """Another process on one of 2 cores: a 2-thread engine waits it out, a 1-thread engine has a
    core of its own and does not wait."""
    two = Machine([True] * 3, share=0.5)
    run(two, view, monkeypatch, threads=2)
    assert two.slow_runs == 0 and two.slept > 3 * core_load.LOOK_S
    one = Machine([True] * 3, share=0.5)
    run(one, view, monkeypatch, threads=1)
    assert one.windows < 3 + len(SAMPLES) * 2 and one.slept < 2 * core_load.LOOK_S + core_load.CONFIRM_PAUSE_S + 1e-9


def test_no_reading_of_the_cores_means_no_waiting(view, monkeypatch) -> None:
    slept: list[float] = []
    monkeypatch.setattr(calibrate, "time_prefill", lambda _v, n, c: true_time(n, c))
    model = calibrate.calibrate_prefill(view, SAMPLES, cache=False, load=None, sleep=slept.append)
    assert slept == [] and model.b == pytest.approx(exact().b)


def test_core_load_counts_other_processes_not_this_one(tmp_path: Path, monkeypatch) -> None:
    """The arithmetic on a /proc/stat of our own: busy ticks of our cores less our CPU time."""
    stat = tmp_path / "stat"

    def write(cpu0: int, cpu1: int, cpu2: int) -> None:  # busy ticks in user; idle 0
        stat.write_text(f"cpu  0 0 0 0 0 0 0 0\ncpu0 {cpu0} 0 0 9 0 0 0 0\ncpu1 {cpu1} 0 0 9 0 0 0 0\n"
                        f"cpu2 {cpu2} 0 0 9 0 0 0 0\nintr 1 2 3\n")

    clock = {"mono": 100.0, "cpu": 10.0}
    monkeypatch.setattr("engine.core_load.time.monotonic", lambda: clock["mono"])
    monkeypatch.setattr("engine.core_load.time.process_time", lambda: clock["cpu"])
    tick = CoreLoad(set(), stat).tick
    write(0, 0, 0)
    load = CoreLoad({0, 1}, stat)  # cpu2 is not ours
    # 1 s: cpu0 and cpu1 busy 0.5 s each, cpu2 busy all along; 0.25 s of it was this process
    clock["mono"] += 1.0
    clock["cpu"] += 0.25
    write(tick // 2, tick // 2, tick)
    assert load.others_share() == pytest.approx((1.0 - 0.25) / 2)
    clock["mono"] += 1.0
    assert load.others_share() == 0.0  # nothing since
    clock["mono"] += 0.001
    assert load.others_share() is None  # too short to tell
    assert CoreLoad.open(tmp_path / "absent") is None


def test_core_load_sees_a_process_spinning_on_every_core() -> None:
    load = CoreLoad.open()
    if load is None:
        pytest.skip("no /proc/stat")
    code = "import time\nt = time.monotonic()\nwhile time.monotonic() - t < 1.5: pass"
    spinners = [subprocess.Popen([sys.executable, "-c", code]) for _ in load.cpus]
    try:
        time.sleep(0.3)
        load.mark()
        time.sleep(0.8)
        share = load.others_share()
    finally:
        for p in spinners:
            p.wait()
    assert share is not None and share >= 0.5
    load.mark()
    t = time.monotonic()
    while time.monotonic() - t < 0.5:  # this process's own work is not "others"
        pass
    share = load.others_share()
    assert share is not None and share < 0.5


def test_the_wait_is_configured_and_bounded(monkeypatch) -> None:
    from connector.config import ConnectorConfig

    with pytest.raises(ValueError, match="calibrate_quiet_wait_s"):
        ConnectorConfig("127.0.0.1:1", calibrate_quiet_wait_s=-1)
    monkeypatch.setenv("TIERKV_CONNECTOR_CALIBRATE_QUIET_WAIT_S", "0")
    assert ConnectorConfig.from_env("127.0.0.1:1").calibrate_quiet_wait_s == 0.0


def test_bench_calibrate_together_reads_the_fit_from_the_log_line(view, monkeypatch, caplog) -> None:
    """bench.calibrate_together parses the calibration's own log line (format changes break it here)."""
    from bench.calibrate_together import _fit

    m = Machine([True] * 3)
    with caplog.at_level(logging.INFO, logger="connector.calibrate"):
        model = run(m, view, monkeypatch)
    fit = _fit(caplog.text)
    assert fit["a"] == pytest.approx(model.a, rel=1e-3, abs=1e-4) and fit["b"] == pytest.approx(model.b, rel=1e-2)
    assert fit["waited_s"] > 0 and fit["contended_runs"] == 0
    assert fit["predict_256_s"] == pytest.approx(model.predict(256), rel=1e-2)


def test_bench_calibrate_together_reads_the_choice_of_form_from_the_log_line(monkeypatch, caplog) -> None:
    from bench.calibrate_together import _linear_rows
    from engine import cpu_gemm

    for upto, plan in ((4, ((4, "mm"),)), (32, ((2, "mm"), (32, "native"))), (0, ())):
        monkeypatch.setattr(cpu_gemm, "small_rows_plan", lambda _w, _c, plan=plan: plan)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="engine.cpu_gemm"):
            cpu_gemm.for_weights(("test-key", upto), [torch.zeros(4, 4)], load=None)
        assert _linear_rows(caplog.text) == upto
