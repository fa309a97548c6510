"""The shared tiers' secrets as files (kvstore/config/tier_secrets.py): the MAC secret's default
file, the Redis password and the S3 keys read from files on a real locked redis-server and a
real SeaweedFS, and each misuse refused in one line that never shows a secret.
"""

from __future__ import annotations

import stat
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from bench.servers import RedisServer, S3Endpoint
from kvstore.block import encode_block
from kvstore.config import tier_secrets
from kvstore.config.store_config import StoreConfig, TierConfig, load_config
from kvstore.store.tier_factory import build_store
from tests.fixtures_servers import TEST_BUCKET
from tiers.errors import ConfigError, TierAuthError

pytestmark = pytest.mark.timeout(120)

PASSWORD = "pw-" + "7" * 20


@pytest.fixture
def locked_redis(tmp_path: Path) -> Iterator[RedisServer]:
    (tmp_path / "redis").mkdir()
    server = RedisServer(tmp_path / "redis", password=PASSWORD)
    yield server
    server.stop()


def _secret(tmp: Path, name: str, value: str) -> str:
    (tmp / name).write_text(value + "\n")
    return str(tmp / name)


def _redis_cfg(url: str) -> StoreConfig:
    return StoreConfig(tiers=(TierConfig("cpu", 1 << 20), TierConfig("redis", 8 << 20, url=url, shared=True)))


def test_default_mac_secret_file_is_made_once_0600(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIERKV_CACHE_DIR", str(tmp_path / "run"))
    cfg = _redis_cfg("redis://127.0.0.1:1/0")
    first = tier_secrets.block_mac(cfg)
    path = tmp_path / "run" / "mac_secret"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and len(path.read_text().strip()) >= 32
    assert tier_secrets.block_mac(cfg).current_id == first.current_id  # daemons of one user agree


def test_previous_secret_files_are_read_and_listed(tmp_path: Path) -> None:
    cur, old = _secret(tmp_path, "cur", "c" * 40), _secret(tmp_path, "old", "o" * 40)
    cfg = StoreConfig(tiers=_redis_cfg("redis://h:6379/0").tiers, mac_secret_file=cur,
                      mac_previous_secret_files=f" {old} ,")  # fmt: skip
    mac = tier_secrets.block_mac(cfg)
    assert len(repr(mac).split("accepted=")[1].split(",")) == 2
    missing = StoreConfig(tiers=cfg.tiers, mac_secret_file=cur, mac_previous_secret_files=str(tmp_path / "gone"))
    with pytest.raises(ConfigError, match="mac secret: cannot read .*gone"):
        tier_secrets.block_mac(missing)


@pytest.mark.parametrize("argv,says", [
    (["--redis", "redis://:pw@h:6379/0", "--redis-password-file", "/x"], "password is given twice"),
    (["--redis", "redis://h:6379/0", "--redis-tls-ca", "/ca.pem"], "needs a rediss:// url"),
    (["--s3", "s3://b/p", "--s3-endpoint", "http://h:8333", "--s3-tls-ca", "/ca.pem"], "needs an https:// endpoint"),
    (["--redis-password-file", "/x"], "configured by --redis-password-file"),
])  # fmt: skip
def test_misused_secret_options_are_one_line(argv: list[str], says: str) -> None:
    with pytest.raises(ConfigError, match=says) as err:
        load_config(argv, env={})
    assert "\n" not in str(err.value) and ":pw@" not in str(err.value)


def test_redis_password_from_a_file(locked_redis: RedisServer, tmp_path: Path) -> None:
    url = f"redis://127.0.0.1:{locked_redis.port}/0"  # no password in it
    mac = _secret(tmp_path, "mac", "m" * 40)
    with pytest.raises(TierAuthError, match="authentication failed"):  # the file is what lets it in
        build_store(load_config(["--cpu", "1MiB", "--redis", url, "--mac-secret-file", mac], env={}))
    cfg = load_config(["--cpu", "1MiB", "--redis", url, "--mac-secret-file", mac,
                       "--redis-password-file", _secret(tmp_path, "pw", PASSWORD)], env={})  # fmt: skip
    assert PASSWORD not in repr(cfg)
    store = build_store(cfg)
    try:
        blocks = {i.to_bytes(16, "little"): encode_block(i.to_bytes(16, "little"), np.full(64 * 1024, i, np.float32))
                  for i in range(8)}  # fmt: skip
        for k, v in blocks.items():
            assert store.put(k, v)
        assert store.flush(timeout=60)
        assert [store.get(k) for k in blocks] == list(blocks.values())  # most of them from redis
        assert store.stats().tiers[1].hits > 0
    finally:
        store.close()
    with pytest.raises(ConfigError, match="redis password_file: .*empty"):
        build_store(load_config(["--cpu", "1MiB", "--redis", url, "--mac-secret-file", mac,
                                 "--redis-password-file", _secret(tmp_path, "blank", "")], env={}))  # fmt: skip


def test_s3_keys_from_files(s3_endpoint: S3Endpoint, tmp_path: Path) -> None:
    ep = s3_endpoint
    cfg = load_config(["--cpu", "1MiB", "--s3", f"s3://{TEST_BUCKET}/keyfiles", "--s3-endpoint", ep.url,
                       "--s3-access-key-id-file", _secret(tmp_path, "id", ep.access_key),
                       "--s3-secret-access-key-file", _secret(tmp_path, "sk", ep.secret_key),
                       "--mac-secret-file", _secret(tmp_path, "mac", "m" * 40)], env={})  # fmt: skip
    assert ep.secret_key not in repr(cfg)
    store = build_store(cfg)  # no AWS_* variable anywhere: the files are the only credentials
    keys = [b"k-keyfiles-%06d" % i for i in range(6)]
    try:
        for i, k in enumerate(keys):  # 256 KiB blocks through a 1 MiB cpu tier: some spill to s3
            assert store.put(k, encode_block(k, np.full(64 * 1024, i, np.float32)))
        assert store.flush(timeout=60)
        s3 = store.stats().tiers[1]
        assert s3.available and s3.spills > 0 and s3.errors == 0
    finally:
        for k in keys:
            store.delete(k)
        store.close()
