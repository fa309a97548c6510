"""Greedy output of our engine == HF transformers generate on SmolLM2 (fp32, CPU).

Covers a batch of mixed lengths, radix hits, chunked prefill forced small, and preemption.
"""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.sampling import SamplingParams

pytestmark = pytest.mark.slow

SHARED = ("You are a careful assistant. Answer briefly and precisely. The user is asking about "
          "geography, history and cooking. Keep every answer under two sentences. ")
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    SHARED + "Question: what is the tallest mountain in the world? Answer:",
    SHARED + "Question: how do I boil an egg? Answer:",
    "Once upon a time, " * 12 + "the end. Then",
    "1, 2, 3, 4, 5,",
]
N_NEW = 12


@pytest.fixture(scope="module")
def reference(smollm, hf_smollm):
    refs = []
    for p in PROMPTS:
        ids = smollm.tokenizer(p)["input_ids"]
        with torch.inference_mode():
            out = hf_smollm.generate(torch.tensor([ids]), max_new_tokens=N_NEW, do_sample=False,
                                     pad_token_id=2)
        refs.append(out[0, len(ids):].tolist())
    return refs


def _run(engine: LLMEngine, prompts=PROMPTS):
    params = SamplingParams(max_tokens=N_NEW)
    return [r.output_ids for r in engine.generate(prompts, params)]


def test_batch_of_mixed_lengths(smollm, reference):
    eng = LLMEngine(EngineConfig(num_pages=256), loaded=smollm)
    assert _run(eng) == reference


def test_with_radix_hits(smollm, reference):
    eng = LLMEngine(EngineConfig(num_pages=256), loaded=smollm)
    _run(eng, PROMPTS[2:3])  # warms the shared system prefix
    hit_before = eng.radix.tokens_hit
    assert _run(eng) == reference
    assert eng.radix.tokens_hit - hit_before >= 32, "the second pass must reuse the shared prefix"


def test_chunked_prefill_forced_small(smollm, reference):
    eng = LLMEngine(EngineConfig(num_pages=256, max_prefill_tokens=16), loaded=smollm)
    steps = 0
    step = eng.step

    def counted():
        nonlocal steps
        steps += 1
        return step()

    eng.step = counted  # type: ignore[method-assign]
    assert _run(eng) == reference
    assert steps > N_NEW + 4  # prompts really were split across steps


def test_after_preemption(smollm, reference):
    # 12 pages of 16 tokens: not enough for all six requests to decode at once
    eng = LLMEngine(EngineConfig(num_pages=12, max_prefill_tokens=64), loaded=smollm)
    assert _run(eng) == reference
    assert eng.scheduler.num_preemptions > 0
    eng.pool.allocator.check_integrity()
    eng.radix.check_integrity()
