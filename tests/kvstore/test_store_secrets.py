"""Credentials stay secret: a Redis URL's password and an S3 secret key never show in logs,
errors, reprs, stats or /metrics, and a refused credential says "authentication failed"
(not "cannot reach", which sends an operator after the network instead of the password).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from prometheus_client import generate_latest

from bench.servers import RedisServer, S3Endpoint, free_port
from kvstore.block import encode_block
from kvstore.config.store_config import load_config
from kvstore.server.metrics import StoreMetrics
from kvstore.store.tier_factory import build_store
from tests.fixtures_servers import TEST_BUCKET
from tiers.errors import TierAuthError, TierUnavailable
from tiers.redis import RedisTier
from tiers.s3 import S3Tier

pytestmark = pytest.mark.timeout(120)

PASSWORD = "s3cr3t-Pw-7781"
WRONG = "wr0ng-Pw-4410"


@pytest.fixture
def locked_redis(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path, password=PASSWORD)
    yield server
    server.stop()


def _k(i: int) -> bytes:
    return i.to_bytes(16, "little")


def _v(i: int) -> bytes:
    return encode_block(_k(i), np.full(16 * 1024, i, dtype=np.float32))


def _url(server: RedisServer, password: str | None) -> str:
    auth = f":{password}@" if password is not None else ""
    return f"redis://{auth}127.0.0.1:{server.port}/0"


def _everything_shown(caplog: pytest.LogCaptureFixture, *objects: object) -> str:
    return "\n".join([caplog.text, *(repr(o) for o in objects), *(str(o) for o in objects)])


def test_wrong_redis_password_says_authentication_failed(locked_redis: RedisServer) -> None:
    for password in (WRONG, None):  # a wrong password, and none at all
        with pytest.raises(TierAuthError, match="authentication failed") as err:
            RedisTier(_url(locked_redis, password), 1 << 20)
        assert WRONG not in str(err.value) and PASSWORD not in str(err.value)
        assert "cannot reach" not in str(err.value)
    with pytest.raises(TierUnavailable, match="cannot reach") as err2:  # unreachable stays distinct
        RedisTier(f"redis://:{PASSWORD}@127.0.0.1:{free_port()}/0", 1 << 20, connect_timeout_s=0.5)
    assert PASSWORD not in str(err2.value) and not isinstance(err2.value, TierAuthError)


def test_redis_password_absent_from_logs_reprs_stats_and_metrics(
    locked_redis: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    cfg = load_config(["--cpu", "1MiB", "--redis", locked_redis.url, "--redis-capacity", "8MiB"], env={})
    metrics = StoreMetrics()
    store = build_store(cfg, observer=metrics)
    metrics.bind(store)
    try:
        for i in range(20):  # 64 KiB blocks through a 1 MiB cpu tier: the rest live in redis
            store.put(_k(i), _v(i))
        store.flush()
        assert store.get(_k(0)) == _v(0)
        locked_redis.stop()  # now the tier fails: errors are logged, counted and shown in stats
        assert store.get(_k(1)) is None
        stats = store.stats()
        assert stats.tiers[1].errors >= 1 and stats.tiers[1].last_error
        shown = _everything_shown(caplog, cfg, store.levels[1].tier, stats) + generate_latest(metrics.registry).decode()
    finally:
        store.close()
    assert PASSWORD not in shown
    assert "redis://:***@127.0.0.1" in caplog.text  # the URL was logged (no maxmemory warning), masked


def test_wrong_s3_secret_says_authentication_failed_and_stays_secret(
    s3_endpoint: S3Endpoint, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    ep = s3_endpoint
    wrong_secret = "Zz" + ep.secret_key[2:][::-1]
    with pytest.raises(TierAuthError, match="authentication failed") as err:
        S3Tier(ep.url, TEST_BUCKET, 1 << 20, prefix="secrets/", access_key=ep.access_key,
               secret_key=wrong_secret, region=ep.region)  # fmt: skip
    env = {"AWS_ACCESS_KEY_ID": ep.access_key, "AWS_SECRET_ACCESS_KEY": ep.secret_key}
    cfg = load_config(["--cpu", "1MiB", "--s3", f"s3://{TEST_BUCKET}/secrets", "--s3-endpoint", ep.url], env=env)
    store = build_store(cfg)
    try:
        store.put(b"k" * 16, b"v")
        shown = _everything_shown(caplog, cfg, store.levels[1].tier, store.stats(), err.value)
    finally:
        store.close()
    assert ep.secret_key not in shown and wrong_secret not in shown


def test_redact_url_masks_every_place_a_password_goes() -> None:
    from tiers.redact import redact_url

    assert redact_url("redis://:pw1@h:6379/0") == "redis://:***@h:6379/0"
    assert redact_url("rediss://user:pw2@h:6380") == "rediss://user:***@h:6380"
    assert redact_url("redis://h:6379/0?password=pw3&db=1") == "redis://h:6379/0?password=***&db=1"
    assert redact_url("redis://h:6379/0") == "redis://h:6379/0" and redact_url("unix:///tmp/r.sock") == "unix:///tmp/r.sock"
