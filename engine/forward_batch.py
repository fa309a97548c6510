"""What one forward pass computes: a flat run of new tokens from several sequences.

Each sequence contributes ``q_len`` new tokens whose K/V go to ``out_slots`` and that attend
to its first ``kv_len`` cached positions (prefix already in the pool + the new tokens).
Decode is the case q_len == 1. Logits are computed only at ``logit_indices``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class SeqSlice:
    q_start: int  # offset of this sequence's first new token in the flat batch
    q_len: int
    kv_len: int  # context length after this step (positions 0 .. kv_len-1)
    pages: list[int]  # page table covering at least kv_len positions


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] long
    positions: torch.Tensor  # [T] long
    out_slots: torch.Tensor  # [T] long, pool slot of each new token
    seqs: list[SeqSlice]
    logit_indices: torch.Tensor  # [n] long, rows that need logits
    attn_meta: Any = field(default=None)  # filled by the attention backend's prepare()

    @staticmethod
    def build(seqs: list[tuple[list[int], int, list[int]]], page_size: int, device: torch.device,
              logits: str | list[bool] = "last") -> ForwardBatch:
        """seqs: (new_token_ids, num_cached_before, pages).

        logits: 'last' (each sequence's last new token), 'all' (every row), or one bool per
        sequence saying whether its last new token needs logits."""
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        slices: list[SeqSlice] = []
        last: list[int] = []
        for toks, cached, pages in seqs:
            start = len(ids)
            n = len(toks)
            ids.extend(toks)
            p = list(range(cached, cached + n))
            pos.extend(p)
            slots.extend(pages[i // page_size] * page_size + i % page_size for i in p)
            slices.append(SeqSlice(start, n, cached + n, pages))
            last.append(start + n - 1)
        if logits == "all":
            li = list(range(len(ids)))
        elif logits == "last":
            li = last
        else:
            li = [row for row, want in zip(last, logits, strict=True) if want]
        t = lambda x: torch.tensor(x, dtype=torch.long, device=device)  # noqa: E731
        return ForwardBatch(t(ids), t(pos), t(slots), slices, t(li))
