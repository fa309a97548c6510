"""CacheBlend's re-rotation of cached K as a native op (csrc/rope.c), the torch version as fallback.

``rerotate(K, tables)`` moves K ``[layers, tokens, heads, dim]`` from its chunk positions to its
prompt positions with the four per-token tables ``Blender._rotation`` builds (undo: cos, -sin
at the old position; redo: cos, sin at the new one; [tokens, 1, dim] each). The torch version
is two ``Rotary.rotate`` calls over the whole tensor; the native one rewrites K in place in one
pass, with the same fp32 operations in the same order on the same table entries, so the two
agree bit for bit (tests/connector/native/test_rope.py). Only fp32 host tensors take the native op;
anything else (bf16, an accelerator, a strided K) takes torch.
"""

from __future__ import annotations

import torch

from connector import native_lib
from connector.native import THREAD_MIN_BYTES, default_threads
from engine.rope import Rotary

Tables = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def rerotate_torch(k: torch.Tensor, tables: Tables) -> torch.Tensor:
    """The reference: a new tensor (what connector/blend/blender.py computed before)."""
    rotate = Rotary.rotate
    return rotate(rotate(k, tables[0], tables[1]), tables[2], tables[3])


def _check(k: torch.Tensor, tables: Tables) -> None:
    if k.dim() != 4 or k.shape[-1] % 2:
        raise ValueError(f"K must be [layers, tokens, heads, even dim], got {tuple(k.shape)}")
    if len(tables) != 4:
        raise ValueError(f"4 rotation tables expected, got {len(tables)}")
    want = (k.shape[1], 1, k.shape[3])
    for i, t in enumerate(tables):
        if tuple(t.shape) != want:
            raise ValueError(f"table {i} has shape {tuple(t.shape)}, expected {want}")


def rerotate(k: torch.Tensor, tables: Tables, use_native: bool | None = None,
             threads: int | None = None) -> torch.Tensor:
    """K re-rotated with ``tables``: K itself, rotated in place, on the native path; a new
    tensor from torch otherwise. Raises ValueError on shapes that do not fit together."""
    _check(k, tables)
    if threads is not None and threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    lib, reason = native_lib.load()
    if use_native and lib is None:
        raise RuntimeError(f"native ops unavailable: {reason}")
    usable = lib is not None and use_native is not False and k.dtype == torch.float32 \
        and k.device.type == "cpu" and k.is_contiguous() \
        and all(t.dtype == torch.float32 and t.device.type == "cpu" for t in tables)
    if not usable:
        if use_native:
            raise RuntimeError("native re-rotation needs fp32 host tensors and a contiguous K")
        return rerotate_torch(k, tables)
    layers, n, heads, dim = k.shape
    flat = [t.reshape(n, dim).contiguous() for t in tables]  # small: [tokens, dim]
    if threads is None:
        threads = default_threads() if k.numel() * 4 >= THREAD_MIN_BYTES else 1
    lib.tkv_rerotate_f32(k.data_ptr(), layers, n, heads, dim // 2, *(t.data_ptr() for t in flat), threads)
    return k
