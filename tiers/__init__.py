"""Storage tiers: cpu (memory arena), disk (lmdb), s3 (boto3), redis (redis-py).

The classes are exported lazily (PEP 562) so ``import tiers`` does not pull in boto3, redis or
lmdb for a process that only needs one tier or just the error types.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tiers.cpu import CpuTier
    from tiers.disk import DiskTier
    from tiers.redis import RedisTier
    from tiers.s3 import S3Tier

_LAZY = {"CpuTier": "tiers.cpu", "DiskTier": "tiers.disk", "S3Tier": "tiers.s3", "RedisTier": "tiers.redis"}

__all__ = ["CpuTier", "DiskTier", "RedisTier", "S3Tier"]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'tiers' has no attribute {name!r}")
    return getattr(import_module(module), name)
