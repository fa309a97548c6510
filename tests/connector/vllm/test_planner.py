"""The scheduler half of the vLLM connector, as plain data: what it loads, saves, and forgets."""

from __future__ import annotations

from collections.abc import Sequence

from connector.vllm.config import VLLMConnectorConfig
from connector.vllm.counters import Counters
from connector.vllm.keys import VLLMKeySpace
from connector.vllm.meta import LoadOutcome, TierKVWorkerMetadata
from connector.vllm.planner import Planner, Scheduled

BS = 4
SPACE = VLLMKeySpace({"model_type": "llama"}, "w", "torch.bfloat16", BS, "cpu:L")


class FakeDaemon:
    def __init__(self) -> None:
        self.held: set[bytes] = set()
        self.calls = 0
        self.fail = False

    def lookup(self, keys: Sequence[bytes], deadline_s: float) -> tuple[int, list[str | None]]:
        self.calls += 1
        if self.fail:
            raise ConnectionError("daemon down")
        tiers: list[str | None] = ["cpu" if k in self.held else None for k in keys]
        n = 0
        while n < len(tiers) and tiers[n]:
            n += 1
        return n, tiers


class Clock:
    t = 100.0

    def __call__(self) -> float:
        return self.t


def loading(blocks: int) -> tuple[Planner, list[int], list[bytes]]:
    """A planner whose request "r" is loading all ``blocks`` full blocks of its prompt from the daemon."""
    d = FakeDaemon()
    toks = list(range(blocks * BS + 1))
    keys = SPACE.keys(toks, None)
    d.held = set(keys)
    p = planner(d)
    assert p.matched("r", toks, len(toks), None, 0) == (blocks * BS, True)
    ids = list(range(blocks + 1))
    p.allocated("r", ids, blocks * BS)
    p.build([Scheduled("r", blocks * BS, 0, ids, True)])
    return p, toks, keys


def planner(daemon: FakeDaemon, clock: Clock | None = None, **extra: object) -> Planner:
    cfg = VLLMConnectorConfig.from_extra({"kvstore": "h:1", **extra})
    return Planner(cfg, SPACE, daemon.lookup, 1 << 20, Counters(), clock=clock or Clock())


def test_loads_what_the_daemon_holds_beyond_the_local_hit_uncalibrated() -> None:
    d = FakeDaemon()
    toks = list(range(4 * BS + 2))
    keys = SPACE.keys(toks, None)
    d.held = set(keys[:3])
    p = planner(d)
    # one block is local: blocks 1 and 2 held beyond it; block 3 not held
    assert p.matched("r", toks, len(toks), None, BS) == (2 * BS, True)
    assert p.counters.take()["decisions:uncalibrated"] == 1
    p.allocated("r", [10, 11, 12, 13, 14], 2 * BS)
    meta = p.build([Scheduled("r", 3 * BS, len(toks) - 3 * BS, [10, 11, 12, 13, 14], True)])
    (load,) = meta.loads
    assert load.keys == keys[1:3] and load.block_ids == [11, 12] and load.tiers == ["cpu", "cpu"]
    # the step computes blocks 3 (and a partial): only block 3 is new to the daemon
    assert [s.keys for s in meta.saves] == [[keys[3]]] and meta.saves[0].block_ids == [13]


def test_the_answer_is_cached_per_request_and_num_computed() -> None:
    d = FakeDaemon()
    toks = list(range(3 * BS))
    d.held = set(SPACE.keys(toks, None))
    p = planner(d)
    assert p.matched("r", toks, len(toks), None, 0) == p.matched("r", toks, len(toks), None, 0)
    assert d.calls == 1
    p.matched("r", toks, len(toks), None, BS)  # a new local hit asks again
    assert d.calls == 2


