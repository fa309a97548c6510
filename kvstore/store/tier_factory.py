"""Build tiers and the TieredStore from a StoreConfig: the only place config meets tiers.

Tier modules are imported lazily so a daemon without S3 or Redis never imports boto3/redis.
Remote tiers are built without touching their server; the store then probes every tier: one
that cannot be reached starts detached (the daemon serves, degraded, and attaches it once it
answers), one that fails for any other reason (refused credentials, a bad URL) raises
(ConfigError/TierError) instead of being silently dropped.
"""

from __future__ import annotations

from kvstore.config.store_config import StoreConfig, TierConfig
from kvstore.store.breaker import BreakerPolicy
from kvstore.store.observers import Observer
from kvstore.store.tier_bookkeeping import LevelOptions
from kvstore.store.tiered_store import TieredStore
from tiers.base import Tier


def build_tier(tc: TierConfig, shared_arena: bool = True) -> Tier:
    """``shared_arena``: a cpu tier's arena in a memfd clients may map (else private memory, which
    gets transparent huge pages where memfds do not)."""
    if tc.kind == "cpu":
        from tiers.cpu import CpuTier

        return CpuTier(tc.capacity_bytes, shared=None if shared_arena else False, huge_pages=tc.huge_pages)
    if tc.kind == "disk":
        from tiers.disk import DiskTier

        return DiskTier(tc.path, tc.capacity_bytes)
    if tc.kind == "s3":
        from tiers.s3 import S3Tier

        bucket, prefix = tc.bucket_prefix
        return S3Tier(
            tc.endpoint or None, bucket, tc.capacity_bytes, prefix=prefix,
            access_key=tc.access_key_id or None, secret_key=tc.secret_access_key or None,
            region=tc.region or "us-east-1", connect=False,
        )  # fmt: skip
    from tiers.redis import RedisTier

    return RedisTier(tc.url, tc.capacity_bytes, cluster=tc.cluster, ttl_s=tc.ttl_s or None, connect=False)


def level_options(tc: TierConfig) -> LevelOptions:
    return LevelOptions(
        eviction=tc.eviction, write_through=tc.write_through, admit_min_hits=tc.admit_min_hits, shared=tc.shared
    )


def build_store(cfg: StoreConfig, observer: Observer | None = None) -> TieredStore:
    built: list[tuple[Tier, LevelOptions]] = []
    try:
        for tc in cfg.tiers:
            built.append((build_tier(tc, cfg.shm and cfg.shm_arena), level_options(tc)))
        return TieredStore(
            built,
            promote_on_hit=cfg.promote_on_hit,
            spill_queue_bytes=cfg.spill_queue_bytes,
            ghosts_per_tier=cfg.ghosts_per_tier,
            tenant_quota_bytes=cfg.tenant_quota_bytes,
            observer=observer,
            spill_put_timeout_s=cfg.spill_put_timeout_s,
            breaker=BreakerPolicy.from_retry(cfg.tier_retry_s, cfg.tier_detach_after, window=cfg.tier_error_window,
                                             rate=cfg.tier_error_rate, min_calls=cfg.tier_error_min_calls),
        )
    except BaseException:
        for tier, _ in built:
            tier.close()
        raise
