"""StoreConfig: YAML < env < CLI precedence, the embedded default, validation.

Sizes: tests/kvstore/test_sizes.py; the field-by-field merge, warnings and one-line errors:
tests/kvstore/test_settings.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from kvstore.config.sizes import parse_size
from kvstore.config.store_config import StoreConfig, TierConfig, load_config
from tiers.errors import ConfigError


def test_parse_size() -> None:
    assert parse_size("4GiB") == 4 << 30
    assert parse_size("512MiB") == 512 << 20
    assert parse_size("1.5GB") == 1_500_000_000
    assert parse_size("100") == 100 and parse_size(7) == 7
    assert parse_size("2Gi") == 2 << 30
    for bad in ("", "GiB", "4 parsecs", "-1GiB"):
        with pytest.raises(ConfigError):
            parse_size(bad)


def test_embedded_default(tmp_path: Path) -> None:
    cfg = load_config([], env={"TIERKV_CACHE_DIR": str(tmp_path)})
    assert [t.kind for t in cfg.tiers] == ["cpu", "disk"]
    assert cfg.tiers[0].capacity_bytes == 1 << 30 and cfg.tiers[1].path == str(tmp_path / "disk")


def test_cli_flags() -> None:
    cfg = load_config(
        ["--cpu", "4GiB", "--disk", "/data/kv:100GiB", "--s3", "s3://bucket/pre/fix", "--s3-endpoint",
         "http://127.0.0.1:8333", "--s3-admit-hits", "2", "--redis", "redis://127.0.0.1:6379",
         "--redis-cluster", "--listen", "127.0.0.1:7000", "--metrics-port", "9400", "--eviction", "s3fifo"],
        env={"AWS_ACCESS_KEY_ID": "AK", "AWS_SECRET_ACCESS_KEY": "SK"},
    )  # fmt: skip
    t = {x.kind: x for x in cfg.tiers}
    assert t["cpu"].capacity_bytes == 4 << 30 and t["disk"].path == "/data/kv" and t["disk"].capacity_bytes == 100 << 30
    assert t["s3"].bucket_prefix == ("bucket", "pre/fix") and t["s3"].endpoint == "http://127.0.0.1:8333"
    assert t["s3"].admit_min_hits == 2 and t["s3"].access_key_id == "AK" and "SK" not in repr(t["s3"])
    assert t["redis"].cluster and t["redis"].write_through and t["redis"].shared
    assert cfg.listen == "127.0.0.1:7000" and cfg.metrics_port == 9400
    assert {x.eviction for x in cfg.tiers} == {"s3fifo"}


def test_precedence_yaml_env_cli(tmp_path: Path) -> None:
    f = tmp_path / "kv.yaml"
    f.write_text(yaml.safe_dump({
        "listen": "127.0.0.1:1111", "metrics_port": 9000, "spill_queue_bytes": "64MiB", "promote_on_hit": False,
        "tiers": [{"kind": "cpu", "capacity": "2GiB", "eviction": "arc"},
                  {"kind": "disk", "path": "/yaml/disk", "capacity": "10GiB", "admit_min_hits": 1}],
    }))  # fmt: skip
    cfg = load_config(["--config", str(f)], env={})
    assert cfg.listen == "127.0.0.1:1111" and cfg.spill_queue_bytes == 64 << 20 and not cfg.promote_on_hit
    assert cfg.tiers[0].eviction == "arc" and cfg.tiers[1].admit_min_hits == 1
    env = {"TIERKV_CONFIG": str(f), "TIERKV_LISTEN": "127.0.0.1:2222", "TIERKV_CPU": "1GiB"}
    cfg = load_config([], env=env)
    assert cfg.listen == "127.0.0.1:2222" and cfg.tiers[0].capacity_bytes == 1 << 30
    assert cfg.tiers[1].path == "/yaml/disk"  # yaml tiers not overridden stay
    cfg = load_config(["--listen", "127.0.0.1:3333", "--cpu", "3GiB"], env=env)
    assert cfg.listen == "127.0.0.1:3333" and cfg.tiers[0].capacity_bytes == 3 << 30


def test_validation(tmp_path: Path) -> None:
    with pytest.raises(ConfigError):
        TierConfig("tape", 1)
    with pytest.raises(ConfigError):
        TierConfig("disk", 1)  # no path
    with pytest.raises(ConfigError):
        TierConfig("s3", 1, url="http://not-s3")
    with pytest.raises(ConfigError):
        TierConfig("cpu", 1, eviction="mru")
    with pytest.raises(ConfigError):
        StoreConfig(tiers=())
    with pytest.raises(ConfigError):
        StoreConfig(tiers=(TierConfig("cpu", 1), TierConfig("cpu", 2)))
    with pytest.raises(ConfigError, match="listen must be HOST:PORT"):
        StoreConfig(tiers=(TierConfig("cpu", 1 << 20),), listen="nowhere")
    with pytest.raises(ConfigError):
        load_config(["--cpu", "lots"], env={})


def test_bad_config_exits_cleanly(tmp_path: Path) -> None:
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "kvstore", "serve", "--cpu", "lots"], capture_output=True, text=True,
                       timeout=60)  # fmt: skip
    assert r.returncode == 2 and "bad size" in r.stderr and "Traceback" not in r.stderr


def test_breaker_and_ghost_sizes_reach_the_store(tmp_path) -> None:
    from kvstore.store.tier_factory import build_store

    cfg = load_config(["--cpu", "1Mi"], env={"TIERKV_TIER_DETACH_AFTER": "5", "TIERKV_GHOSTS_PER_TIER": "7"})
    assert (cfg.tier_detach_after, cfg.ghosts_per_tier) == (5, 7)
    store = build_store(cfg)
    try:
        assert store.levels[0].breaker.policy.failures == 5
        assert store._state.ghosts.per_tier == 7
    finally:
        store.close()
    with pytest.raises(ConfigError, match="tier_detach_after must be >= 1"):
        load_config(["--cpu", "1Mi"], env={"TIERKV_TIER_DETACH_AFTER": "0"})


def test_breaker_rate_and_spill_timeout_reach_the_store() -> None:
    from kvstore.store.tier_factory import build_store

    env = {"TIERKV_TIER_ERROR_WINDOW": "30", "TIERKV_TIER_ERROR_RATE": "0.4", "TIERKV_TIER_ERROR_MIN_CALLS": "12",
           "TIERKV_SPILL_PUT_TIMEOUT_S": "0.5"}
    store = build_store(load_config(["--cpu", "1Mi"], env=env))
    try:
        p = store.levels[0].breaker.policy
        assert (p.window, p.rate, p.min_calls, p.failures) == (30, 0.4, 12, 3)
        assert store._spill._put_timeout_s == 0.5
    finally:
        store.close()
    for var, value, msg in (("TIERKV_TIER_ERROR_MIN_CALLS", "21", "tier_error_min_calls in 1..tier_error_window"),
                            ("TIERKV_TIER_ERROR_RATE", "1.5", r"tier_error_rate must be in \(0, 1\]"),
                            ("TIERKV_SPILL_PUT_TIMEOUT_S", "0", "spill_put_timeout_s must be > 0")):  # fmt: skip
        with pytest.raises(ConfigError, match=msg) as e:
            load_config(["--cpu", "1Mi"], env={var: value})
        assert "\n" not in str(e.value)


def test_server_limits_load_and_validate(tmp_path: Path) -> None:
    env = {"TIERKV_MAX_KEYS_PER_CALL": "512", "TIERKV_PUT_STREAM_TIMEOUT_S": "2.5", "TIERKV_WORKERS": "6",
           "TIERKV_HEALTH_MAX_WATCHES": "3", "TIERKV_METRICS_TIMEOUT_S": "4"}
    cfg = load_config(["--cpu", "1Mi", "--traces-dir", str(tmp_path / "t")], env=env)
    assert (cfg.max_keys_per_call, cfg.put_stream_timeout_s, cfg.put_streams) == (512, 2.5, 3)  # half the workers
    assert (cfg.traces_path, cfg.health_max_watches, cfg.metrics_timeout_s) == (tmp_path / "t", 3, 4.0)
    for var, value, msg in (("TIERKV_MAX_KEYS_PER_CALL", "0", "max_keys_per_call must be in 1..65536"),
                            ("TIERKV_MAX_PUT_STREAMS", "9", r"max_put_streams must be in 0..workers \(8"),
                            ("TIERKV_PUT_STREAM_TIMEOUT_S", "0", "put_stream_timeout_s must be > 0"),
                            ("TIERKV_KEEPALIVE_TIMEOUT_S", "-1", "keepalive_timeout_s must be > 0"),
                            ("TIERKV_TRACE_MAX_RECORDS", "100000001", "trace_max_records must be in 1..100000000"),
                            ("TIERKV_HEALTH_MAX_WATCHES", "-1", "health_max_watches must be >= 0"),
                            ("TIERKV_METRICS_TIMEOUT_S", "0", "metrics_timeout_s must be > 0")):  # fmt: skip
        with pytest.raises(ConfigError, match=msg) as e:
            load_config(["--cpu", "1Mi"], env={var: value})
        assert "\n" not in str(e.value)
