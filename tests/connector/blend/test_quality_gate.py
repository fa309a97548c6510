"""The blending quality gate: bad blends switch blending off (requests then equal a full prefill),
good ones switch it back on, exact blends keep it on. A real engine (tiny 4-layer Llama); the bad
blend comes from a chunk store that hands back shifted KV, as a broken store or selection would."""

from __future__ import annotations

import pytest

from connector.blend import BlendConfig, InProcessChunkStore, build_blend_request
from connector.blend.frontend import add_blend_request
from connector.blend.metrics import BlendCollector
from connector.blend.quality_gate import QualityGate, lcs_f1
from connector.blend.state import blend_state
from connector.wiring import attach_cacheblend
from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.errors import ConfigError
from engine.sampling import SamplingParams
from tests.fixtures_engine import make_engine

SYSTEM = "You answer questions from the documents you are given.\n"
DOCS = ["The lighthouse of Orvik was built in 1852 by the engineer Talia Novak, who also designed its lens. ",
        "Orvik's harbour freezes every February, and the ferries then stop running for three weeks. ",
        "Talia Novak later moved to Esterby, where she taught mathematics until she retired. ",
        "Esterby's only bridge was rebuilt in stone after the flood of 1901, at the town's own cost. ",
        "The ferry company of Orvik was sold in 1977 to a cooperative of its own captains. ",
        "Every lighthouse keeper of Orvik since 1852 has kept a logbook; all of them survive. "]
TOKENS = 8


class ShiftingStore:
    """A chunk store that returns each chunk's KV shifted by a few positions while ``corrupt``."""

    def __init__(self) -> None:
        self.inner = InProcessChunkStore()
        self.corrupt = True
        self.fail = False

    def get(self, key: bytes):
        if self.fail:
            raise OSError("chunk store unreachable")
        kv = self.inner.get(key)
        return kv.roll(5, dims=2) if kv is not None and self.corrupt else kv

    def put(self, key: bytes, kv) -> None:
        self.inner.put(key, kv)


@pytest.fixture(scope="module")
def tiny4(tiny4_loaded):
    return tiny4_loaded


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Single-threaded: many small ops per step; a second thread on a busy 2-core box only waits."""
    yield


#: the engine of these tests: make_engine(loaded, **ENGINE)
ENGINE = dict(num_pages=256, device="cpu", page_size=16, max_prefill_tokens=2048, num_threads=0)


def _gated_engine(loaded, store, **gate):
    eng = make_engine(loaded, **ENGINE)
    cfg = BlendConfig(ratio=0.0, gate_fraction=1.0, gate_threshold=0.9, gate_window=4, gate_min_samples=2,
                      gate_tokens=TOKENS, **gate)
    return eng, attach_cacheblend(eng, cfg, store=store)


def _spec(tok, i: int, ratio: float | None = None):
    """Request i: the documents rotated so that no two consecutive prompts share more than the head."""
    k = i % len(DOCS)
    ids, spec = build_blend_request(tok, SYSTEM, DOCS[k:] + DOCS[:k], f"Question {i}: who built it? Answer:")
    if ratio is not None:
        from dataclasses import replace

        spec = replace(spec, ratio=ratio)
    return ids, spec


def _drain(eng) -> None:
    """Run until every request, the gate's shadows included, is done."""
    for _ in range(10_000):
        if not eng.has_unfinished():
            return
        eng.step()
    raise AssertionError("engine did not drain")


def _ask(eng, hook, spec):
    rid = add_blend_request(eng, spec, SamplingParams(max_tokens=TOKENS))
    req = eng.requests[rid]
    _drain(eng)
    return req


@pytest.fixture(scope="module")
def reference(tiny4):
    """Full-prefill greedy tokens of request i (a plain engine, no plug-ins)."""
    eng, memo = make_engine(tiny4, **ENGINE), {}

    def want(ids: list[int]) -> list[int]:
        key = tuple(ids)
        if key not in memo:
            memo[key] = eng.generate([ids], SamplingParams(max_tokens=TOKENS))[0].output_ids
        return memo[key]

    return want


