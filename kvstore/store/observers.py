"""The hooks the TieredStore reports to: tier timings (metrics plug in) and accesses (a trace plugs in)."""

from __future__ import annotations

from typing import Protocol

OP_GET, OP_PUT, OP_LOOKUP = 0, 1, 2  # an access's kind (the op byte of a trace record, kvstore/ops/trace.py)


class AccessObserver(Protocol):
    """What TieredStore calls for each access when a trace runs (``level``: index, None = none)."""

    def __call__(self, op: int, key: bytes, size: int, level: int | None) -> None: ...


class Observer(Protocol):
    """Receives timings of tier reads/writes (kvstore/server/metrics.py implements it with histograms)."""

    def read(self, tier: str, nbytes: int, seconds: float) -> None: ...

    def write(self, tier: str, nbytes: int, seconds: float) -> None: ...

    def corrupt(self, tier: str, reason: str) -> None:
        """A block read from ``tier`` failed verification (kvstore.block.block_fault) and was deleted."""


class NullObserver:
    def read(self, tier: str, nbytes: int, seconds: float) -> None:
        pass

    def write(self, tier: str, nbytes: int, seconds: float) -> None:
        pass

    def corrupt(self, tier: str, reason: str) -> None:
        pass
