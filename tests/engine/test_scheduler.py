"""Scheduler, sampling and stop rules on a tiny random Llama (fast)."""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.errors import InvalidRequestError, PromptTooLongError
from engine.forward_batch import ForwardBatch
from engine.sampling import SamplingParams, sample
from tests.fixtures_engine import make_engine


@pytest.fixture
def eng(tiny):
    return make_engine(tiny, max_prefill_tokens=64, num_threads=0)


def _prompt(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, 40000, (n,), generator=g).tolist()


def test_prompt_too_long_for_pool_is_refused_before_anything_is_held(eng):
    with pytest.raises(PromptTooLongError, match="KV pool"):
        eng.add_request(_prompt(64 * 16), SamplingParams(max_tokens=4))
    assert eng.pool.allocator.num_free() == eng.pool.num_pages
    assert not eng.has_unfinished()


def test_prompt_too_long_for_model_context(tiny):
    e = LLMEngine(EngineConfig(num_pages=64, max_model_len=100), loaded=tiny)
    with pytest.raises(PromptTooLongError, match="context length"):
        e.add_request(_prompt(90), SamplingParams(max_tokens=20))


@pytest.mark.parametrize("bad", [dict(max_tokens=0), dict(temperature=-0.5), dict(top_p=0.0), dict(top_k=-1),
                                 dict(stop=("",))])
def test_bad_sampling_params(bad):
    with pytest.raises(InvalidRequestError):
        SamplingParams(**bad)


def test_empty_and_out_of_vocab_prompts(eng):
    with pytest.raises(InvalidRequestError):
        eng.add_request([], SamplingParams())
    with pytest.raises(InvalidRequestError):
        eng.add_request([49152], SamplingParams())


def test_abort_frees_pages(eng):
    rid = eng.add_request(_prompt(100), SamplingParams(max_tokens=50, ignore_eos=True))
    eng.step()
    eng.step()
    assert eng.pool.allocator.num_used() > 0
    eng.abort(rid)
    assert not eng.has_unfinished()
    # what remains in use is owned by the radix cache (reusable, evictable), nothing by the request
    assert eng.pool.allocator.num_used() == eng.radix.total_pages()
    eng.radix.evict(10**6)
    assert eng.pool.allocator.num_free() == eng.pool.num_pages
    eng.pool.allocator.check_integrity()


def test_batch_equals_one_by_one(eng, tiny):
    prompts = [_prompt(n, seed=n) for n in (5, 17, 33, 70)]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    together = [r.output_ids for r in eng.generate(prompts, params)]
    alone = [LLMEngine(EngineConfig(num_pages=64), loaded=tiny).generate([p], params)[0].output_ids
             for p in prompts]
    assert together == alone


def test_continuous_batching_decodes_together(eng):
    for i in range(4):
        eng.add_request(_prompt(20, seed=i), SamplingParams(max_tokens=6, ignore_eos=True))
    sampled_per_step = []
    while eng.has_unfinished():
        sampled_per_step.append(len(eng.step()))
    assert max(sampled_per_step) == 4  # all four sampled in the same step


def test_chunked_prefill_respects_budget(tiny):
    e = LLMEngine(EngineConfig(num_pages=64, max_prefill_tokens=16), loaded=tiny)
    e.add_request(_prompt(100), SamplingParams(max_tokens=2, ignore_eos=True))
    plan = e.scheduler.schedule()
    assert sum(n for _, n in plan) <= 16


def test_preemption_happens_and_recovers(tiny):
    e = LLMEngine(EngineConfig(num_pages=8, max_prefill_tokens=64), loaded=tiny)
    prompts = [_prompt(30, seed=i) for i in range(4)]
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    got = [r.output_ids for r in e.generate(prompts, params)]
    assert e.scheduler.num_preemptions > 0
    ref = [LLMEngine(EngineConfig(num_pages=64), loaded=tiny).generate([p], params)[0].output_ids for p in prompts]
    assert got == ref
    e.radix.check_integrity()
    e.pool.allocator.check_integrity()


def test_seeded_sampling_is_reproducible_and_top_k_1_is_greedy(eng):
    p = _prompt(12)
    s = SamplingParams(max_tokens=10, temperature=1.0, seed=7, ignore_eos=True)
    a = eng.generate([p], s)[0].output_ids
    b = eng.generate([p], s)[0].output_ids
    assert a == b
    k1 = eng.generate([p], SamplingParams(max_tokens=10, temperature=1.0, top_k=1, seed=3, ignore_eos=True))
    greedy = eng.generate([p], SamplingParams(max_tokens=10, ignore_eos=True))
    assert k1[0].output_ids == greedy[0].output_ids


def test_top_p_keeps_only_the_nucleus():
    logits = torch.tensor([5.0, 4.0, -10.0, -10.0])
    params = SamplingParams(temperature=1.0, top_p=0.5)
    g = torch.Generator().manual_seed(0)
    assert {sample(logits, params, g) for _ in range(50)} == {0}


def test_stop_token_ids_and_max_tokens(eng):
    p = _prompt(10)
    free = eng.generate([p], SamplingParams(max_tokens=6, ignore_eos=True))[0]
    assert free.finish_reason == "length" and len(free.output_ids) == 6
    stop_at = free.output_ids[2]
    r = eng.generate([p], SamplingParams(max_tokens=6, ignore_eos=True, stop_token_ids=(stop_at,)))[0]
    assert r.finish_reason == "stop" and r.output_ids[-1] == stop_at
    assert len(r.output_ids) == free.output_ids.index(stop_at) + 1


def test_logits_only_where_needed(eng):
    b = ForwardBatch.build([([1, 2, 3], 0, [0]), ([4, 5], 0, [1])], 16, torch.device("cpu"), logits=[False, True])
    assert b.logit_indices.tolist() == [4]
