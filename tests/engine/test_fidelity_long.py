"""Greedy output of our engine == HF transformers at the lengths we quote speed for: 20 prompts
(a few tokens up to ~2k), 32 new tokens each, all in flight together, and a mixed-length batch
of 8 that prefills in one step and decodes as one bs=8 batch (fp32, CPU).

HF checks the engine's tokens teacher-forced: one HF forward over prompt + the engine's 32 tokens,
and at every position HF's argmax must be the engine's next token. That is HF's greedy decision
at each step given the same prefix, so by induction HF's greedy generation is those 32 tokens;
it costs one forward per prompt instead of 32 HF decode steps (which took > 5 minutes for these
prompts on a busy 2-core box). EOS is ignored (engine: ignore_eos), so every prompt produces all
32 tokens instead of stopping early on an easy chat answer.
"""

from __future__ import annotations

import pytest
import torch

from bench.blend.data import fact_pool
from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.sampling import SamplingParams

pytestmark = pytest.mark.slow

N_NEW = 32
CHAT = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
SHORT = [
    "The capital of France is",
    "def quicksort(xs):",
    "1, 1, 2, 3, 5, 8, 13,",
    "Once upon a time, in a village by the sea,",
    CHAT.format("What is the boiling point of water at sea level?"),
    CHAT.format("Write a haiku about autumn leaves."),
    "import numpy as np\n\ndef moving_average(x, w):\n    ",
    "The mitochondria is the powerhouse of the cell. " * 6 + "In summary,",
    "Translate to French: I would like a cup of coffee, please.\nFrench:",
    CHAT.format("List three uses of copper and explain each in one sentence. Be concise but specific."),
    "SELECT name, COUNT(*) FROM orders JOIN customers ON orders.customer_id = customers.id GROUP BY",
    "Q: If a train travels 60 km in 45 minutes, what is its speed in km/h?\nA:",
    "<html>\n<head>\n<title>My page</title>\n</head>\n<body>\n",
    " ".join(f"Item {i}: a {c} box." for i, c in enumerate(["red", "blue", "green", "small", "heavy"] * 8)),
    "Dear committee,\n\nI am writing to apply for the position of",
    CHAT.format("Summarise the plot of Hamlet in two sentences."),
    "The quick brown fox jumps over the lazy dog. " * 20 + "The quick",
    "Photosynthesis converts light energy into chemical energy. The process takes place in",
    "Rust's borrow checker enforces that",
]


@pytest.fixture(scope="module")
def prompts(smollm) -> list[list[int]]:
    tok = smollm.tokenizer
    docs, bank = fact_pool(tok, 12, seed=5, lo=180, hi=200)
    long = CHAT.format("Documents:\n" + "\n\n".join(docs[:10]) + "\n\nQuestion: " + bank[0][0])
    out = [tok(p)["input_ids"] for p in SHORT] + [tok(long)["input_ids"]]
    assert 1800 <= len(out[-1]) <= 2300, len(out[-1])
    return out


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Hundreds of small ops per generated token: with 2 threads on a busy 2-core box every op
    waits for a descheduled thread, so one thread."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def hf_divergence(hf, prompt: list[int], out: list[int]) -> int | None:
    """First i where HF's greedy token after prompt + out[:i] is not out[i]; None if all agree."""
    with torch.inference_mode():
        logits = hf(torch.tensor([prompt + out[:-1]])).logits[0, len(prompt) - 1 :]
    want = logits.argmax(-1).tolist()
    return next((i for i, (a, b) in enumerate(zip(want, out, strict=True)) if a != b), None)


PARAMS = SamplingParams(max_tokens=N_NEW, ignore_eos=True)


def test_twenty_prompts_up_to_2k_tokens(smollm, hf_smollm, prompts):
    assert len(prompts) >= 20 and max(map(len, prompts)) >= 1800
    # unchunked, as it was written against (the default step budget is now 128: test_fidelity chunks)
    eng = LLMEngine(EngineConfig(num_pages=600, device="cpu", max_prefill_tokens=2048), loaded=smollm)
    outs = [r.output_ids for r in eng.generate(prompts, PARAMS)]
    assert all(len(o) == N_NEW for o in outs)
    bad = {i: d for i, (p, o) in enumerate(zip(prompts, outs, strict=True))
           if (d := hf_divergence(hf_smollm, p, o)) is not None}
    assert not bad, f"prompt -> first token where HF's greedy choice differs: {bad}"


def test_mixed_length_batch_of_eight(smollm, hf_smollm, prompts):
    short = sorted(prompts[:-1], key=len)
    batch = [short[i] for i in (0, 3, 6, 9, 12, 15, 17, 18)]  # 8 distinct lengths: a few tokens to ~300
    assert len({len(p) for p in batch}) == 8 and len(batch[-1]) >= 100
    eng = LLMEngine(EngineConfig(num_pages=200, device="cpu", max_num_seqs=8, max_prefill_tokens=4096),
                    loaded=smollm)
    reqs = [eng.requests[eng.add_request(p, PARAMS)] for p in batch]
    steps = 0
    while eng.has_unfinished():
        eng.step()
        steps += 1
    outs = [r.output_ids for r in reqs]
    # one step prefills all eight (and samples their first tokens); every other step decodes all
    # eight together: any smaller batch would take more steps
    assert steps == N_NEW
    bad = {len(p): d for p, o in zip(batch, outs, strict=True) if (d := hf_divergence(hf_smollm, p, o)) is not None}
    assert not bad, f"prompt length -> first token where HF's greedy choice differs: {bad}"
