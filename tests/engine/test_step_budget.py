"""Another tenant's prompts add at most ``cross_tenant_step_share`` of a decode-only step to a step
in which a tenant's requests decode, or whose first prompt is the tenant's (engine/step_budget.py);
a tenant's own prompts, and an engine of one tenant, keep the whole ``max_prefill_tokens``. Prompts
are fed in a fair order: a tenant's one request does not queue behind another tenant's many
(engine/scheduler.py ``fair``)."""

from __future__ import annotations

import math

import pytest
import torch

from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.request import Request
from engine.sampling import SamplingParams
from engine.scheduler import fair, tenant_demand
from engine.step_budget import StepBudget, StepCost
from engine.tenancy import scoped_salt


def _prompt(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, 40000, (n,), generator=g).tolist()


def _req(tenant: str) -> Request:
    return Request("r", [1, 2, 3], SamplingParams(), cache_salt=scoped_salt(tenant, "s"))


def test_budget_bounds_only_prompts_of_other_tenants_than_the_decoding_ones() -> None:
    b = StepBudget(100, 8, ["alice"])
    bob, alice = _req("bob"), _req("alice")
    assert b.is_cross(bob) and not b.is_cross(alice)
    assert b.allows(bob) == 8 and b.allows(alice) == 100
    b.take(bob, 5)
    assert b.allows(bob) == 3 and b.allows(alice) == 95
    b.take(alice, 90)
    assert b.allows(bob) == 3 and b.allows(alice) == 5  # the whole budget bounds both
    b.take(bob, 3)
    assert b.allows(bob) == 0


def test_fair_order_puts_a_tenant_with_fewer_requests_first_and_leaves_one_tenant_alone() -> None:
    floods = [_req("flood") for _ in range(5)]
    normal = _req("normal")
    assert fair([*floods, normal], tenant_demand([*floods, normal])) == [normal, *floods]  # each tenant in arrival order
    assert fair([floods[3], floods[1]], tenant_demand(floods)) == [floods[3], floods[1]]  # one tenant: as given
    late = _req("late")
    assert fair([*floods[:2], late], tenant_demand([*floods, late])) == [late, *floods[:2]]


def test_no_decodes_no_bound_and_none_means_off() -> None:
    assert StepBudget(100, 8, []).allows(_req("bob")) == 100
    assert StepBudget(100, None, ["alice"]).allows(_req("bob")) == 100
    # with two tenants decoding, each one's prompts slow the other's stream: both are bounded
    b = StepBudget(100, 8, ["alice", "bob"])
    assert b.allows(_req("alice")) == 8 and b.allows(_req("bob")) == 8


def test_step_cost_learns_the_line_and_keeps_it_through_a_steady_load() -> None:
    c = StepCost()
    assert c.cross_tokens(0.5, 16) == 16  # nothing measured: the fallback
    for i in range(40):  # 40 ms a decode-only step, 2.5 ms a prompt token
        p = (0, 5, 12, 30)[i % 4]
        c.observe(p, 0.040 + 0.0025 * p)
    base, slope = c.fit()  # type: ignore[misc]
    assert abs(base - 0.040) < 1e-9 and abs(slope - 0.0025) < 1e-9
    assert c.cross_tokens(0.5, 16) == 8  # 0.5 x 40 ms / 2.5 ms
    for _ in range(300):  # one size only, old steps faded: the slope cannot be seen, the last one holds;
        c.observe(7, 0.060)  # these run 2.5 ms past it, which the bound takes off: (20 - 2.5) / 2.5 ms
    assert c.cross_tokens(0.5, 16) == 7
    for i in range(300):  # a faster machine (a GPU): prompt tokens nearly free, the bound opens up
        p = (0, 64, 128)[i % 3]
        c.observe(p, 0.005 + 0.00001 * p)
    assert c.cross_tokens(0.5, 16) >= 128


