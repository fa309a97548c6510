"""The load-aware decision: bytes already on the transfer stream push a load towards recompute,
prefill queued on the engine pushes a recompute towards loading. On fixed inputs first, then end
to end (the tiny Llama, an in-process daemon) where the other load or prefill is really there."""

from __future__ import annotations

from pathlib import Path

import pytest

from connector.cost_model import IDLE, CostModel, EngineLoad, PrefillModel
from connector.state import kv_state
from engine.request import Status
from engine.sampling import SamplingParams
from tests.connector.async_support import DAEMON_FLAGS, PS, HeldLoader, in_daemon_only
from tests.connector.support import attach, detach, prompt, run
from tests.fixtures_engine import make_engine
from tests.fixtures_kvstore import served

pytestmark = pytest.mark.timeout(300)
PAGE = 8192  # bytes of one tiny-Llama page (2 layers x K,V x 16 tokens x 2 heads x 16 x fp32)
PREFILL = (0.01, 1e-3, 0.0)  # 0.13 s for 120 tokens


def _model(cpu_bw: float) -> CostModel:
    m = CostModel(PrefillModel(*PREFILL), PAGE, PS)
    m.seed("cpu", 0.001, cpu_bw)
    return m


def test_bytes_in_flight_turn_a_load_into_a_recompute() -> None:
    m = _model(1e6)  # 7 pages: 58 ms, against 130 ms of prefill
    idle = m.decide_under_load(0, 120, ["cpu"] * 7, IDLE)
    assert idle == m.decide(0, 120, ["cpu"] * 7) and idle.outcome == "load_all"
    busy = m.decide_under_load(0, 120, ["cpu"] * 7, EngineLoad({"cpu": 24 * PAGE}, ()))
    assert busy.outcome == "recompute" and busy.pages == 0
    assert busy.predicted_recompute_s == pytest.approx(idle.predicted_recompute_s)
    small = m.decide_under_load(0, 120, ["cpu"] * 7, EngineLoad({"cpu": 2 * PAGE}, ()))
    assert small.outcome == "load_all"  # 16 ms ahead of it: still worth it
    assert small.load_wait_s == pytest.approx(2 * PAGE / 1e6)
    assert small.predicted_total_s == pytest.approx(small.load_wait_s + idle.predicted_total_s)


def test_prefill_queued_ahead_turns_a_recompute_into_a_load() -> None:
    m = _model(1e5)  # 7 pages: 0.58 s, against 0.13 s of prefill
    assert m.decide(0, 120, ["cpu"] * 7).outcome == "recompute"
    busy = m.decide_under_load(0, 120, ["cpu"] * 7, EngineLoad({}, [(700, 100)]))
    queued = PrefillModel(*PREFILL).fitted_step([(700, 100)])
    assert busy.prefill_wait_s == pytest.approx(queued)
    assert busy.outcome == "load_all"  # the load ends while the engine works through the queue
    assert busy.predicted_recompute_s == pytest.approx(queued + PrefillModel(*PREFILL).predict(120))
    assert busy.predicted_total_s == pytest.approx(queued + PrefillModel(*PREFILL).predict(8, 112))
    light = m.decide_under_load(0, 120, ["cpu"] * 7, EngineLoad({}, [(100, 0)]))
    # 0.11 s of queue hides one page (83 ms), not all seven (0.58 s): load what arrives meanwhile
    assert (light.outcome, light.pages) == ("load_partial", 1)


def test_prefill_queue_is_priced_with_the_online_correction() -> None:
    m = _model(1e5)
    m.prefill = m.prefill._replace(scale=2.0)
    assert m.prefill_wait_s([(700, 100)]) == pytest.approx(2.0 * PrefillModel(*PREFILL).fitted_step([(700, 100)]))


def _attach(eng, address: str, cpu_bw: float, measured: bool = True):
    conn = attach(eng, address, load_mode="auto", prefill_coeffs=PREFILL, prefill_learn=False,
                  load_deadline_min_s=60.0)
    conn.cost.seed("cpu", 0.001, cpu_bw)
    conn.cost.tier("cpu").measured = int(measured)  # as if a real load had measured it: no exploring
    return conn


def test_a_load_held_on_the_stream_makes_the_next_request_recompute(tiny, tmp_path: Path) -> None:
    first, second = prompt(400, seed=70), prompt(120, seed=71)  # 24 and 7 loadable pages
    with served(tmp_path, *DAEMON_FLAGS) as d:
        eng = make_engine(tiny)
        conn = _attach(eng, d.address, cpu_bw=1e6)
        try:
            want_first = in_daemon_only(eng, conn, first)
            want_second = in_daemon_only(eng, conn, second)
            held = conn.loader = HeldLoader(conn.loader, at=0)
            a = eng.requests[eng.add_request(first, SamplingParams(max_tokens=6, ignore_eos=True))]
            while not held.entered.is_set():
                eng.step()
            assert conn.fetcher.inflight() == {"cpu": 24 * PAGE}
            b = run(eng, second)  # decided with 24 pages ahead of it on the stream: recompute
            assert kv_state(b).decision.outcome == "recompute" and b.cached_tokens == 0 and b.output_ids == want_second
            assert conn.metrics.value("tierkv_connector_load_aware_changes_total", idle="load_all",
                                      outcome="recompute") == 1
            held.gate.set()
            while not a.finished:
                eng.step()
            assert a.cached_tokens == 24 * PS and a.output_ids == want_first
            assert conn.fetcher.inflight() == {}
        finally:
            detach(eng)


