"""Sampling parameters (validated) and the sampler: greedy, temperature, top-k, top-p, seed."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.errors import InvalidRequestError

SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed takes


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidRequestError("max_tokens must be an integer >= 1", "max_tokens")
        if not 0.0 <= self.temperature <= 100.0:
            raise InvalidRequestError("temperature must be in [0, 100]", "temperature")
        if self.top_k < 0:
            raise InvalidRequestError("top_k must be >= 0", "top_k")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError("top_p must be in (0, 1]", "top_p")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidRequestError("stop must be non-empty strings", "stop")
        # how many stop strings and how long: the engine's limits (engine/limits.py), checked where it is known
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:  # else torch raises on the step thread
            raise InvalidRequestError(f"seed must be in [{SEED_MIN}, {SEED_MAX}]", "seed")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Pick the next token from one row of logits [vocab] (float32)."""
    if params.greedy:
        return int(torch.argmax(logits))
    x = logits / params.temperature
    if params.top_k > 0:
        k = min(params.top_k, x.shape[-1])
        kth = torch.topk(x, k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, idx = torch.sort(x, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        cum = torch.cumsum(probs, dim=-1)
        drop = cum - probs > params.top_p  # keep the smallest set whose mass reaches top_p
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
        x = torch.full_like(x, float("-inf")).scatter(0, idx, sorted_x)
    probs = torch.softmax(x, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))