def test_bad_blends_switch_blending_off_then_good_ones_back_on(tiny4, reference) -> None:
    store = ShiftingStore()
    eng, hook = _gated_engine(tiny4, store)
    gate, m, tok = hook.gate, hook.metrics, tiny4.tokenizer
    i = 0
    while gate.blending and i < 8:  # the first request computes the chunks; later ones reuse shifted KV
        _ask(eng, hook, _spec(tok, i)[1])
        i += 1
    assert not gate.blending and m.gate_switched_off == 1 and m.gate_blending == 0
    assert m.gate_agreement < 0.9 and m.gate_samples >= 2
    # while off: requests are prefilled in full (same tokens as a plain engine), and the gate's blended
    # shadows, still bad, keep it off for longer than a window (a shadow sharing the request's radix
    # tree would find the prompt just prefilled there, hardly blend, and wrongly agree)
    for _ in range(5):
        ids, spec = _spec(tok, i)
        req = _ask(eng, hook, spec)
        i += 1
        assert blend_state(req).gated and blend_state(req).stats is None
        assert req.output_ids == reference(ids)
        assert req.cached_tokens == req.usage.radix  # a full prefill: only exact radix hits
    assert not gate.blending and m.gated_requests == 5
    # the store is repaired and requests ask for exact blends: the gate's blended shadows agree again
    store.corrupt = False
    for _ in range(8):
        if gate.blending:
            break
        _ask(eng, hook, _spec(tok, i, ratio=1.0)[1])
        i += 1
    assert gate.blending and m.gate_switched_on == 1 and gate.agreement >= 0.9
    ids, spec = _spec(tok, i, ratio=1.0)
    req = _ask(eng, hook, spec)
    assert blend_state(req).stats is not None and not blend_state(req).gated  # blended again
    assert req.output_ids == reference(ids)
    assert not hook.prober.inflight
    eng.pool.allocator.check_integrity()
    eng.radix.check_integrity()


def test_exact_blends_keep_blending_on(tiny4, reference) -> None:
    store = ShiftingStore()  # even with shifted chunks: r = 1 recomputes every token
    eng, hook = _gated_engine(tiny4, store)
    for i in range(5):
        ids, spec = _spec(tiny4.tokenizer, i, ratio=1.0)
        req = _ask(eng, hook, spec)
        assert blend_state(req).stats is not None and req.output_ids == reference(ids)
    # a sampled (not greedy) request: both sides of its probe are greedy shadows
    rid = add_blend_request(eng, _spec(tiny4.tokenizer, 5, ratio=1.0)[1], SamplingParams(max_tokens=2, temperature=1.0))
    _drain(eng)
    assert eng.requests.get(rid) is None and not hook.prober.inflight
    assert hook.gate.blending and hook.metrics.gate_samples == 6 and hook.gate.agreement == 1.0
    assert hook.metrics.gate_switched_off == 0 and hook.metrics.gated_requests == 0
    text = b"".join(f.name.encode() + str(f.samples[0].value).encode() + b"\n"
                    for f in BlendCollector(hook.metrics).collect())
    assert b"tierkv_blend_gate_agreement1.0" in text and b"tierkv_blend_gate_blending1" in text


def test_a_probe_whose_shadow_was_not_blended_is_no_sample(tiny4) -> None:
    store = ShiftingStore()
    eng, hook = _gated_engine(tiny4, store)
    gate = hook.gate
    for _ in range(2):
        gate.record(0.0)
    assert not gate.blending
    store.fail = True  # the blended shadow falls back to a full prefill: it must not count as agreement
    _ask(eng, hook, _spec(tiny4.tokenizer, 0)[1])
    assert hook.metrics.gate_void == 1 and hook.metrics.gate_samples == 2 and not gate.blending
    assert not hook.prober.inflight


def test_probes_in_flight_are_bounded(tiny4) -> None:
    eng, hook = _gated_engine(tiny4, ShiftingStore(), gate_max_inflight=2)
    for i in range(5):
        add_blend_request(eng, _spec(tiny4.tokenizer, i)[1], SamplingParams(max_tokens=TOKENS))
    peak = 0
    while eng.has_unfinished():
        eng.step()
        peak = max(peak, len(hook.prober.inflight))
    assert peak == 2 and hook.metrics.gate_skipped == 3 and hook.metrics.gate_samples == 2


def test_no_gate_no_shadows(tiny4) -> None:
    eng = make_engine(tiny4, **ENGINE)
    hook = attach_cacheblend(eng, BlendConfig(ratio=0.0), store=ShiftingStore())
    for i in range(3):
        add_blend_request(eng, _spec(tiny4.tokenizer, i)[1], SamplingParams(max_tokens=2))
    steps = 0
    while eng.has_unfinished():
        eng.step()
        steps += 1
        assert all(not r.rid.startswith("gate-") for r in eng.requests.values())
    assert hook.metrics.gate_samples == 0 and hook.gate.blending


