"""The CacheBlend forward: reuse chunk KV at new positions, recompute the tokens that deviate.

For a prompt of N tokens laid out as segments (prefix, documents, question, ...):
  1. assemble the reused KV per layer: the prefix chunk as is (exact), each document chunk
     with K re-rotated from positions 1..n to its place in the prompt (V unchanged);
  2. run layers 0 and 1 in full over all N tokens (exact causal attention);
  3. at layer 1 score every document token (``select``: K or V deviation between its fresh and
     reused row, or the attention-output deviation it causes; "random" for the baseline) and keep
     the top ``ratio`` share, each chunk's sink tokens first (selection.py); the recompute set is
     those tokens plus every non-prefix, non-document token (the question is always recomputed)
     and the last token;
  4. from layer 2 on run only the recompute set: its fresh K/V is scattered into the reused
     KV of that layer, and its queries attend with an exact causal mask (key position <= query
     position) over the merged KV. With gradual filtering the set starts larger and each of the
     next layers re-scores its document tokens and drops the least deviating, down to the budget.
Every layer's final K/V [N, kv_heads, head_dim] goes to ``sink`` (the pool, or a tensor).

The prefix (BOS + system prompt) is not recomputed after layer 1: its chunk was computed at
its true positions with nothing before it, so its KV is exactly what a full prefill computes.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from connector import native_rope
from connector.blend.chunk_cache import DOC, PREFIX, ChunkCache, ChunkStore, InProcessChunkStore
from connector.blend.errors import InvalidBlendRequestError
from connector.blend.metrics import BlendMetrics
from connector.blend.selection import SCORES, Selection, attention_deviation, chunk_sinks, kv_deviation, pick
from connector.blend.selfcheck import self_check
from connector.blend.spec import BlendSpec
from engine.model import LlamaModel

CHECK_LAYER = 1
Sink = Callable[[int, torch.Tensor, torch.Tensor], None]  # (layer, K [N,H,D], V [N,H,D])


@dataclass
class _Piece:
    start: int  # first position in the prompt
    kv: torch.Tensor  # [L, 2, n, H, D]
    old_start: int  # position of its first token when it was computed


@dataclass
class BlendPlan:
    ids: list[int]
    pieces: list[_Piece]
    doc_mask: torch.Tensor  # [N] bool: candidates for selection
    fixed_mask: torch.Tensor  # [N] bool: exact prefix, never recomputed after layer 1

    @property
    def num_tokens(self) -> int:
        return len(self.ids)


@dataclass
class BlendResult:
    kv: torch.Tensor | None  # [L, 2, N, H, D] when collected
    logits: torch.Tensor | None  # [vocab] at the last position
    recompute_idx: torch.Tensor  # positions recomputed at layers >= 2
    num_selected: int  # document tokens picked at the check layer
    num_document_tokens: int
    layer_rows: int = 0  # rows computed over the layers after the check layer (gradual filtering: more)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """q [m, Hq, D], k/v [N, Hkv, D] -> [m, Hq, D]; causal (m == N) when mask is None."""
    o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                       attn_mask=mask, is_causal=mask is None, enable_gqa=True)
    return o[0].transpose(0, 1)


class Blender:
    def __init__(self, model: LlamaModel, fingerprint: str, store: ChunkStore | None = None,
                 metrics: BlendMetrics | None = None, selection: Selection | None = None) -> None:
        self.model = model
        self_check(model)  # raises BlendUnsupportedError: refuse loudly
        self.metrics = metrics or BlendMetrics()
        self.bos = model.arch.bos_token_id
        self.chunks = ChunkCache(store or InProcessChunkStore(), fingerprint, self._compute_chunk, self.metrics)
        self.selection = selection or Selection()  # how the recompute set is chosen (selection.py)

    # -- dense prefill (chunks, and the reference) -------------------------------------------
    @torch.inference_mode()
    def prefill(self, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Full causal forward: KV [L, 2, n, H, D] and logits at the last position."""
        m = self.model
        t = torch.tensor(ids, dtype=torch.long, device=m.device)
        pos = torch.arange(len(ids), device=m.device)
        a = m.arch
        kv = torch.empty(a.num_layers, 2, len(ids), a.num_kv_heads, a.head_dim, dtype=m.dtype, device=m.device)
        h = m.embed[t]
        for layer in range(a.num_layers):
            q, k, v = m.qkv(layer, h, pos)
            kv[layer, 0], kv[layer, 1] = k, v
            h = m.finish_layer(layer, h, attend(q, k, v))
        return kv, m.logits(h[-1:])[0]

    def _compute_chunk(self, ids: list[int], kind: str) -> torch.Tensor:
        if kind == DOC and self.bos is not None:
            return self.prefill([self.bos] + ids)[0][:, :, 1:].contiguous()
        return self.prefill(ids)[0]

    # -- plan ----------------------------------------------------------------------------------
    def plan(self, spec: BlendSpec, tenant_salt: str = "") -> BlendPlan:
        """Fetch (or compute once) every chunk the spec names; lay them out in prompt order."""
        ids: list[int] = []
        pieces: list[_Piece] = []
        doc: list[bool] = []
        fixed: list[bool] = []
        doc_old = 1 if self.bos is not None else 0
        for i, seg in enumerate(spec.segments):
            n, start = len(seg.ids), len(ids)
            if seg.document:
                pieces.append(_Piece(start, self.chunks.get(seg.ids, DOC, tenant_salt), doc_old))
            elif i == 0:
                pieces.append(_Piece(0, self.chunks.get(seg.ids, PREFIX, tenant_salt), 0))
            ids.extend(seg.ids)
            doc += [seg.document] * n
            fixed += [i == 0 and not seg.document] * n
        dev = self.model.device
        return BlendPlan(ids, pieces, torch.tensor(doc, dtype=torch.bool, device=dev),
                         torch.tensor(fixed, dtype=torch.bool, device=dev))

    # -- blend ---------------------------------------------------------------------------------
    def _rotation(self, plan: BlendPlan, n: int) -> tuple[torch.Tensor, ...] | None:
        """Per-position tables moving each reused K row from its chunk position to its prompt
        position (``rerotate``'s math, gathered once per blend); rows that do not move get the
        identity (cos 1, sin 0), so a chunk already at its place is reused bit for bit."""
        m = self.model
        new = torch.arange(n, device=m.device)
        old = new.clone()
        for p in plan.pieces:
            c = min(p.kv.shape[2], n - p.start)
            if c > 0:
                old[p.start : p.start + c] = torch.arange(p.old_start, p.old_start + c, device=m.device)
        if torch.equal(old, new):
            return None
        cos_o, sin_o = m.rotary.cos_sin(old)
        cos_n, sin_n = m.rotary.cos_sin(new)
        still = (old == new)[:, None, None]
        one, zero = torch.ones_like(cos_o), torch.zeros_like(sin_o)
        return (torch.where(still, one, cos_o), torch.where(still, zero, -sin_o),
                torch.where(still, one, cos_n), torch.where(still, zero, sin_n))

    def _assemble(self, plan: BlendPlan, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Reused K and V of every layer, [L, n, H, D] each, K re-rotated to the prompt positions.

        Built once per blend with a handful of large ops (many small per-layer ops cost far more
        on a CPU with busy cores: every op waits for its slowest thread)."""
        a, m = self.model.arch, self.model
        K = torch.zeros(a.num_layers, n, a.num_kv_heads, a.head_dim, dtype=m.dtype, device=m.device)
        V = torch.zeros_like(K)
        for p in plan.pieces:
            c = min(p.kv.shape[2], n - p.start)
            if c > 0:
                K[:, p.start : p.start + c] = p.kv[:, 0, :c]
                V[:, p.start : p.start + c] = p.kv[:, 1, :c]
        rot = self._rotation(plan, n)
        if rot is not None:  # in place, natively where it can (connector/native_rope.py)
            K = native_rope.rerotate(K, rot)
        return K, V

    @torch.inference_mode()
    def blend(self, plan: BlendPlan, ratio: float = 0.15, select: str = "k", num_tokens: int | None = None,
              sink: Sink | None = None, collect: bool = False, want_logits: bool = True,
              generator: torch.Generator | None = None) -> BlendResult:
        """Blend the first ``num_tokens`` (default all) tokens of the plan; see the module doc."""
        m, a = self.model, self.model.arch
        t0 = time.perf_counter()
        N = plan.num_tokens if num_tokens is None else num_tokens
        dev = m.device
        ids = torch.tensor(plan.ids[:N], dtype=torch.long, device=dev)
        pos = torch.arange(N, device=dev)
        doc, fixed = plan.doc_mask[:N], plan.fixed_mask[:N]
        always = ~doc & ~fixed
        always[N - 1] = True
        cand = (doc & ~always).nonzero().squeeze(1)
        n_pick = min(len(cand), int(math.floor(ratio * len(cand) + 0.5)))
        if ratio >= 1.0:  # r = 1 recomputes everything, the exact prefix too: op for op a full prefill
            always = torch.ones_like(doc)
        if select not in SCORES:
            raise InvalidBlendRequestError(f"blend select must be one of {SCORES}, got {select!r}", "blend_select")
        sel = self.selection if select != "random" else Selection()  # the baseline: plain random draws
        n_start = sel.start_count(n_pick, len(cand))
        sinks = chunk_sinks([p.start for p in plan.pieces if p.start < N and bool(doc[p.start])], N,
                            sel.sink_tokens, dev)
        out = torch.empty(a.num_layers, 2, N, a.num_kv_heads, a.head_dim, dtype=m.dtype, device=dev) \
            if collect else None

        def emit(layer: int, K: torch.Tensor, V: torch.Tensor) -> None:
            if out is not None:
                out[layer, 0], out[layer, 1] = K, V
            if sink is not None:
                sink(layer, K, V)

        reK, reV = self._assemble(plan, N)
        h = m.embed[ids]
        idx = pos
        mask = None
        rows = 0  # rows computed over the selective layers (the recompute cost)
        for layer in range(a.num_layers):
            if layer <= CHECK_LAYER:  # full layers
                q, k, v = m.qkv(layer, h, pos)
                h = m.finish_layer(layer, h, attend(q, k, v))
                emit(layer, k, v)
                if layer == CHECK_LAYER:
                    K_old, V_old = k.clone(), v.clone()
                    K_old[cand], V_old[cand] = reK[layer][cand], reV[layer][cand]
                    keep = self._choose(select, q[always], pos[always], k, v, K_old, V_old, cand, n_start, sinks,
                                        generator)
                    idx = torch.unique(torch.cat([keep, always.nonzero().squeeze(1)]))  # sorted
                    h = h[idx]
                    # exact causal: key position <= query position (all rows: the plain causal kernel,
                    # so r = 1 runs op for op what a full prefill runs)
                    mask = None if len(idx) == N else pos[None, :] <= idx[:, None]
                continue
            K, V = reK[layer], reV[layer]  # this layer's buffer becomes its blended KV
            q, k, v = m.qkv(layer, h, idx)
            n_next = sel.count_after(layer - CHECK_LAYER, n_pick, n_start)
            chosen = ~always[idx]  # rows of selected document tokens
            drop = int(chosen.sum()) - n_next
            if drop > 0:  # gradual filtering: re-score the kept document tokens at this layer
                K_new, V_new = K.index_copy(0, idx, k), V.index_copy(0, idx, v)
                K_old, V_old = K_new.clone(), V_new.clone()
                c = idx[chosen]
                K_old[c], V_old[c] = K[c], V[c]
                keep = self._choose(select, q[~chosen], idx[~chosen], K_new, V_new, K_old, V_old, c, n_next, sinks,
                                    generator)
            K.index_copy_(0, idx, k)
            V.index_copy_(0, idx, v)
            rows += len(idx)
            h = m.finish_layer(layer, h, attend(q, K, V, mask))
            emit(layer, K, V)
            if drop > 0:
                r = torch.isin(idx, keep) | always[idx]
                h, idx = h[r], idx[r]
                mask = pos[None, :] <= idx[:, None]
        logits = m.logits(h[-1:])[0] if want_logits else None
        n_re = len(idx) if a.num_layers > CHECK_LAYER + 1 else N
        mt = self.metrics
        mt.blended_requests += 1
        mt.prompt_tokens += N
        mt.recomputed_tokens += n_re
        mt.document_tokens += len(cand)
        mt.selected_document_tokens += n_pick
        mt.blend_seconds += time.perf_counter() - t0
        return BlendResult(out, logits, idx, n_pick, len(cand), rows)

    def _choose(self, select: str, q: torch.Tensor, qpos: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                k_old: torch.Tensor, v_old: torch.Tensor, cand: torch.Tensor, n: int, sinks: torch.Tensor,
                generator: torch.Generator | None) -> torch.Tensor:
        """``n`` of the candidate positions ``cand`` by ``select`` (selection.py). ``k_new``/``v_new``
        are this layer's K/V over all positions with the candidates fresh, ``k_old``/``v_old`` the
        same with the candidates reused; ``q`` [m, Hq, D] are the always-recomputed queries (at
        positions ``qpos``) whose attention output the "attn" score watches."""
        if select == "random" or n == 0 or n >= len(cand):
            return pick(None, cand, n, sinks[:0], generator)
        if select == "attn":
            scores = attention_deviation(q, qpos, k_new, v_new, k_old, v_old, cand)
        elif select == "k":
            scores = kv_deviation(k_new[cand], k_old[cand])
        else:
            scores = kv_deviation(v_new[cand], v_old[cand])
        return pick(scores, cand, n, sinks, generator)
