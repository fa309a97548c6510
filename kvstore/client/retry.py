"""Retries with backoff as two small objects (after redis-py's retry.py + backoff.py).

Every daemon call is idempotent (puts of an already-held key are no-ops), so the client may
retry any of them; only transport failures are retried, never a refusal such as a bad block.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class ExponentialBackoff:
    base_s: float = 0.05
    cap_s: float = 1.0
    jitter: bool = True

    def delay(self, failures: int) -> float:
        """Seconds to sleep after the ``failures``-th failure (1-based)."""
        d = min(self.cap_s, self.base_s * (2 ** (failures - 1)))
        return random.uniform(d / 2, d) if self.jitter else d


@dataclass(frozen=True)
class Retry:
    attempts: int = 3  # total tries, including the first
    backoff: ExponentialBackoff = ExponentialBackoff()

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError("attempts must be >= 1")

    def call(self, fn: Callable[[], T], retry_on: tuple[type[BaseException], ...]) -> T:
        """Run ``fn``; on an error of a ``retry_on`` type sleep and try again, up to ``attempts``
        tries. Errors are typed before they get here (the client translates gRPC's)."""
        for failures in range(1, self.attempts + 1):
            try:
                return fn()
            except retry_on:
                if failures >= self.attempts:
                    raise
                time.sleep(self.backoff.delay(failures))
        raise AssertionError("unreachable")
