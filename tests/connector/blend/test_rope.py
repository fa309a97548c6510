"""RoPE re-rotation for CacheBlend: exact against direct computation; the self-check refuses loudly."""

from __future__ import annotations

import pytest
import torch

from connector.blend import Blender, BlendUnsupportedError, rerotate, self_check
from engine.model import LlamaModel


@pytest.fixture(scope="module")
def small(smollm) -> LlamaModel:
    return LlamaModel(smollm.arch, smollm.weights, torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("offset", [1, 7, 300, 2500, -1])
def test_rerotated_k_matches_direct(small, offset):
    ids = torch.arange(2000, 2064)
    h = small.embed[ids]
    old = torch.arange(1, 65)
    _, k_old, _ = small.qkv(0, h, old)
    _, k_new, _ = small.qkv(0, h, old + offset)
    k = rerotate(small.rotary, k_old, 1, 1 + offset)
    assert (k - k_new).abs().max() <= 1e-5 * k_new.abs().max()


def test_engine_delta_rotation_matches_at_small_offsets(small):
    ids = torch.arange(100, 132)
    h = small.embed[ids]
    pos = torch.arange(1, 33)
    _, k_old, _ = small.qkv(0, h, pos)
    _, k_new, _ = small.qkv(0, h, pos + 20)
    k = small.rotary.delta_rotate(k_old, torch.full((32,), 20))
    assert (k - k_new).abs().max() <= 1e-5 * k_new.abs().max()


def test_self_check_passes_on_smollm(small):
    assert self_check(small) < 1e-5


def test_self_check_refuses_broken_rotary(small, monkeypatch, smollm):
    real = small.rotary.apply

    def broken(q, k, positions):  # e.g. an interleaved RoPE variant: positions scaled differently
        return real(q, k, positions * 2)

    monkeypatch.setattr(small.rotary, "apply", broken)
    with pytest.raises(BlendUnsupportedError, match="refused"):
        self_check(small)
    with pytest.raises(BlendUnsupportedError):
        Blender(small, smollm.fingerprint)  # construction refuses: never a silent no-op


def test_self_check_refuses_missing_rotary(small, monkeypatch):
    monkeypatch.setattr(small.rotary, "apply", lambda q, k, positions: (q, k))
    with pytest.raises(BlendUnsupportedError, match="does not change with position"):
        self_check(small)
