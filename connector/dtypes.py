"""The one map between the engine's torch KV dtypes and kvstore block dtypes.

A block records a numpy dtype string (kvstore/block.py). bfloat16 has no numpy dtype, so it travels
as opaque 16-bit words (``|V2``, encoded with dtype="bfloat16"); every other KV dtype is its numpy
twin. Pages (offload.py, calibrate.py) and CacheBlend chunks (blend/daemon_store.py) both go
through here; the loader checks incoming blocks against ``block_dtype``.
"""

from __future__ import annotations

import numpy as np
import torch

_RAW16 = np.dtype("V2")


def block_dtype(dtype: torch.dtype) -> str:
    """The dtype string a block of ``dtype`` KV carries."""
    if dtype == torch.bfloat16:
        return _RAW16.str
    return np.dtype(str(dtype).removeprefix("torch.")).str


def to_block_array(t: torch.Tensor) -> tuple[np.ndarray, str]:
    """A CPU tensor as (numpy array, ``encode_block`` dtype argument); a view where possible."""
    t = t.detach().to("cpu").contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy(), "bfloat16"
    a = t.numpy()
    return a, a.dtype.str


def from_block_array(a: np.ndarray) -> torch.Tensor:
    """A block's array as a tensor owning its memory (the block's view dies with the call)."""
    if a.dtype == _RAW16:
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(np.array(a))
