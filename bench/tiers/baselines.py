"""The raw baselines of bench.tiers: each tier's own library, called directly, set up exactly as
the tier sets it up, so a ratio prices our wrapper and nothing else.

- lmdb: ``lmdb_open_like`` opens an environment with DiskTier's flags and map size; the read is
  ``txn.get`` (bytes the caller owns, like ``DiskTier.get``). The store reads one block per call,
  so there is no batched variant to compare with.
- boto3: ``s3_client_like`` builds the client with S3Tier's botocore Config (timeouts, retries,
  pool size, path addressing, checksums only when required); the read is ``get_object().read()``.
- redis-py: ``redis_client_like`` uses RedisTier's connection options (socket read size, timeouts,
  retry, no health checks) and insists on the hiredis parser, as a user installing
  ``redis[hiredis]`` gets. Reads: ``GET`` (what the tier does per block) and one ``MGET`` of every
  key (what a batched caller could do; reported beside, not used for the ratio).

The settings are written out here rather than read from the tiers' private attributes;
tests/bench/tiers/test_figures.py compares them with what the tiers actually build, so a tier
that changes its settings fails that test until the baseline follows.
"""

from __future__ import annotations

import os
from typing import Any

import lmdb

from bench.servers import S3Endpoint


class BaselineError(RuntimeError):
    """A baseline cannot be set up as strong as promised (e.g. hiredis missing)."""


# -- lmdb (tiers/disk.py) ------------------------------------------------------------------
def lmdb_open_like(path: str | os.PathLike[str], map_size: int, *, sync: bool = True) -> lmdb.Environment:
    """An lmdb environment opened the way DiskTier opens its own (pass the tier's ``map_size``)."""
    os.makedirs(path, exist_ok=True)
    return lmdb.open(str(path), map_size=map_size, subdir=True, sync=sync, metasync=sync, max_dbs=0,
                     max_readers=256, lock=True)


def lmdb_get(env: lmdb.Environment, key: bytes) -> bytes | None:
    with env.begin() as txn:
        return txn.get(key)


# -- boto3 (tiers/s3.py) -------------------------------------------------------------------
def s3_config_like(*, connect_timeout_s: float = 1.0, read_timeout_s: float = 3.0, max_attempts: int = 2,
                   workers: int = 8) -> Any:
    """The botocore Config S3Tier builds from the same arguments (its defaults by default)."""
    from tiers.s3 import client_config

    return client_config(connect_timeout_s, read_timeout_s, max_attempts, workers)


def s3_client_like(ep: S3Endpoint) -> Any:
    import boto3

    return boto3.session.Session().client(
        "s3", endpoint_url=ep.url, aws_access_key_id=ep.access_key, aws_secret_access_key=ep.secret_key,
        region_name=ep.region, config=s3_config_like())


# -- redis-py (tiers/redis.py) -------------------------------------------------------------
def redis_client_like(url: str, *, read_chunk_bytes: int = 1 << 20, socket_timeout_s: float = 2.0,
                      connect_timeout_s: float = 1.0) -> Any:
    """A standalone redis-py client with RedisTier's options and the hiredis parser."""
    import redis
    import redis.utils
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    if not redis.utils.HIREDIS_AVAILABLE:
        raise BaselineError("hiredis is not installed: redis-py would parse replies in pure Python, a weaker "
                            "baseline than users get (pip install hiredis)")
    return redis.Redis.from_url(url, health_check_interval=0, socket_timeout=socket_timeout_s,
                                socket_connect_timeout=connect_timeout_s, retry=Retry(NoBackoff(), 1),
                                socket_read_size=read_chunk_bytes)
