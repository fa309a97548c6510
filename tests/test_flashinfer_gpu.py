"""The flashinfer backend against the torch reference backend (needs CUDA + flashinfer)."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.sampling import SamplingParams

pytestmark = pytest.mark.gpu


def test_flashinfer_matches_torch_backend(tiny):
    pytest.importorskip("flashinfer")
    prompts = [list(range(100, 100 + n)) for n in (7, 40, 130)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    outs = {}
    for backend in ("torch", "flashinfer"):
        e = LLMEngine(EngineConfig(num_pages=128, device="cuda", dtype="float32", attention_backend=backend),
                      loaded=tiny)
        first = [r.output_ids for r in e.generate(prompts, params)]
        again = [r.output_ids for r in e.generate(prompts, params)]  # radix hits: paged prefix + causal mask
        assert first == again
        outs[backend] = first
    assert outs["torch"] == outs["flashinfer"]
