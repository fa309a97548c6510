"""The operator's surface of tenants: the daemon's ``tenant_quota_bytes`` (flag, variable, YAML, checked
like every field), a running daemon's per-tenant usage and quota spills in the Stats RPC, ``kvstore
stats`` (table and JSON) and /metrics, and the engine's ``--shared-prefix-file`` (checked before the
model loads)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from engine.config import EngineConfig
from kvstore.block import encode_block
from kvstore.cli import main
from kvstore.client.client import KVStoreClient
from kvstore.config.store_config import load_config, load_settings
from kvstore.keys import Namespace, chain_keys
from kvstore.server.daemon import Daemon
from kvstore.store.tenants import name_of_salt
from tests.fixtures_kvstore import connect
from tiers.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
BLOCK = 64 * 1024


def test_quota_from_flag_env_and_yaml(tmp_path: Path) -> None:
    yml = tmp_path / "kv.yaml"
    yml.write_text("tenant_quota_bytes: 3Mi\ntiers:\n  - kind: cpu\n    capacity: 64Mi\n")
    assert load_config(["--cpu", "64Mi"], env={}).tenant_quota_bytes == 0  # off unless asked
    assert load_config(["--config", str(yml)], env={}).tenant_quota_bytes == 3 * 2**20
    env = {"TIERKV_TENANT_QUOTA_BYTES": "1Mi"}
    s = load_settings(["--config", str(yml)], env=env)
    assert s.config.tenant_quota_bytes == 2**20 and s.sources[("tenant_quota_bytes",)] == "TIERKV_TENANT_QUOTA_BYTES"
    s = load_settings(["--config", str(yml), "--tenant-quota", "2Mi"], env=env)
    assert s.config.tenant_quota_bytes == 2 * 2**20 and s.sources[("tenant_quota_bytes",)] == "--tenant-quota"


@pytest.mark.parametrize("value,needle", [("1k", "smaller than one block"), ("lots", "tenant_quota_bytes"),
                                          ("-1", "tenant_quota_bytes")])
def test_a_bad_quota_is_one_line(value: str, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle) as e:
        load_config(["--cpu", "64Mi", "--tenant-quota", value], env={})
    assert len(str(e.value).splitlines()) == 1


def _put(c: KVStoreClient, salt: str, n: int, seed: int) -> list[bytes]:
    ns = Namespace.from_model({"n": 1}, "sha256:q", "float32", page_size=4)
    keys = chain_keys(ns.with_tenant(salt), [seed * 100 + i for i in range(4 * n)])
    head = len(encode_block(keys[0], np.zeros(0, np.uint8)))
    c.put_many([(k, encode_block(k, np.zeros(BLOCK - head, np.uint8))) for k in keys])
    return keys


def _drained(c: KVStoreClient) -> None:
    """Wait until the spill queue is empty (a block on its way down is reported at the tier it left)."""
    deadline = time.monotonic() + 30
    while c.stats().pending_blocks and time.monotonic() < deadline:
        time.sleep(0.02)


def test_a_daemon_reports_tenants_and_their_quota_spills(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = load_config(["--cpu", str(8 * BLOCK), "--disk", f"{tmp_path / 'disk'}:{64 * BLOCK}", "--tenant-quota",
                       str(3 * BLOCK), "--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0",
                       "--stats-interval", "0", "--no-auth"], env={})
    daemon = Daemon(cfg)
    daemon.start()
    try:
        with connect(daemon, use_shm=False) as c:
            b = _put(c, "tenant-b", 2, seed=1)
            a = _put(c, "tenant-a", 5, seed=2)  # 2 over its quota: its own 2 oldest spill to disk
            _drained(c)
            assert c.lookup(b + a).tiers == ["cpu"] * 2 + ["disk"] * 2 + ["cpu"] * 3
            st = c.stats()
            assert st.tiers[0].quota_spills == 2
            rows = {(t.tier, t.tenant): (t.blocks, t.quota_spills) for t in st.tenants}
            ta, tb = name_of_salt("tenant-a"), name_of_salt("tenant-b")
            assert rows == {("cpu", ta): (3, 2), ("cpu", tb): (2, 0), ("disk", ta): (2, 0)}
        assert main(["stats", "--address", daemon.address, "--json"]) == 0
        doc = json.loads(capsys.readouterr().out)
        assert doc["tiers"][0]["quota_spills"] == 2
        assert {"tier": "cpu", "tenant": ta, "used_bytes": 3 * BLOCK, "blocks": 3, "quota_spills": 2} in doc["tenants"]
        assert main(["stats", "--address", daemon.address]) == 0
        table = capsys.readouterr().out
        assert "tenants:" in table and ta in table and "quota spills" in table
        with urllib.request.urlopen(f"http://127.0.0.1:{daemon.metrics_port}/metrics", timeout=10) as r:
            metrics = r.read().decode()
        assert f'tierkv_tenant_used_bytes{{tenant="{ta}",tier="cpu"}} {float(3 * BLOCK)}' in metrics
        assert 'tierkv_tier_quota_spills_total{tier="cpu"} 2.0' in metrics
    finally:
        daemon.stop()


def kvengine(*argv: str, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("TIERKV_")}
    return subprocess.run([sys.executable, "-m", "engine.cli", *argv], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, env={**base, **env})


def test_engine_shared_prefix_file_is_checked_before_the_model_loads(tmp_path: Path) -> None:
    good, bad = tmp_path / "good.yaml", tmp_path / "bad.yaml"
    good.write_text("- text: You are a helpful assistant.\n- ids: [1, 2, 3]\n")
    bad.write_text("- prompt: hello\n")
    ok = kvengine("serve", "--no-blend", "--check-config", "--shared-prefix-file", str(good))
    assert ok.returncode == 0 and f"shared_prefix_file='{good}'" in ok.stdout, ok.stderr[-800:]
    for argv, env in ((["--shared-prefix-file", str(bad)], {}), ([], {"TIERKV_ENGINE_SHARED_PREFIX_FILE": str(bad)}),
                      (["--shared-prefix-file", str(tmp_path / "missing.yaml")], {})):
        r = kvengine("serve", "--no-blend", "--check-config", *argv, **env)
        assert r.returncode == 2 and "shared prefix file" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert EngineConfig.from_env().shared_prefix_file == ""
