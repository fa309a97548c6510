"""Build tiers and the TieredStore from a StoreConfig: the only place config meets tiers.

Tier modules are imported lazily so a daemon without S3 or Redis never imports boto3/redis.
Remote tiers are built without touching their server; the store then probes every tier: one
that cannot be reached starts detached (the daemon serves, degraded, and attaches it once it
answers), one that fails for any other reason (refused credentials, a bad URL) raises
(ConfigError/TierError) instead of being silently dropped.

Redis and S3 tiers are wrapped in a SignedTier (kvstore/store/signed_tier.py): every block
written there carries the cluster's MAC and every block read back is checked, its secrets read
here (kvstore/config/tier_secrets.py); their reads are bounded by the largest block plus its MAC.
"""

from __future__ import annotations

from dataclasses import replace

from kvstore.config import tier_secrets
from kvstore.config.store_config import StoreConfig, TierConfig
from kvstore.store.breaker import BreakerPolicy
from kvstore.store.observers import Observer
from kvstore.store.signed_tier import SignedTier
from kvstore.store.tier_bookkeeping import LevelOptions
from kvstore.store.tiered_store import TieredStore
from tiers.base import Tier
from tiers.mac import TRAILER_BYTES


def build_tier(tc: TierConfig, shared_arena: bool = True, max_value_bytes: int | None = None) -> Tier:
    """``shared_arena``: a cpu tier's arena in a memfd clients may map (else private memory, which
    gets transparent huge pages where memfds do not); ``max_value_bytes``: the longest value a
    redis or s3 tier reads (longer ones are refused without being read whole)."""
    if tc.kind == "cpu":
        from tiers.cpu import CpuTier

        return CpuTier(tc.capacity_bytes, shared=None if shared_arena else False, huge_pages=tc.huge_pages)
    if tc.kind == "disk":
        from tiers.disk import DiskTier

        return DiskTier(tc.path, tc.capacity_bytes)
    if tc.kind == "s3":
        from tiers.s3 import S3Tier

        bucket, prefix = tc.bucket_prefix
        access_key, secret_key = tier_secrets.s3_keys(tc)
        return S3Tier(
            tc.endpoint or None, bucket, tc.capacity_bytes, prefix=prefix, access_key=access_key,
            secret_key=secret_key, region=tc.region or "us-east-1", connect=False, ca_bundle=tc.tls_ca or None,
            max_value_bytes=max_value_bytes,
        )  # fmt: skip
    from tiers.redis import RedisTier

    return RedisTier(tc.url, tc.capacity_bytes, cluster=tc.cluster, ttl_s=tc.ttl_s or None, connect=False,
                     password=tier_secrets.redis_password(tc), tls_ca=tc.tls_ca or None,
                     max_value_bytes=max_value_bytes)  # fmt: skip


def level_options(tc: TierConfig) -> LevelOptions:
    return LevelOptions(
        eviction=tc.eviction, write_through=tc.write_through, admit_min_hits=tc.admit_min_hits, shared=tc.shared
    )


def build_store(cfg: StoreConfig, observer: Observer | None = None) -> TieredStore:
    built: list[tuple[Tier, LevelOptions]] = []
    mac = tier_secrets.block_mac(cfg) if tier_secrets.signs(cfg) else None
    try:
        for i, tc in enumerate(cfg.tiers):
            tier = build_tier(tc, cfg.shm and cfg.shm_arena, max_value_bytes=cfg.max_block_bytes + TRAILER_BYTES)
            if mac is not None and tc.kind in tier_secrets.SIGNED_KINDS:
                tier = SignedTier(tier, mac, on_reject=observer.corrupt if observer is not None else None)
            opts = level_options(tc)
            built.append((tier, replace(opts, fair_share=cfg.tenant_fair_share) if i == 0 else opts))  # the top
        return TieredStore(
            built,
            promote_on_hit=cfg.promote_on_hit,
            spill_queue_bytes=cfg.spill_queue_bytes,
            ghosts_per_tier=cfg.ghosts_per_tier,
            tenant_quota_bytes=cfg.tenant_quota_bytes,
            observer=observer,
            spill_put_timeout_s=cfg.spill_put_timeout_s,
            replay_backlog_keys=cfg.replay_backlog_keys,
            replay_park_bytes=cfg.replay_park_bytes,
            breaker=BreakerPolicy.from_retry(cfg.tier_retry_s, cfg.tier_detach_after, window=cfg.tier_error_window,
                                             rate=cfg.tier_error_rate, min_calls=cfg.tier_error_min_calls),
        )
    except BaseException:
        for tier, _ in built:
            tier.close()
        raise
