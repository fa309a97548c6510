"""Model fixtures: the real SmolLM2 (loaded once per session) and a tiny random Llama.

The tiny model is a real HF directory (random weights, SmolLM2's tokenizer) so tests of the
scheduler, server and connector run in milliseconds per step through the same loading path.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine.model_loader import LoadedModel, hf_model_dir, load_model


@pytest.fixture(scope="session")
def smollm() -> LoadedModel:
    torch.set_num_threads(2)
    return load_model("")


@pytest.fixture(scope="session")
def hf_smollm():
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_model_dir(""), dtype=torch.float32)
    model.eval()
    return model


def make_tiny_llama(dest: Path, layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2,
                    seed: int = 0) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    src = hf_model_dir("")
    tok_files = [p for p in src.iterdir() if p.name.startswith(("tokenizer", "special_tokens"))]
    cfg = LlamaConfig(vocab_size=49152, hidden_size=hidden, intermediate_size=hidden * 2,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      max_position_embeddings=4096, rope_theta=10000.0, tie_word_embeddings=True,
                      bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # larger weights than the init default: sharper, less tie-prone logits
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
    dest.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(dest)
    for f in tok_files:
        shutil.copy(f, dest / f.name)
    return dest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny(tiny_model_dir) -> LoadedModel:
    return load_model(str(tiny_model_dir))


@pytest.fixture(scope="session")
def tiny4_loaded(tmp_path_factory) -> LoadedModel:
    """A 4-layer tiny Llama (seed 3): layers >= 2 exist, so CacheBlend's selective recompute really
    happens (with 2 layers it would recompute everything). Shared by the blend tests."""
    return load_model(str(make_tiny_llama(tmp_path_factory.mktemp("tiny4"), layers=4, seed=3)))


@pytest.fixture
def one_thread() -> Iterator[None]:
    """torch on one thread for the test (exactness tests compare kernels run at one width)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
