"""The engine's own forward pass for Llama-family decoders (Llama, Mistral, Qwen2).

RMSNorm -> fused QKV projection -> RoPE -> paged attention -> O projection -> RMSNorm ->
fused gate/up SwiGLU -> down projection; logits only at the rows a step needs. Weights come
from model_loader as HF-named tensors; QKV and gate/up are fused once here so a layer runs
three matmuls instead of six.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.attention.base import AttentionBackend
from engine.cpu_gemm import Linear, plain
from engine.forward_batch import ForwardBatch
from engine.kv_pool import KVPool
from engine.model_loader import ModelArch
from engine.rope import Rotary


@dataclass
class _Layer:
    ln_in: torch.Tensor
    w_qkv: torch.Tensor
    b_qkv: torch.Tensor | None
    w_o: torch.Tensor
    ln_post: torch.Tensor
    w_gate_up: torch.Tensor
    w_down: torch.Tensor


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """HF LlamaRMSNorm, op for op (so bit-identical), minus one temporary: w * y == y * w."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if y.dtype != x.dtype:
        return w * y.to(x.dtype)
    return y.mul_(w)


# Below a few rows MKL's sgemm switches to a GEMV-like kernel whose rounding differs; padding
# the last layer's row subset to this many rows keeps it bit-identical to the full-batch result.
_MIN_GEMM_ROWS = 8


def _pad_rows(rows: torch.Tensor, total: int) -> torch.Tensor:
    if rows.shape[0] >= _MIN_GEMM_ROWS:
        return rows
    extra = torch.arange(_MIN_GEMM_ROWS - rows.shape[0], dtype=rows.dtype, device=rows.device)
    return torch.cat([rows, extra])  # any rows will do; their outputs are dropped


class LlamaModel:
    def __init__(self, arch: ModelArch, weights: dict[str, torch.Tensor], device: torch.device,
                 dtype: torch.dtype) -> None:
        self.arch = arch
        self.device = device
        self.dtype = dtype
        cv = lambda t: t.to(device=device, dtype=dtype).contiguous()  # noqa: E731
        self.embed = cv(weights["model.embed_tokens.weight"])
        self.lm_head = self.embed if arch.tie_word_embeddings or "lm_head.weight" not in weights \
            else cv(weights["lm_head.weight"])
        self.norm = cv(weights["model.norm.weight"])
        self.layers: list[_Layer] = []
        for i in range(arch.num_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            bias = None
            if arch.attention_bias and a + "q_proj.bias" in weights:
                bias = cv(torch.cat([weights[a + n + "_proj.bias"] for n in "qkv"]))
            self.layers.append(_Layer(
                ln_in=cv(weights[p + "input_layernorm.weight"]),
                w_qkv=cv(torch.cat([weights[a + n + "_proj.weight"] for n in "qkv"])),
                b_qkv=bias,
                w_o=cv(weights[a + "o_proj.weight"]),
                ln_post=cv(weights[p + "post_attention_layernorm.weight"]),
                w_gate_up=cv(torch.cat([weights[p + "mlp.gate_proj.weight"], weights[p + "mlp.up_proj.weight"]])),
                w_down=cv(weights[p + "mlp.down_proj.weight"]),
            ))
        self.rotary = Rotary(arch.head_dim, arch.rope_theta, min(arch.max_position_embeddings, 8192),
                             dict(arch.rope_scaling) or None, device=device, dtype=dtype)
        self.q_size = arch.num_heads * arch.head_dim
        self.kv_size = arch.num_kv_heads * arch.head_dim
        #: every projection and the LM head: F.linear, or engine/cpu_gemm.py's choice per row count
        #: on the CPU (set by the engine)
        self.linear: Linear = plain

    def weights(self) -> list[torch.Tensor]:
        """The matrices of every projection and the LM head, as a step reads them."""
        out = [w for L in self.layers for w in (L.w_qkv, L.w_o, L.w_gate_up, L.w_down)]
        return [*out, self.lm_head]

    # The layer pieces are public so CacheBlend can run layers selectively.
    def qkv(self, layer: int, h: torch.Tensor, positions: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        a, L = self.arch, self.layers[layer]
        x = rms_norm(h, L.ln_in, a.rms_norm_eps)
        qkv = self.linear(x, L.w_qkv, L.b_qkv)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, a.num_heads, a.head_dim)
        k = k.view(-1, a.num_kv_heads, a.head_dim)
        v = v.reshape(-1, a.num_kv_heads, a.head_dim)
        q, k = self.rotary.apply(q, k, positions)
        return q, k, v

    def _qkv_packed(self, layer: int, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``qkv`` for the forward hot path: RoPE tables gathered once per batch (half width) and
        q and k rotated in one pass over the adjacent q|k columns of the fused projection."""
        a, L = self.arch, self.layers[layer]
        x = rms_norm(h, L.ln_in, a.rms_norm_eps)
        qkv = self.linear(x, L.w_qkv, L.b_qkv)
        n = qkv.shape[0]
        qk = qkv[:, : self.q_size + self.kv_size].view(n, a.num_heads + a.num_kv_heads, a.head_dim)
        qk = self.rotary.rotate_half_tables(qk, cos, sin)
        v = qkv[:, self.q_size + self.kv_size :].view(n, a.num_kv_heads, a.head_dim)
        return qk[:, : a.num_heads], qk[:, a.num_heads :], v

    def finish_layer(self, layer: int, h: torch.Tensor, attn_out: torch.Tensor, rows: int | None = None
                     ) -> torch.Tensor:
        """``rows``: the step's row count when ``h`` is a subset of its rows (the projections then
        take the form the whole step's would: engine/cpu_gemm.py)."""
        a, L, lin = self.arch, self.layers[layer], self.linear
        h = lin(attn_out.reshape(h.shape[0], -1), L.w_o, rows=rows).add_(h)  # == h + o, one temporary fewer
        x = rms_norm(h, L.ln_post, a.rms_norm_eps)
        gate_up = lin(x, L.w_gate_up, rows=rows)
        inter = gate_up.shape[-1] // 2
        gate = gate_up[:, :inter]
        F.silu(gate, inplace=True)
        gate.mul_(gate_up[:, inter:])  # silu(gate) * up in place; mm reads the strided rows as is
        return lin(gate, L.w_down, rows=rows).add_(h)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.linear(rms_norm(h, self.norm, self.arch.rms_norm_eps), self.lm_head).float()

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, pool: KVPool, attn: AttentionBackend) -> torch.Tensor:
        """Run the batch, writing new K/V into the pool; return logits [len(logit_indices), vocab]."""
        attn.prepare(batch, pool, self.arch.num_heads)
        cos, sin = self.rotary.half_cos_sin(batch.positions)
        h = self.embed.index_select(0, batch.input_ids)
        rows = batch.logit_indices
        last = self.arch.num_layers - 1
        for i in range(last + 1):
            q, k, v = self._qkv_packed(i, h, cos, sin)
            pool.write(i, batch.out_slots, k, v)
            o = attn.forward(i, q, k, v, batch, pool)
            if i == last and rows.shape[0] + _MIN_GEMM_ROWS < h.shape[0]:
                # Every row's K/V is in the pool now; past this point only the rows that need
                # logits matter, so the last O projection and MLP run on those rows alone.
                n = rows.shape[0]
                sel = _pad_rows(rows, h.shape[0])
                h = self.finish_layer(i, h.index_select(0, sel), o.index_select(0, sel), rows=h.shape[0])
                return self.logits(h[:n])
            h = self.finish_layer(i, h, o)
        return self.logits(h.index_select(0, rows))