def test_the_last_prompt_token_is_never_loaded() -> None:
    d = FakeDaemon()
    toks = list(range(2 * BS))  # exactly two blocks: the second holds the token that samples
    d.held = set(SPACE.keys(toks, None))
    assert planner(d).matched("r", toks, len(toks), None, 0) == (BS, True)


def test_nothing_held_or_never_mode_means_recompute() -> None:
    d = FakeDaemon()
    toks = list(range(3 * BS))
    assert planner(d).matched("r", toks, len(toks), None, 0) == (0, False)
    d.held = set(SPACE.keys(toks, None))
    assert planner(d, load_mode="never").matched("r", toks, len(toks), None, 0) == (0, False)


def test_a_failed_lookup_recomputes_and_skips_lookups_for_a_while() -> None:
    d, clock = FakeDaemon(), Clock()
    toks = list(range(3 * BS))
    d.held = set(SPACE.keys(toks, None))
    d.fail = True
    p = planner(d, clock, retry_after_failure_s=5.0)
    assert p.matched("a", toks, len(toks), None, 0) == (0, False)
    d.fail = False
    assert p.matched("b", toks, len(toks), None, 0) == (0, False)  # skipped: no second deadline
    assert d.calls == 1
    clock.t += 6
    assert p.matched("c", toks, len(toks), None, 0) == (2 * BS, True)
    c = p.counters.take()
    assert c["lookup_errors"] == 1 and c["lookup_skipped"] == 1


def test_salted_requests_look_up_their_own_keys() -> None:
    d = FakeDaemon()
    toks = list(range(3 * BS))
    d.held = set(SPACE.keys(toks, "tenant-a"))
    p = planner(d)
    assert p.matched("a", toks, len(toks), "tenant-a", 0)[0] == 2 * BS
    assert p.matched("b", toks, len(toks), "tenant-b", 0) == (0, False)
    assert p.matched("c", toks, len(toks), None, 0) == (0, False)


def test_saves_are_deduplicated_across_requests_and_steps() -> None:
    d = FakeDaemon()
    toks = list(range(3 * BS + 1))
    p = planner(d)
    p.matched("a", toks, len(toks), None, 0)
    first = p.build([Scheduled("a", 0, len(toks), [0, 1, 2, 3], True)])
    assert [len(s.keys) for s in first.saves] == [3]
    assert not p.build([Scheduled("a", len(toks), 1, None, False)]).saves  # nothing new filled
    # another request with the same prompt: the blocks were just sent, none is sent again
    p.matched("b", toks, len(toks), None, 0)
    again = p.build([Scheduled("b", 0, len(toks), [5, 6, 7, 8], True)])
    assert not again.saves and p.counters.take()["blocks:save_skipped"] == 3


def test_decode_tokens_fill_blocks_that_are_saved() -> None:
    d = FakeDaemon()
    toks = list(range(BS + 2))
    p = planner(d)
    p.matched("a", toks, len(toks), None, 0)
    assert [len(s.keys) for s in p.build([Scheduled("a", 0, len(toks), [0, 1], True)]).saves] == [1]
    toks += [7, 7]  # vLLM's live token list grows with the outputs
    out = p.build([Scheduled("a", len(toks) - 1, 1, None, False)])
    assert [s.block_ids for s in out.saves] == [[1]]


def test_a_load_that_fell_short_is_saved_again_once_recomputed() -> None:
    p, toks, keys = loading(4)
    # block 1 was corrupt (deleted by the worker); blocks 2 and 3 were never read
    p.report(TierKVWorkerMetadata(loads=[LoadOutcome("r", 1, 4, ["cpu"], 0.01, 1 << 20, "corrupt", [keys[1]])]))
    assert not any(k in p.known for k in keys[1:]) and keys[0] in p.known
    out = p.build([Scheduled("r", BS, len(toks) - BS, None, False)])  # vLLM recomputes from block 1
    assert [s.keys for s in out.saves] == [keys[1:4]]