def test_small_steps_that_run_past_the_line_bring_the_bound_down_to_what_they_cost() -> None:
    """The line is learnt mostly from big steps; at a few tokens a CPU step also pays for going from
    one row to several. A stream's steps with another tenant's few tokens must stay within the
    share of a decode-only step with that counted, and one token still goes (the other tenant
    moves)."""
    c = StepCost()
    for i in range(40):  # big steps on the line: 36 ms + 3 ms a token
        p = (0, 40, 80, 128)[i % 4]
        c.observe(p, 0.036 + 0.003 * p)
    assert (c.cross_tokens(0.5, 16), c.cross_tokens(0.25, 16)) == (6, 3)  # 18 and 9 ms at 3 ms a token
    for _ in range(60):  # then a stream decodes with 3 of another tenant's tokens: 7.2 ms past the line
        c.observe(0, 0.036)
        c.observe(3, 0.036 + 0.0072 + 0.009)
        c.observe(128, 0.036 + 0.003 * 128)  # the other tenant alone between the stream's answers
    # (0.5 - 0.2) x 36 ms / ~3 ms a token, and (0.25 - 0.2) x 36 ms: under one token, one still goes;
    # the line alone gave 5 and 3
    assert (c.cross_tokens(0.5, 16), c.cross_tokens(0.25, 16)) == (3, 1)


def _teach(cost: StepCost, base_s: float = 0.040, token_s: float = 0.005) -> None:
    """Steps of a known line (by default 0.5 x 40 ms / 5 ms = 4 cross tokens a step)."""
    cost.__init__()  # type: ignore[misc]  # forget what the tiny model's real steps taught it
    for i in range(40):
        p = (0, 10, 20, 40)[i % 4]
        cost.observe(p, base_s + token_s * p)


def _engine(tiny, share: float) -> LLMEngine:
    return LLMEngine(EngineConfig(num_pages=256, max_prefill_tokens=64, cross_tenant_step_share=share), loaded=tiny)


def _flood_step(e: LLMEngine) -> dict[str, int]:
    """alice decodes; bob queues four 20-token prompts: prompt tokens per tenant in the next step."""
    e.add_request(_prompt(20, seed=1), SamplingParams(max_tokens=50, ignore_eos=True), cache_salt=scoped_salt("alice", None))
    e.step()  # alice's prefill: she decodes from now on
    _teach(e.scheduler.step_cost)
    for i in range(4):
        e.add_request(_prompt(20, seed=10 + i), SamplingParams(max_tokens=1, ignore_eos=True),
                      cache_salt=scoped_salt("bob", None))  # fmt: skip
    plan = e.scheduler.schedule()
    out: dict[str, int] = {}
    for r, n in plan:
        out[r.tenant] = out.get(r.tenant, 0) + n
    return out


def test_another_tenants_flood_takes_at_most_its_share_of_a_streams_step(tiny) -> None:
    assert _flood_step(_engine(tiny, 0.5)) == {"alice": 1, "bob": 4}
    assert _flood_step(_engine(tiny, 1.0)) == {"alice": 1, "bob": 8}
    assert _flood_step(_engine(tiny, 0.0)) == {"alice": 1, "bob": 63}  # unbounded: the whole budget


def test_a_tenant_asking_no_more_than_the_decoding_one_is_not_bounded_by_it(tiny) -> None:
    """alice decodes her one request; bob's one 20-token prompt asks no more of the engine than she
    does, and goes whole, as a second request of one tenant would. With a second prompt queued he
    asks more than she does, and his prompts are bounded by her stream."""
    got = []
    for n_bob in (1, 2):
        e = _engine(tiny, 0.5)
        e.add_request(_prompt(20, seed=1), SamplingParams(max_tokens=50, ignore_eos=True),
                      cache_salt=scoped_salt("alice", None))  # fmt: skip
        e.step()
        _teach(e.scheduler.step_cost)
        for i in range(n_bob):
            e.add_request(_prompt(20, seed=10 + i), SamplingParams(max_tokens=1, ignore_eos=True),
                          cache_salt=scoped_salt("bob", None))  # fmt: skip
        got.append({t: sum(n for r, n in e.scheduler.schedule() if r.tenant == t) for t in ("alice", "bob")})
    assert got == [{"alice": 1, "bob": 20}, {"alice": 1, "bob": 4}]


