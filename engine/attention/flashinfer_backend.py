"""flashinfer attention over the paged pool (CUDA only).

One BatchPrefillWithPagedKVCacheWrapper plan per forward pass covers prefill chunks and decode
tokens alike (a decode token is a query of length 1); flashinfer's causal mask is aligned
bottom-right, i.e. the exact "key position <= query position" rule for queries that follow a
cached prefix. The pool's per-layer K and V views ([num_pages, page_size, H, D], "NHD") are
passed as a (k, v) tuple, so no copy is made.
"""

from __future__ import annotations

import flashinfer  # noqa: E402  (ImportError is the signal select_backend uses)
import torch

from engine.attention.base import AttentionBackend
from engine.forward_batch import ForwardBatch
from engine.kv_pool import KVPool


class FlashInferBackend(AttentionBackend):
    name = "flashinfer"

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.workspace = torch.empty(256 * 1024 * 1024, dtype=torch.uint8, device=device)
        self.wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")

    def prepare(self, batch: ForwardBatch, pool: KVPool, num_heads: int) -> None:
        ps = pool.page_size
        qo, kv_indptr, indices, last = [0], [0], [], []
        for s in batch.seqs:
            n_pages = (s.kv_len + ps - 1) // ps
            qo.append(qo[-1] + s.q_len)
            indices.extend(s.pages[:n_pages])
            kv_indptr.append(kv_indptr[-1] + n_pages)
            last.append(s.kv_len - (n_pages - 1) * ps)
        i32 = lambda x: torch.tensor(x, dtype=torch.int32, device=self.device)  # noqa: E731
        a = pool.arch
        self.wrapper.plan(i32(qo), i32(kv_indptr), i32(indices), i32(last), num_heads, a.num_kv_heads,
                          a.head_dim, ps, causal=True, q_data_type=pool.dtype, kv_data_type=pool.dtype)
        batch.attn_meta = True

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                batch: ForwardBatch, pool: KVPool) -> torch.Tensor:
        kv = pool.kv[layer]
        return self.wrapper.run(q.contiguous(), (kv[0], kv[1]))