def test_lcs_f1() -> None:
    assert lcs_f1([1, 2, 3, 4], [1, 2, 3, 4]) == 1.0
    assert lcs_f1([1, 2, 3, 4], [9, 1, 2, 3]) == 0.75  # a one-token shift costs one token
    assert lcs_f1([1, 2], [3, 4]) == 0.0
    assert lcs_f1([], []) == 1.0 and lcs_f1([1], []) == 0.0


def test_gate_decisions() -> None:
    gate = QualityGate(fraction=0.25, threshold=0.8, window=4, min_samples=3)
    assert sum(gate.should_sample() for _ in range(100)) == 25
    gate.record(0.0)
    gate.record(0.0)
    assert gate.blending  # fewer than min_samples: no decision yet
    gate.record(0.0)
    assert not gate.blending
    for _ in range(3):
        gate.record(1.0)
        assert not gate.blending  # the bad sample left in the window keeps the mean at 0.75
    gate.record(1.0)
    assert gate.blending and gate.metrics.gate_switched_off == gate.metrics.gate_switched_on == 1
    assert QualityGate(0.0, 0.8, 4, 2).should_sample() is False


def test_gate_config_is_validated() -> None:
    with pytest.raises(ValueError, match="gate_fraction"):
        BlendConfig(gate_fraction=1.5)
    with pytest.raises(ValueError, match="gate_window"):
        BlendConfig(gate_window=0)
    cfg = BlendConfig.from_env({"TIERKV_BLEND_GATE_FRACTION": "0.1", "TIERKV_BLEND_GATE_THRESHOLD": "0.7"})
    assert (cfg.gate_fraction, cfg.gate_threshold) == (0.1, 0.7)
    with pytest.raises(ConfigError, match="TIERKV_BLEND_GATE_FRACTION"):
        BlendConfig.from_env({"TIERKV_BLEND_GATE_FRACTION": "lots"})
    with pytest.raises(ConfigError, match="gate_threshold"):
        BlendConfig.from_env({"TIERKV_BLEND_GATE_THRESHOLD": "2"})


def test_an_aborted_request_starts_no_probe(tiny4) -> None:
    eng, hook = _gated_engine(tiny4, ShiftingStore())
    rid = add_blend_request(eng, _spec(tiny4.tokenizer, 0)[1], SamplingParams(max_tokens=TOKENS))
    req = eng.requests[rid]
    while not req.output_ids:
        eng.step()
    eng.abort(rid)
    assert req.finish_reason == "abort" and blend_state(req).stats is not None
    assert not eng.has_unfinished() and not hook.prober.inflight


def test_a_shadow_that_does_not_fit_skips_the_sample(tiny4) -> None:
    ids, spec = _spec(tiny4.tokenizer, 0)
    eng = LLMEngine(EngineConfig(num_pages=64, device="cpu", page_size=16, max_model_len=len(ids) + 2), loaded=tiny4)
    hook = attach_cacheblend(eng, BlendConfig(ratio=0.0, gate_fraction=1.0, gate_tokens=TOKENS), store=ShiftingStore())
    # sampled (not greedy): both sides are shadows of TOKENS tokens, longer than the context allows
    rid = add_blend_request(eng, spec, SamplingParams(max_tokens=2, temperature=1.0, seed=1))
    req = eng.requests[rid]
    _drain(eng)
    assert req.finish_reason == "length" and hook.metrics.gate_skipped == 1 and not hook.prober.inflight


def test_shadows_are_admitted_after_the_step_not_inside_finish(tiny4, monkeypatch) -> None:
    """The hook's on_finish runs inside Scheduler.finish: the shadows it starts are submitted through
    the engine view and join the queue when the step is over, never from inside the scheduler."""
    eng, hook = _gated_engine(tiny4, ShiftingStore())
    sched = eng.scheduler
    inside, added = [False], []
    finish, add = sched.finish, sched.add

    def finish_spy(req, reason):
        inside[0] = True
        try:
            finish(req, reason)
        finally:
            inside[0] = False

    def add_spy(req):
        added.append((req.rid, inside[0]))
        add(req)

    monkeypatch.setattr(sched, "finish", finish_spy)
    monkeypatch.setattr(sched, "add", add_spy)
    req = eng.requests[add_blend_request(eng, _spec(tiny4.tokenizer, 0)[1], SamplingParams(max_tokens=2))]
    while not req.finished:
        eng.step()
    shadows = [rid for rid, _ in added if rid.startswith("gate-")]
    assert shadows and hook.prober.inflight  # a probe started: its shadows are queued ...
    assert all(rid in eng.requests for rid in shadows)  # ... by the time the step returned ...
    assert not any(during for _, during in added)  # ... and none from inside finish
    _drain(eng)
    assert not hook.prober.inflight and hook.metrics.gate_samples == 1