def test_a_tenants_one_request_goes_before_another_tenants_queue_and_bounds_it(tiny) -> None:
    """No one decodes; bob queued six 20-token prompts before alice's one. Without the fair order
    bob's took the step (alice's TTFT: behind his queue, then in a step of his prompts); without the
    first prompt's protection bob's filled the rest of her step."""
    got = {}
    for share in (0.5, 0.0):
        e = _engine(tiny, share)
        _teach(e.scheduler.step_cost)
        for i in range(6):
            e.add_request(_prompt(20, seed=10 + i), SamplingParams(max_tokens=1, ignore_eos=True),
                          cache_salt=scoped_salt("bob", None))  # fmt: skip
        e.add_request(_prompt(20, seed=1), SamplingParams(max_tokens=8, ignore_eos=True), cache_salt=scoped_salt("alice", None))
        plan = e.scheduler.schedule()
        assert plan[0][0].tenant == "alice"
        got[share] = {t: sum(n for r, n in plan if r.tenant == t) for t in ("alice", "bob")}
    assert got == {0.5: {"alice": 20, "bob": 4}, 0.0: {"alice": 20, "bob": 44}}


def test_another_tenants_running_prefill_is_bounded_when_a_tenant_with_fewer_requests_waits(tiny) -> None:
    """bob's 100-token prompt is half fed (a running prefill) and three more of his wait when alice's
    one arrives: his running prefill, fed before any admission, must not take alice's step."""
    e = _engine(tiny, 0.5)
    e.add_request(_prompt(100, seed=2), SamplingParams(max_tokens=1, ignore_eos=True), cache_salt=scoped_salt("bob", None))
    e.step()  # 64 of his 100 tokens
    _teach(e.scheduler.step_cost)
    for i in range(3):
        e.add_request(_prompt(20, seed=10 + i), SamplingParams(max_tokens=1, ignore_eos=True),
                      cache_salt=scoped_salt("bob", None))  # fmt: skip
    e.add_request(_prompt(20, seed=1), SamplingParams(max_tokens=8, ignore_eos=True), cache_salt=scoped_salt("alice", None))
    plan = e.scheduler.schedule()
    assert {t: sum(n for r, n in plan if r.tenant == t) for t in ("alice", "bob")} == {"alice": 20, "bob": 4}


def test_a_tenants_own_prompts_and_a_one_tenant_engine_keep_the_whole_budget(tiny) -> None:
    e = _engine(tiny, 0.5)
    e.add_request(_prompt(20, seed=1), SamplingParams(max_tokens=50, ignore_eos=True), cache_salt=scoped_salt("alice", None))
    e.step()
    _teach(e.scheduler.step_cost)
    for i in range(4):
        e.add_request(_prompt(20, seed=10 + i), SamplingParams(max_tokens=1, ignore_eos=True),
                      cache_salt=scoped_salt("alice", "other"))  # fmt: skip
    assert sum(n for _, n in e.scheduler.schedule()) == 64
    e = _engine(tiny, 0.5)  # no tenants (no API keys): as before
    e.add_request(_prompt(20, seed=1), SamplingParams(max_tokens=50, ignore_eos=True))
    e.step()
    _teach(e.scheduler.step_cost)
    for i in range(4):
        e.add_request(_prompt(20, seed=10 + i), SamplingParams(max_tokens=1, ignore_eos=True), cache_salt=f"s{i}")
    assert sum(n for _, n in e.scheduler.schedule()) == 64


def test_the_engine_learns_its_steps_and_bounded_prompts_answer_as_unbounded_ones(tiny) -> None:
    """From the engine's own steps only; chunked at the bound, bob's answers are the same tokens."""
    got = {}
    for share in (0.5, 0.0):
        e = _engine(tiny, share)
        a = e.add_request(_prompt(20, seed=1), SamplingParams(max_tokens=60, ignore_eos=True),
                          cache_salt=scoped_salt("alice", None))  # fmt: skip
        e.step()
        bobs = [e.add_request(_prompt(n, seed=10 + n), SamplingParams(max_tokens=3, ignore_eos=True),
                              cache_salt=scoped_salt("bob", None)) for n in (5, 12, 30, 50, 9, 21)]  # fmt: skip
        reqs = {rid: e.requests[rid] for rid in [a, *bobs]}
        while e.has_unfinished():
            e.step()
        got[share] = [r.output_ids for r in reqs.values()]
        if share:
            assert e.scheduler.step_cost.fit() is not None  # prompt sizes differed: a line was fitted
        e.radix.check_integrity()
        e.pool.allocator.check_integrity()
    assert got[0.5] == got[0.0]


def test_the_share_is_checked() -> None:
    for bad in (-0.1, math.inf, math.nan):
        with pytest.raises(ValueError, match="cross_tenant_step_share"):
            EngineConfig(num_pages=8, cross_tenant_step_share=bad)
