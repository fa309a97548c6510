"""Which document tokens the blender recomputes: scores, the per-chunk sink tokens, gradual filtering.

The blender runs layers 0..CHECK_LAYER in full, then only a recompute set. This module decides
that set from the fresh and the reused K/V of a layer:

- score (the blend call's ``select``): "k" / "v" — squared L2 distance between a token's fresh
  and reused K (LMCache) or V (the paper); "attn" — how much the token's contribution to the
  attention output of the always-recomputed queries (the question and the last token) moves:
  sum over those queries and heads of ``|p_fresh * v_fresh - p_reused * v_reused|``; "random" —
  the same budget drawn at random (the baseline a score must beat).
- ``Selection.sink_tokens``: each document chunk's first n tokens go into the budget first. The
  chunk was computed right after BOS, so its first tokens carry the attention-sink role there and
  their reused KV is the most position-specific (they count within the budget: r = 0 stays
  reuse_0).
- ``Selection.gradual_factor`` / ``gradual_layers``: CacheBlend's gradual filtering — keep
  ``factor * budget`` tokens at the check layer, then at each of the next ``gradual_layers``
  layers re-score the kept tokens at that layer and drop the least deviating, down to the budget.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

SCORES = ("k", "v", "attn", "random")


@dataclass(frozen=True)
class Selection:
    sink_tokens: int = 0
    gradual_factor: float = 1.0
    gradual_layers: int = 0

    def __post_init__(self) -> None:
        if self.sink_tokens < 0:
            raise ValueError(f"sink_tokens must be >= 0, got {self.sink_tokens}")
        if self.gradual_factor < 1.0:
            raise ValueError(f"gradual_factor must be >= 1, got {self.gradual_factor}")
        if self.gradual_layers < 0:
            raise ValueError(f"gradual_layers must be >= 0, got {self.gradual_layers}")

    def start_count(self, n_pick: int, n_cand: int) -> int:
        """Document tokens kept at the check layer (more than the budget when filtering gradually)."""
        if n_pick == 0 or self.gradual_layers == 0:
            return n_pick
        return min(n_cand, math.ceil(n_pick * self.gradual_factor))

    def count_after(self, step: int, n_pick: int, n_start: int) -> int:
        """Document tokens kept after the ``step``-th layer past the check layer (1-based): a linear
        descent from ``n_start`` to ``n_pick`` over ``gradual_layers`` layers."""
        if step >= self.gradual_layers:
            return n_pick
        return n_pick + math.ceil((n_start - n_pick) * (1 - step / self.gradual_layers))


def chunk_sinks(starts: list[int], n: int, sink_tokens: int, device: torch.device) -> torch.Tensor:
    """Positions of the first ``sink_tokens`` tokens of each chunk starting at ``starts`` (< n)."""
    if sink_tokens == 0 or not starts:
        return torch.zeros(0, dtype=torch.long, device=device)
    pos = (torch.tensor(starts, device=device)[:, None] + torch.arange(sink_tokens, device=device)).flatten()
    return pos[pos < n]


def kv_deviation(fresh: torch.Tensor, reused: torch.Tensor) -> torch.Tensor:
    """Per row, squared L2 distance between fresh and reused K (or V) rows [m, H, D] -> [m]."""
    return (fresh.float() - reused.float()).pow(2).sum(dim=(1, 2))


def attention_deviation(q: torch.Tensor, q_pos: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                        k_old: torch.Tensor, v_old: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Score ``rows`` (key positions) by how much their contribution to the attention output of
    the queries ``q`` [m, Hq, D] at positions ``q_pos`` changes between the key/value set
    ``k_new``/``v_new`` and ``k_old``/``v_old`` [N, Hkv, D]: sum over queries and query heads of
    ``|| p_new[j] * v_new[j] - p_old[j] * v_old[j] ||_1`` (causal: key j counts for a query at p
    when j <= p)."""
    g = q.shape[1] // k_new.shape[1]
    scale = q.shape[-1] ** -0.5
    vis = torch.arange(k_new.shape[0], device=q.device)[None, :] <= q_pos[:, None]  # [m, N]

    def contrib(K: torch.Tensor, V: torch.Tensor) -> torch.Tensor:
        Kg, Vg = K.float().repeat_interleave(g, 1), V.float().repeat_interleave(g, 1)  # [N, Hq, D]
        s = torch.einsum("mhd,nhd->hmn", q.float(), Kg) * scale
        p = torch.softmax(s.masked_fill(~vis[None], float("-inf")), -1)[:, :, rows]  # [Hq, m, r]
        return p[..., None] * Vg[rows].transpose(0, 1)[:, None]  # [Hq, m, r, D]

    return (contrib(k_new, v_new) - contrib(k_old, v_old)).abs().sum(dim=(0, 1, 3))


def pick(scores: torch.Tensor | None, cand: torch.Tensor, n: int, sinks: torch.Tensor,
         generator: torch.Generator | None = None) -> torch.Tensor:
    """``n`` of the candidate positions ``cand``: those in ``sinks`` first, then the highest
    ``scores`` (aligned with ``cand``), or random ones when ``scores`` is None. Sorted."""
    if n >= len(cand):
        return cand
    if n == 0:
        return cand[:0]
    is_sink = torch.isin(cand, sinks) if len(sinks) else torch.zeros_like(cand, dtype=torch.bool)
    forced = cand[is_sink][:n]
    rest, m = cand[~is_sink], n - len(forced)
    if m == 0:
        return forced.sort().values
    if scores is None:
        chosen = rest[torch.randperm(len(rest), generator=generator)[:m].to(cand.device)]
    else:
        chosen = rest[scores[~is_sink].topk(m).indices]
    return torch.cat([forced, chosen]).sort().values