def test_worker_steps_calibrate_the_prefill_model_and_loads_the_tiers() -> None:
    d = FakeDaemon()
    p = planner(d, min_prefill_samples=3)
    assert p.calibrator.model is None
    steps = [([(n, 0)], 1e-3 + 2e-5 * n) for n in (64, 128, 256, 512)]
    p.report(TierKVWorkerMetadata(steps=steps))
    m = p.calibrator.model
    assert m is not None and abs(m.b - 2e-5) / 2e-5 < 0.2
    p.report(TierKVWorkerMetadata(loads=[LoadOutcome("x", 2, 2, ["cpu", "cpu"], 0.002, 2 << 20)]))
    assert p.cost.tiers["cpu"].measured == 1


def test_calibrated_decision_recomputes_when_loading_costs_more() -> None:
    d = FakeDaemon()
    toks = list(range(3 * BS + 1))
    d.held = set(SPACE.keys(toks, None))
    p = planner(d, min_prefill_samples=2)
    # prefill is nearly free and the tier is very slow: recompute
    p.report(TierKVWorkerMetadata(steps=[([(n, 0)], 1e-4 + 1e-9 * n) for n in (64, 128, 256)]))
    p.report(TierKVWorkerMetadata(loads=[LoadOutcome("x", 1, 1, ["cpu"], 5.0, 1 << 20)]))
    assert p.matched("r", toks, len(toks), None, 0) == (0, False)
    assert p.counters.take().get("decisions:recompute") == 1


def test_a_request_whose_load_fell_short_is_never_loaded_again() -> None:
    """vLLM reschedules it and asks again: another load of the same blocks would fail the same way."""
    p, toks, keys = loading(3)
    p.report(TierKVWorkerMetadata(loads=[LoadOutcome("r", 0, 3, [], 0.01, 0, "corrupt", [keys[0]])]))
    assert p.matched("r", toks, len(toks), None, 0) == (0, False)
    assert p.build([]).loads == []


def _calibrated(per_token_s: float, tier_s_per_mib: float, **extra: object) -> tuple[Planner, list[int]]:
    d = FakeDaemon()
    toks = list(range(3 * BS + 1))
    d.held = set(SPACE.keys(toks, None))
    p = planner(d, min_prefill_samples=2, **extra)
    p.report(TierKVWorkerMetadata(steps=[([(n, 0)], 1e-3 + per_token_s * n) for n in (64, 128, 256)]))
    p.report(TierKVWorkerMetadata(loads=[LoadOutcome("x", 1, 1, ["cpu"], tier_s_per_mib, 1 << 20)]))
    return p, toks


def test_a_small_fast_load_runs_in_the_step_with_its_own_short_deadline() -> None:
    p, toks = _calibrated(1e-2, 1e-3)  # 3 blocks of 1 MiB at ~1 GB/s: ~3 ms, well under 50 ms
    assert p.matched("r", toks, len(toks), None, 0) == (3 * BS, False)  # (n, False): vLLM schedules it now
    p.allocated("r", [0, 1, 2, 3], 3 * BS)
    (spec,) = p.build([Scheduled("r", 3 * BS, 1, [0, 1, 2, 3], True)]).loads
    assert spec.sync and spec.deadline_s == p.cfg.sync_load_deadline_s == 0.2


def test_a_slow_load_or_sync_off_stays_asynchronous() -> None:
    p, toks = _calibrated(1e-1, 0.1)  # ~0.3 s to load, more to recompute: load, asynchronously
    assert p.matched("r", toks, len(toks), None, 0) == (3 * BS, True)
    p.allocated("r", [0, 1, 2, 3], 3 * BS)
    (spec,) = p.build([]).loads
    assert not spec.sync and spec.deadline_s >= p.cfg.load_deadline_min_s
    q, toks = _calibrated(1e-2, 1e-3, sync_load_max_s=0)
    assert q.matched("r", toks, len(toks), None, 0) == (3 * BS, True)
