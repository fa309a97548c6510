"""The daemon's operator surface: --check-config, --metrics-listen, --shm-max-bytes, `kvstore health`,
and misspelt flags refused (they were silently ignored by `kvstore stats`)."""

from __future__ import annotations

import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from bench.servers import running_daemon
from kvstore.cli import main
from kvstore.config.store_config import StoreConfig, TierConfig, load_config
from kvstore.server.daemon import Daemon
from tests.fixtures_kvstore import connect, fetch_one
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

    port = free_port()
    cfg = load_config(["--cpu", "16MiB", "--listen", "127.0.0.1:0", "--stream-port", str(port)], env={})
    daemon = Daemon(cfg)
    daemon.start()
    try:
        assert daemon.streams is not None and daemon.streams.port == port
        with connect(daemon, use_shm=False) as c:
            from kvstore.proto import kvstore_pb2 as pb

            assert c._stub.OpenStream(pb.OpenStreamRequest(), timeout=10).port == port
    finally:
        daemon.stop()
    with pytest.raises(ConfigError, match="stream_port"):
        load_config(["--stream-port", "70000"], env={})


def _block(key: bytes) -> bytes:
    import numpy as np

    from kvstore.block import encode_block

    return encode_block(key, np.arange(1024, dtype="f4"), layout="T")


STABLE_TIER_KEYS = {"name", "used_bytes", "capacity_bytes", "blocks", "hits", "misses", "hit_ratio", "evictions",
                    "spills", "promotions", "dropped", "errors", "read_bytes", "write_bytes", "available", "last_error",
                    "refused", "detaches", "attaches", "skipped_writes",  # the circuit breaker's (added, never renamed)
                    "quota_spills",  # the tenant quota's
                    "replayed", "replay_dropped", "replay_skipped", "replay_parked"}  # the replay of writes skipped while detached


def test_stats_hit_ratio_json_and_watch(capsys: pytest.CaptureFixture[str]) -> None:
    import json
    import signal


    cfg = load_config(["--cpu", "16Mi", "--listen", "127.0.0.1:0", "--stats-interval", "0"], env={})
    daemon = Daemon(cfg)
    daemon.start()
    try:
        assert not daemon.stats_log.running  # --stats-interval 0: no summary thread
        with connect(daemon, use_shm=False) as c:
            key = b"stats-key-000001"
            assert c.put(key, _block(key)) and fetch_one(c, key) is not None
            assert fetch_one(c, b"absent-key-00001") is None and fetch_one(c, b"absent-key-00002") is None
        assert main(["stats", "--address", daemon.address, "--json"]) == 0
        doc = json.loads(capsys.readouterr().out)
        assert {"version", "address", "time", "tiers", "pending_blocks", "pending_bytes", "parked_blocks",
                "parked_bytes"} <= set(doc)
        (cpu,) = doc["tiers"]
        assert set(cpu) == STABLE_TIER_KEYS and cpu["name"] == "cpu" and cpu["blocks"] == 1
        assert cpu["hits"] >= 1 and cpu["misses"] >= 2
        assert cpu["hit_ratio"] == pytest.approx(cpu["hits"] / (cpu["hits"] + cpu["misses"]))
        assert main(["stats", "--address", daemon.address]) == 0
        header, row = capsys.readouterr().out.splitlines()[:2]
        assert header.split()[6] == "hit%" and row.split()[8] == f"{100 * cpu['hit_ratio']:.1f}%"
        watch = subprocess.Popen([sys.executable, "-m", "kvstore", "stats", "--address", daemon.address, "--json",
                                  "--watch", "0.2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert watch.stdout is not None
            first, second = json.loads(watch.stdout.readline()), json.loads(watch.stdout.readline())
            assert second["time"] > first["time"] and second["tiers"][0]["blocks"] == 1
            watch.send_signal(signal.SIGINT)  # Ctrl-C
            assert watch.wait(timeout=60) == 0
            assert "Traceback" not in watch.stderr.read()  # type: ignore[union-attr]
        finally:
            if watch.poll() is None:
                watch.kill()
    finally:
        daemon.stop()
    with pytest.raises(SystemExit) as e:
        main(["stats", "--watch", "-1"])
    assert e.value.code == 2


def test_daemon_logs_effective_config_and_periodic_stats(tmp_path: Path) -> None:
    """The start log shows every effective value and its source, the token masked; then a summary line."""
    import time

    from bench.servers import spawn_daemon, stop_daemon

    token = "c0ffee" * 8
    log_path = tmp_path / "daemon.log"
    proc, _ = spawn_daemon(tmp_path, "--cpu", "16Mi", "--stats-interval", "0.2", env={"TIERKV_TOKEN": token},
                           log_path=log_path)
    try:
        deadline = time.monotonic() + 120  # a generous bound on a busy box, not a timing assertion
        while "kvstore.stats: stats: cpu" not in log_path.read_text() and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        stop_daemon(proc)
    text = log_path.read_text()
    assert "kvstore.stats: stats: cpu 0 B/16.0 MiB hit - spills 0 errors 0 | queue 0 blocks" in text
    assert "config cpu tier capacity_bytes = 16777216  (--cpu)" in text
    assert "config stats_interval_s = 0.2  (--stats-interval)" in text
    assert "config token = '***'  (TIERKV_TOKEN)" in text and token not in text


def test_version_and_help_show_defaults_and_env(capsys: pytest.CaptureFixture[str]) -> None:
    from importlib.metadata import version

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"kvstore {version('tierkv')}"
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: 127.0.0.1:50551; env TIERKV_LISTEN)" in text and "(default: 60; env TIERKV_STATS_INTERVAL_S)" in text
    from kvstore.config.flags import OPTIONS

    for o in OPTIONS:
        assert f"env {o.env})" in text, o.flag
    with pytest.raises(SystemExit):
        main(["stats", "--help"])
    assert "(default: 127.0.0.1:50551)" in " ".join(capsys.readouterr().out.split())


def test_serve_bad_values_one_line_each_exit_2() -> None:
    """Without --check-config too: every bad value one line on stderr, exit 2, no traceback."""
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("TIERKV_")}
    r = subprocess.run([sys.executable, "-m", "kvstore", "serve", "--cpu", "4gb"], capture_output=True, text=True,
                       timeout=120, env={**env, "TIERKV_WORKERS": "abc"})
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.splitlines() == [
        "kvstore: workers = 'abc' (from TIERKV_WORKERS): Input should be a valid integer, unable to parse string as "
        "an integer",
        "kvstore: cpu tier capacity_bytes = '4gb' (from --cpu): bad size '4gb': units are case-sensitive: write 4G or "
        "4GB for 4x10^9 bytes, or 4Gi or 4GiB for 4x2^30",
    ]
