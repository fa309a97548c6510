"""The block the connector actually puts for the engine's default model, computed from the engine's
own configuration (no weights loaded): one KV pool page, [layers, 2, page_size, kv_heads, head_dim]
in the pool's dtype (fp32 on CPU), encoded with the connector's layout. For the bundled
SmolLM2-135M: 30 layers x 2 x 16 tokens x 3 heads x 64 x 4 bytes = 720 KiB of payload.

bench.tiers.daemon compares the daemon with Redis at this size (issue 23: until then 4 MiB daemon
blocks against 0.5-2 MB Redis values)."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class EngineBlock(NamedTuple):
    model: str
    shape: tuple[int, ...]  # [layers, 2, page_size, kv_heads, head_dim]
    dtype: str  # numpy name
    payload_bytes: int


def engine_block(model: str = "") -> EngineBlock:
    """One page of ``model`` (default: the bundled one) as ``EngineConfig``'s defaults size it."""
    import torch
    from transformers import AutoConfig

    from engine.config import EngineConfig
    from engine.model_loader import _arch_from_config, resolve

    directory, _ = resolve(model)
    arch = _arch_from_config(AutoConfig.from_pretrained(directory), None)
    cfg = EngineConfig(model=model)
    if cfg.dtype not in ("auto", "float32"):
        raise ValueError(f"the bench models the CPU engine (fp32), not dtype {cfg.dtype!r}")
    shape = (arch.num_layers, 2, cfg.page_size, arch.num_kv_heads, arch.head_dim)
    return EngineBlock(model or "SmolLM2-135M-Instruct (bundled)", shape, "float32",
                       arch.kv_bytes_per_token(torch.float32) * cfg.page_size)


def encoded_blocks(spec: EngineBlock, n: int, seed: int = 0, tag: int = 0) -> list[tuple[bytes, bytes]]:
    """``n`` random blocks of ``spec`` under 16-byte keys, encoded as the connector encodes a page."""
    from connector.offload import LAYOUT
    from kvstore.block import encode_block

    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        key = (tag << 32 | i).to_bytes(8, "little") + rng.bytes(8)
        arr = rng.integers(0, 2**31, size=int(np.prod(spec.shape)), dtype=np.int32).view(np.float32).reshape(spec.shape)
        out.append((key, encode_block(key, arr, layout=LAYOUT)))
    return out
