"""Attention backends over the paged KV pool, chosen automatically (see select_backend)."""

from __future__ import annotations

from engine.attention.base import AttentionBackend


def select_backend(name: str, device) -> AttentionBackend:
    """'auto' -> flashinfer on CUDA when importable, else the torch reference backend."""
    import torch

    dev = torch.device(device)
    if name in ("auto", "flashinfer") and dev.type == "cuda":
        try:
            from engine.attention.flashinfer_backend import FlashInferBackend

            return FlashInferBackend(dev)
        except ImportError:
            if name == "flashinfer":
                raise
    if name == "flashinfer":
        raise ValueError("the flashinfer backend needs a CUDA device")
    from engine.attention.torch_backend import TorchBackend

    return TorchBackend()


__all__ = ["AttentionBackend", "select_backend"]
