"""RoPE re-rotation of cached K, and the start-up self-check that refuses blending loudly.

``rerotate`` moves K from old to new positions by undoing the rotation at the old positions
and applying it at the new ones, both with the model's own cos/sin tables. That matches K
computed directly at the new positions to fp32 round-off (~1e-6) at any position; rotating by
the delta angle instead (engine.rope.Rotary.delta_rotate) drifts by up to ~5e-4 at position
8k because the tables round each absolute angle to fp32. V carries no position: unchanged.
"""

from __future__ import annotations

import logging

import torch

from connector.blend.errors import BlendUnsupportedError
from engine.model import LlamaModel
from engine.rope import Rotary

log = logging.getLogger(__name__)

SELF_CHECK_RTOL = 1e-5  # of max|K|, in fp32
_CHECK_OFFSETS = (1, 37, 1000, 4000)


def rerotate(rotary: Rotary, k: torch.Tensor, old_start: int, new_start: int) -> torch.Tensor:
    """K [n, heads, dim] rotated at positions old_start.. -> rotated at new_start.."""
    if old_start == new_start or k.shape[0] == 0:
        return k
    n = k.shape[0]
    old = torch.arange(old_start, old_start + n, device=k.device)
    cos_o, sin_o = rotary.cos_sin(old)
    cos_n, sin_n = rotary.cos_sin(old + (new_start - old_start))
    return rotary.rotate(rotary.rotate(k, cos_o, -sin_o), cos_n, sin_n)


@torch.inference_mode()
def self_check(model: LlamaModel, n: int = 48) -> float:
    """Re-rotated layer-0 K must match layer-0 K computed directly at the new positions.

    Returns the worst relative error; raises BlendUnsupportedError when it exceeds 1e-5 of
    max|K| (fp32), or when K does not depend on position at all (no RoPE applied)."""
    arch = model.arch
    gen = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, arch.vocab_size, (n,), generator=gen).to(model.device)
    h = model.embed[ids]
    base = torch.arange(1, n + 1, device=model.device)
    _, k_old, _ = model.qkv(0, h, base)
    # fp32: 1e-5 of max|K|; half precision: a few ulps of that dtype
    tol = SELF_CHECK_RTOL if model.dtype == torch.float32 else 8 * torch.finfo(model.dtype).eps
    worst = 0.0
    for off in _CHECK_OFFSETS:
        _, k_new, _ = model.qkv(0, h, base + off)
        scale = max(float(k_new.float().abs().max()), 1e-6)
        if float((k_new - k_old).float().abs().max()) <= tol * scale:
            raise BlendUnsupportedError(
                f"CacheBlend refused for {arch.model_type}: layer-0 K does not change with position "
                "(no rotary embedding applied?), so chunk KV cannot be re-positioned")
        k_rot = rerotate(model.rotary, k_old, 1, 1 + off)
        err = float((k_rot.float() - k_new.float()).abs().max()) / scale
        worst = max(worst, err)
        if err > tol:
            raise BlendUnsupportedError(
                f"CacheBlend refused for {arch.model_type}: re-rotated layer-0 K differs from K computed "
                f"at the new positions by {err:.2e} of max|K| (offset {off}, limit {tol:.0e}); "
                "this model's RoPE is not the rotate-half form the blender assumes")
    log.info("CacheBlend self-check passed (worst relative K error %.2e)", worst)
    return worst
