"""The paged KV pool: one tensor [layers, 2, num_pages, page_size, kv_heads, head_dim].

Page ``p`` of layer ``l`` holds K at ``pool[l, 0, p]`` and V at ``pool[l, 1, p]``. A token's
slot is ``page * page_size + offset``. The pool also copies whole pages out (for offload)
and in (for loads from the kvstore) as one contiguous block per page run.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.model_loader import ModelArch
from engine.page_allocator import PageAllocator


class KVPool:
    def __init__(self, arch: ModelArch, num_pages: int, page_size: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.arch = arch
        self.page_size = page_size
        self.num_pages = num_pages
        self.dtype = dtype
        self.device = device
        self.kv = torch.zeros(arch.num_layers, 2, num_pages, page_size, arch.num_kv_heads, arch.head_dim,
                              dtype=dtype, device=device)
        self.allocator = PageAllocator(num_pages)

    @staticmethod
    def pages_for_budget(arch: ModelArch, budget_bytes: int, page_size: int, dtype: torch.dtype) -> int:
        return max(1, budget_bytes // (arch.kv_bytes_per_token(dtype) * page_size))

    @property
    def bytes_per_page(self) -> int:
        return self.kv[:, :, 0].numel() * self.kv.element_size()

    def layer_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V caches of one layer, shaped [num_pages * page_size, kv_heads, head_dim]."""
        kv = self.kv[layer]
        return kv[0].view(-1, *kv.shape[-2:]), kv[1].view(-1, *kv.shape[-2:])

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        kc, vc = self.layer_kv(layer)
        kc.index_copy_(0, slots, k)
        vc.index_copy_(0, slots, v)

    def read_pages(self, pages: Sequence[int]) -> torch.Tensor:
        """Copy pages out: [n, layers, 2, page_size, kv_heads, head_dim] on CPU (one block per page)."""
        idx = torch.as_tensor(list(pages), dtype=torch.long, device=self.device)
        out = self.kv.index_select(2, idx)  # [L, 2, n, P, H, D]
        return out.permute(2, 0, 1, 3, 4, 5).contiguous().cpu()

    def write_pages(self, pages: Sequence[int], blocks: torch.Tensor) -> None:
        """Inverse of read_pages: blocks [n, layers, 2, page_size, kv_heads, head_dim]."""
        idx = torch.as_tensor(list(pages), dtype=torch.long, device=self.device)
        self.kv.index_copy_(2, idx, blocks.to(self.device, self.dtype).permute(1, 2, 0, 3, 4, 5))

    def block_shape(self) -> tuple[int, ...]:
        a = self.arch
        return (a.num_layers, 2, self.page_size, a.num_kv_heads, a.head_dim)

    def usage(self) -> float:
        return self.allocator.num_used() / self.num_pages
