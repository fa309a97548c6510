"""Rotary position embeddings (the HF "rotate_half" convention), with llama3 frequency scaling.

Also the delta rotation CacheBlend needs: rotating an already-rotated K by (new - old)
positions equals rotating the raw K at the new position.
"""

from __future__ import annotations

import math

import torch


def inv_frequencies(head_dim: int, theta: float, scaling: dict | None = None) -> torch.Tensor:
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling and scaling.get("rope_type", scaling.get("type")) == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_ctx = float(scaling["original_max_position_embeddings"])
        low_wl, high_wl = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wl, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= high_wl) & (wavelen <= low_wl)
        inv = torch.where(is_mid, mid, scaled)
    return inv


class Rotary:
    """Precomputed cos/sin tables; ``apply`` rotates q/k of shape [tokens, heads, head_dim]."""

    def __init__(self, head_dim: int, theta: float, max_positions: int, scaling: dict | None = None,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> None:
        self.head_dim = head_dim
        self.inv_freq = inv_frequencies(head_dim, theta, scaling)
        self.dtype = dtype
        self.device = torch.device(device)
        self._build(max_positions)

    def _build(self, n: int) -> None:
        t = torch.arange(n, dtype=torch.int64).float()
        freqs = torch.outer(t, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos().to(self.device, self.dtype)
        self.sin = emb.sin().to(self.device, self.dtype)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        need = int(positions.max()) + 1 if positions.numel() else 0
        if need > self.cos.shape[0]:
            self._build(max(need, 2 * self.cos.shape[0]))
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    @staticmethod
    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rot * sin

    def apply(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.half_cos_sin(positions)
        return self.rotate_half_tables(q, cos, sin), self.rotate_half_tables(k, cos, sin)

    def half_cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin of the first half of head_dim, [tokens, 1, head_dim // 2] (both halves are equal)."""
        cos, sin = self.cos_sin(positions)
        half = self.head_dim // 2
        return cos[..., :half], sin[..., :half]

    @staticmethod
    def rotate_half_tables(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``rotate`` with half-width tables, into a fresh contiguous tensor and without the cat/neg
        temporaries. Bit-identical to ``rotate``: x1*c + (-x2)*s == x1*c - x2*s exactly."""
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        o1, o2 = out[..., :half], out[..., half:]
        torch.mul(x1, cos, out=o1)
        o1.sub_(x2 * sin)
        torch.mul(x2, cos, out=o2)
        o2.add_(x1 * sin)
        return out

    def delta_rotate(self, k: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """Rotate already-rotated K [tokens, heads, dim] by per-token position deltas (may be < 0)."""
        freqs = delta.to(torch.float64).unsqueeze(-1) * self.inv_freq.to(torch.float64)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos().to(k.dtype).unsqueeze(1)
        sin = emb.sin().to(k.dtype).unsqueeze(1)
        return self.rotate(k, cos, sin)