def test_a_long_prefill_running_makes_a_slow_load_worth_it(tiny, tmp_path: Path) -> None:
    long_ids, ids = prompt(800, seed=72), prompt(120, seed=73)
    with served(tmp_path, *DAEMON_FLAGS) as d:
        eng = make_engine(tiny, num_pages=128, max_prefill_tokens=64)  # the long prompt prefills in 13 steps
        conn = _attach(eng, d.address, cpu_bw=1e5)  # 0.58 s for 7 pages: alone, recompute wins
        try:
            want = in_daemon_only(eng, conn, ids)
            eng.radix.reset()
            assert kv_state(run(eng, ids)).decision.outcome == "recompute"
            eng.radix.reset()
            r = eng.requests[eng.add_request(long_ids, SamplingParams(max_tokens=2, ignore_eos=True))]
            while r.status is not Status.RUNNING:
                eng.step()
            assert r.remaining > 600
            b = eng.requests[eng.add_request(ids, SamplingParams(max_tokens=6, ignore_eos=True))]
            while not (b.finished and r.finished):
                eng.step()
            assert kv_state(b).decision.outcome == "load_all" and kv_state(b).decision.prefill_wait_s > 0.6
            assert b.cached_tokens == 7 * PS and b.output_ids == want
            assert conn.metrics.value("tierkv_connector_load_aware_changes_total", idle="recompute",
                                      outcome="load_all") == 1
        finally:
            detach(eng)


def test_a_tier_no_load_ever_measured_is_explored_then_trusted(tiny, tmp_path: Path) -> None:
    """A start-up probe taken at a bad moment says the tier is 100x too slow: the first request
    loads a few pages anyway, the measurement replaces the probe's figure, the next one loads all."""
    from connector.connector import EXPLORE_PAGES

    ids = prompt(200, seed=74)  # 12 loadable pages
    with served(tmp_path, *DAEMON_FLAGS) as d:
        eng = make_engine(tiny)
        conn = _attach(eng, d.address, cpu_bw=1e4, measured=False)  # 12 pages: 9.8 s, against 0.21 s
        try:
            want = in_daemon_only(eng, conn, ids)
            first = run(eng, ids)
            assert kv_state(first).decision.outcome == "explore" and first.cached_tokens == EXPLORE_PAGES * PS
            assert first.output_ids == want
            # the load's own measurement replaced the probe's 1e4 B/s (its value is the machine's speed)
            assert conn.cost.tier("cpu").measured == 1 and conn.cost.tier("cpu").bandwidth != 1e4
            eng.radix.reset()
            second = run(eng, ids)
            assert kv_state(second).decision.outcome == "load_all" and second.output_ids == want
            assert conn.metrics.value("tierkv_connector_decisions_total", tier="cpu", outcome="explore") == 1
        finally:
            detach(eng)


def test_a_measured_slow_tier_is_explored_after_32_bypasses_and_30_s(tiny, tmp_path: Path) -> None:
    from connector.explore import EXPLORE_AFTER_S, EXPLORE_EVERY, Explorer
    from engine.request import Request

    with served(tmp_path, *DAEMON_FLAGS) as d:
        eng = make_engine(tiny)
        conn = _attach(eng, d.address, cpu_bw=1e4)
        now = [0.0]
        conn._explorer = Explorer(clock=lambda: now[0])
        try:
            req = Request("r", prompt(120, seed=75), SamplingParams())
            decide = lambda: conn._decide(req, ["cpu"] * 7, IDLE).outcome  # noqa: E731
            assert {decide() for _ in range(2 * EXPLORE_EVERY)} == {"recompute"}  # many bypasses, no time
            now[0] += EXPLORE_AFTER_S
            assert decide() == "explore"  # both: 64 bypasses and 30 s
            now[0] += 2 * EXPLORE_AFTER_S
            outcomes = [decide() for _ in range(EXPLORE_EVERY)]  # time, and then the 32nd bypass
            assert outcomes.count("explore") == 1 and outcomes[-1] == "explore", outcomes
            assert conn.metrics.value("tierkv_connector_decisions_total", tier="cpu", outcome="explore") == 2
            busy = EngineLoad({"cpu": 64 * PAGE}, ())  # bypassed because of the load, not the tier: no exploring
            conn.cost.seed("cpu", 0.001, 1e6)
            conn.cost.tier("cpu").measured = 1
            now[0] += 10 * EXPLORE_AFTER_S
            assert {conn._decide(req, ["cpu"] * 7, busy).outcome for _ in range(2 * EXPLORE_EVERY)} == {"recompute"}
        finally:
            detach(eng)
