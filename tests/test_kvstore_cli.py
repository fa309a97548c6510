"""The daemon's operator surface: --check-config, --metrics-listen, --shm-max-bytes, `kvstore health`,
and misspelt flags refused (they were silently ignored by `kvstore stats`)."""

from __future__ import annotations

import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from kvstore.cli import main
from kvstore.config import StoreConfig, TierConfig, load_config
from kvstore.launch import running_daemon
from kvstore.server import Daemon
from tiers.errors import ConfigError


def test_check_config_validates_without_serving(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--cpu", "64MiB", "--listen", "127.0.0.1:1", "--check-config"]) == 0
    out = capsys.readouterr().out
    assert "configuration OK" in out and "capacity_bytes=67108864" in out
    assert main(["serve", "--cpu", "lots", "--check-config"]) == 2
    assert "bad size 'lots'" in capsys.readouterr().err


def test_check_config_masks_secrets(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--redis", "redis://:hunter2@127.0.0.1:1/0", "--check-config"]) == 0
    out = capsys.readouterr().out
    assert "redis://" in out and "hunter2" not in out


def test_misspelt_flag_is_an_error() -> None:
    with pytest.raises(SystemExit) as e:
        main(["stats", "--adress", "127.0.0.1:1"])
    assert e.value.code == 2


def test_shm_max_bytes_reaches_the_daemon(tmp_path: Path) -> None:
    cfg = load_config(["--cpu", "16MiB", "--listen", "127.0.0.1:0", "--shm-max-bytes", "3MiB"], env={})
    assert cfg.shm_max_bytes == 3 * 2**20
    daemon = Daemon(cfg)
    try:
        assert daemon.sessions.max_bytes == 3 * 2**20
    finally:
        daemon.stop()
    with pytest.raises(ConfigError, match="shm_max_bytes"):
        StoreConfig(tiers=(TierConfig("cpu", 1 << 20),), shm_max_bytes=0)


def test_metrics_listen_binds_the_given_host() -> None:
    cfg = load_config(["--cpu", "16MiB", "--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.2:0"], env={})
    daemon = Daemon(cfg)
    daemon.start()
    try:
        body = urllib.request.urlopen(f"http://127.0.0.2:{daemon.metrics_port}/metrics", timeout=10).read()
        assert b"tierkv_" in body
    finally:
        daemon.stop()
    with pytest.raises(ConfigError, match="metrics_listen must be HOST:PORT"):
        load_config(["--metrics-listen", "9400"], env={})


def test_health_subcommand(tmp_path: Path) -> None:
    def health(address: str) -> int:
        return subprocess.run([sys.executable, "-m", "kvstore", "health", "--address", address, "--deadline", "2"],
                              capture_output=True, timeout=60).returncode

    with running_daemon(tmp_path, "--cpu", "16MiB") as address:
        assert health(address) == 0
    assert health(address) != 0  # stopped: not serving


def test_stream_port_is_the_one_offered() -> None:
    """An operator publishes the side channel's port (k8s hostPort): the daemon must bind that port."""
    from bench.servers import free_port
    from kvstore.client import KVStoreClient

    port = free_port()
    cfg = load_config(["--cpu", "16MiB", "--listen", "127.0.0.1:0", "--stream-port", str(port)], env={})
    daemon = Daemon(cfg)
    daemon.start()
    try:
        assert daemon.streams is not None and daemon.streams.port == port
        with KVStoreClient(daemon.address, use_shm=False) as c:
            from kvstore.proto import kvstore_pb2 as pb

            assert c._stub.OpenStream(pb.OpenStreamRequest(), timeout=10).port == port
    finally:
        daemon.stop()
    with pytest.raises(ConfigError, match="stream_port"):
        load_config(["--stream-port", "70000"], env={})
