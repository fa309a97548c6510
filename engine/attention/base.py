"""The one interface every attention backend implements."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from engine.forward_batch import ForwardBatch
from engine.kv_pool import KVPool


class AttentionBackend(ABC):
    name = "base"

    @abstractmethod
    def prepare(self, batch: ForwardBatch, pool: KVPool, num_heads: int) -> None:
        """Build per-batch metadata once (index tensors, masks, plans); shared by all layers."""

    @abstractmethod
    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                batch: ForwardBatch, pool: KVPool) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] (new tokens, already RoPE'd and written to the pool).

        Returns attention output [T, Hq, D]: each new token attends to its sequence's positions
        0 .. its own position (exact causal mask)."""
