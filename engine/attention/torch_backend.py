"""Reference attention in plain torch (CPU and CUDA): gather pages, exact causal mask, SDPA.

Prefill segments run one sequence at a time (a fresh prompt uses its own K/V directly with
is_causal; a prompt with a cached prefix gathers its context from the pool with an explicit
bottom-right causal mask). All decode tokens run as one padded batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.attention.base import AttentionBackend
from engine.forward_batch import ForwardBatch
from engine.kv_pool import KVPool


def context_slots(pages: list[int], kv_len: int, page_size: int, device: torch.device) -> torch.Tensor:
    n_pages = (kv_len + page_size - 1) // page_size
    p = torch.tensor(pages[:n_pages], dtype=torch.long, device=device)
    return (p[:, None] * page_size + torch.arange(page_size, device=device)).reshape(-1)[:kv_len]


@dataclass
class _Meta:
    prefill: list[tuple[int, int, torch.Tensor | None, torch.Tensor | None]]  # (start, len, ctx slots, mask)
    decode_rows: torch.Tensor | None  # flat rows of decode tokens
    decode_slots: torch.Tensor | None  # [B * maxlen], flattened
    decode_mask: torch.Tensor | None  # [B, 1, 1, maxlen] additive (0 / -inf); None when lengths are equal


def _gather(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """cache [slots, H, D] rows at ``slots`` -> [len(slots), H, D] (a copy), gathered as whole rows
    of a 2-D view (a plain row copy; index_select on the 3-D view takes a slower path on CPU)."""
    return cache.view(cache.shape[0], -1).index_select(0, slots).view(-1, *cache.shape[1:])


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bool mask -> the additive float mask SDPA would build from it on every call (once per batch)."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))


class TorchBackend(AttentionBackend):
    name = "torch"

    def prepare(self, batch: ForwardBatch, pool: KVPool, num_heads: int) -> None:
        dev = pool.device
        ps = pool.page_size
        prefill = []
        dec_rows: list[int] = []
        dec_seqs = []
        for s in batch.seqs:
            if s.q_len == 1 and s.kv_len > 1:
                dec_rows.append(s.q_start)
                dec_seqs.append(s)
            elif s.kv_len == s.q_len:
                prefill.append((s.q_start, s.q_len, None, None))
            else:
                slots = context_slots(s.pages, s.kv_len, ps, dev)
                qpos = torch.arange(s.kv_len - s.q_len, s.kv_len, device=dev)
                allowed = torch.arange(s.kv_len, device=dev)[None, :] <= qpos[:, None]
                prefill.append((s.q_start, s.q_len, slots, _additive(allowed, pool.dtype)))
        rows = slots_m = mask_m = None
        if dec_seqs:
            maxlen = max(s.kv_len for s in dec_seqs)
            slots_m = torch.zeros(len(dec_seqs), maxlen, dtype=torch.long, device=dev)
            allowed = torch.zeros(len(dec_seqs), 1, 1, maxlen, dtype=torch.bool, device=dev)
            for i, s in enumerate(dec_seqs):
                slots_m[i, : s.kv_len] = context_slots(s.pages, s.kv_len, ps, dev)
                allowed[i, ..., : s.kv_len] = True
            # equal lengths (always so at batch 1) need no mask at all
            mask_m = None if all(s.kv_len == maxlen for s in dec_seqs) else _additive(allowed, pool.dtype)
            slots_m = slots_m.reshape(-1)
            rows = torch.tensor(dec_rows, dtype=torch.long, device=dev)
        batch.attn_meta = _Meta(prefill, rows, slots_m, mask_m)

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                batch: ForwardBatch, pool: KVPool) -> torch.Tensor:
        meta: _Meta = batch.attn_meta
        kc, vc = pool.layer_kv(layer)
        out = torch.empty_like(q)
        for start, n, slots, mask in meta.prefill:
            qs = q[start : start + n].transpose(0, 1).unsqueeze(0)
            if slots is None:
                # heads-major contiguous copies: the CPU flash kernel runs a few % faster on them
                # than on strided views of the fused projection (same result, bit for bit)
                qs = qs.contiguous()
                ks = k[start : start + n].transpose(0, 1).unsqueeze(0).contiguous()
                vs = v[start : start + n].transpose(0, 1).unsqueeze(0).contiguous()
                o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
            else:
                ks = _gather(kc, slots).transpose(0, 1).unsqueeze(0)
                vs = _gather(vc, slots).transpose(0, 1).unsqueeze(0)
                o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, enable_gqa=True)
            out[start : start + n] = o[0].transpose(0, 1)
        if meta.decode_rows is not None:
            b = meta.decode_rows.shape[0]
            qd = q[meta.decode_rows].unsqueeze(2)  # [B, Hq, 1, D]
            kd = _gather(kc, meta.decode_slots).view(b, -1, *kc.shape[1:]).transpose(1, 2)  # [B, Hkv, S, D]
            vd = _gather(vc, meta.decode_slots).view(b, -1, *vc.shape[1:]).transpose(1, 2)
            o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_mask, enable_gqa=True)
            out.index_copy_(0, meta.decode_rows, o.squeeze(2))
        return out
